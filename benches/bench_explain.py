"""What explaining a failed check costs (issue 43), against hashing the
mismatched tensors once, side by side in one run.

    .venv/bin/python benches/bench_explain.py [--repeat 5]

A 0.94 GB bf16 "model" of eight 8B-shaped MLP matrices (4096 x 14336,
117 MB each) is the expected state; the "engine" holds it with faults:

- ``zeros``: one tensor delivered as zeros;
- ``stale-rows``: one tensor whose second half of rows is the previous step's
  (the previous step's tensors kept, as ``history``);
- ``unknown``: one tensor with one byte flipped in every block (no cause
  matches: every candidate is tried on every differing run: the worst case);
- ``4 tensors``: two zeros, one stale half, one unknown at once.

The reference is ``digest_tensors`` of the mismatched tensors (the Rust
core, every core: what a checksum of them costs). An explanation is
:func:`weight_checker.verify.explain.explain` with the engine's block digests
computed in this process (the worker's function over the engine's tensors,
on a thread while this side hashes the expected blocks, as against a real
engine) and the expected tensors given (a ``TensorMap``: no recompute).
Printed: the whole explanation, and this side's alone (the engine's answers
ready: a real engine hashes its blocks on its own cores, while this side
hashes the expected ones).
A check that passes runs none of it (``explain`` is never called).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from weight_checker.hashing.blocks import block_digests
from weight_checker.hashing.digests import digest_tensors
from weight_checker.verify.explain import TensorMap, Version, explain

ROWS, COLS, N = 4096, 14336, 8
PREFIX = "dp0:pp0:pcp0:tp0:"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        name = fields.get("model name\t", "").strip()
        family = fields.get("cpu family\t", "").strip()
        model = fields.get("model\t\t", "").strip()
        return f"{name} (family {family} model {model}), {torch.get_num_threads()} threads"
    except OSError:
        return platform.processor()


def engine_fetch(held: dict[str, torch.Tensor], spent: list[float]):
    def fetch(keys, block_bytes):
        start = time.perf_counter()
        digests = block_digests([held[k] for k in keys], [block_bytes] * len(keys), keys)
        spent.append(time.perf_counter() - start)
        return {
            k: {"digests": d, "block_bytes": block_bytes, "nbytes": held[k].nbytes, "shape": list(held[k].shape),
                "dtype": "bfloat16"}
            for k, d in zip(keys, digests, strict=True)
        }  # fmt: skip

    return fetch


def sha(t: torch.Tensor) -> str:
    return digest_tensors(["t"], [t])[0][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    keys = [f"{PREFIX}model.layers.{i}.mlp.down_proj.weight" for i in range(N)]
    new = {k: (torch.randn(ROWS, COLS, generator=g) * 0.02).to(torch.bfloat16) for k in keys}
    old = {k: (v.float() + 0.001 * torch.randn(v.shape, generator=g)).to(torch.bfloat16) for k, v in new.items()}
    expected = {k: sha(v) for k, v in new.items()}
    previous = Version("step-11", {k: sha(v) for k, v in old.items()}, TensorMap(old))

    def faulty(kind: str, key: str) -> torch.Tensor:
        t = new[key]
        if kind == "zeros":
            return torch.zeros_like(t)
        if kind == "stale-rows":
            return torch.cat([t[: ROWS // 2], old[key][ROWS // 2 :]])
        out = t.clone()  # "unknown": one element changed in every block of 64 rows
        out.view(-1)[:: 64 * COLS] += 1
        return out

    scenarios = {
        "zeros": {keys[0]: "zeros"},
        "stale-rows": {keys[1]: "stale-rows"},
        "unknown": {keys[2]: "unknown"},
        "4 tensors": {keys[0]: "zeros", keys[1]: "stale-rows", keys[2]: "unknown", keys[3]: "zeros"},
    }
    print(f"cpu: {cpu_name()}; torch {torch.__version__}")
    print(f"model: {N} tensors of {ROWS} x {COLS} bf16, {sum(t.nbytes for t in new.values()) / 1e9:.2f} GB")
    print(f"{'scenario':<12} {'mismatched':>10} {'hash once':>10} {'explain':>10} {'ratio':>6} {'this side':>10} "
          f"{'ratio':>6}  causes")  # fmt: skip
    for name, faults in scenarios.items():
        held = {**new, **{k: faulty(kind, k) for k, kind in faults.items()}}
        current = {k: sha(v) for k, v in held.items()}
        mismatches = {k: "changed" for k in faults}
        mismatched = [held[k] for k in faults]
        once, whole, side = [], [], []
        causes: dict[str, str] = {}
        for _ in range(args.repeat):
            start = time.perf_counter()
            digest_tensors(list(faults), mismatched)
            once.append(time.perf_counter() - start)
            start = time.perf_counter()
            found = explain(mismatches, current, expected, engine_fetch(held, []), TensorMap(new), history=[previous])
            whole.append(time.perf_counter() - start)
            causes = found.causes()
            # This side alone: the engine's answers ready (a real engine hashes on its own cores).
            answers: dict[tuple[tuple[str, ...], int], dict] = {}

            def cached(keys: list[str], block_bytes: int, answers: dict = answers, held: dict = held) -> dict:
                if (tuple(keys), block_bytes) not in answers:
                    answers[tuple(keys), block_bytes] = engine_fetch(held, [])(keys, block_bytes)
                return answers[tuple(keys), block_bytes]

            explain(mismatches, current, expected, cached, TensorMap(new), history=[previous])
            start = time.perf_counter()
            explain(mismatches, current, expected, cached, TensorMap(new), history=[previous])
            side.append(time.perf_counter() - start)
        o, w, s = statistics.median(once), statistics.median(whole), statistics.median(side)
        nbytes = sum(t.nbytes for t in mismatched)
        summary = ", ".join(sorted(set(causes.values())))
        print(
            f"{name:<12} {nbytes / 1e6:>8.0f}MB {o:>9.3f}s {w:>9.3f}s {w / o:>6.2f} {s:>9.3f}s {s / o:>6.2f}  {summary}"
        )
    print("a check that passes: explain() is not called (0 s, no block digests asked)")


if __name__ == "__main__":
    main()
