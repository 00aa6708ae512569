"""What recording chain states costs a passing check: ``expected_digests``
with every tensor's block-boundary states recorded (the default) against
none (``WEIGHT_CHECKER_BLOCK_STATES_MIN_MB`` set past every tensor).

    .venv/bin/python benches/bench_block_states.py [--repeat 7]

bench_expected.py's Llama-shaped checkpoint (1.71 GB bf16, 16 layers,
written once under .bench/), its weights given as a state dict; at TP=1 and
TP=2, both ways taken in turn in one process (a step being a call after a
first), best and median of the runs, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench_expected import make_checkpoint
from ceiling import machine

ROOT = Path(__file__).resolve().parent.parent
SETTING = "WEIGHT_CHECKER_BLOCK_STATES_MIN_MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    import weight_checker
    from safetensors.torch import load_file

    ckpt = make_checkpoint(ROOT / ".bench" / "expected-1b")
    print(machine())
    weights = load_file(str(ckpt / "model.safetensors"))
    for tp in (1, 2):
        weight_checker.expected_digests(ckpt, weights, tp=tp)  # imports, builds
        times: dict[str, list[float]] = {"states": [], "none": []}
        for _ in range(args.repeat):
            for mode in times:
                os.environ[SETTING] = "0" if mode == "states" else "1000000"
                started = time.perf_counter()
                expected = weight_checker.expected_digests(ckpt, weights, tp=tp)
                times[mode].append(time.perf_counter() - started)
                assert bool(expected.block_states) == (mode == "states")
                if mode == "states":
                    kept = sum(len(b) for s in expected.block_states.values() for b in s.states)
        s, n = times["states"], times["none"]
        print(
            f"TP={tp} ({len(expected)} keys): with states {min(s):.3f} / {statistics.median(s):.3f} s, "
            f"without {min(n):.3f} / {statistics.median(n):.3f} s (best / median): "
            f"{min(s) / min(n):.3f}x / {statistics.median(s) / statistics.median(n):.3f}x; "
            f"states kept {kept / 1e6:.2f} MB"
        )
    os.environ.pop(SETTING, None)


if __name__ == "__main__":
    main()
