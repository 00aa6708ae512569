"""expected_digests of an online fp8_per_channel engine on a ~1 GB
Llama-shaped bf16 checkpoint, against hashing the engine's tensors.

    .venv/bin/python benches/bench_quantized.py [--repeat 3]

The checkpoint (hidden 2048, intermediate 5632, 8 layers, vocab 32000: 0.52 B
parameters, 1.05 GB bf16) is written once under .bench/. Each figure runs in a
fresh process, the checkpoint in the page cache, a step being the second call
in one process (as a trainer makes one per step):

- ``hash``: ``sha256_many`` over contiguous copies of the tensors the
  engine holds after vLLM's processing (fp8 weights, fp32 scales, bf16
  embeddings and norms), taken from every rank's processed model at that
  TP: the bytes read at the hash's ceiling, the strict reference;
- ``held``: ``weight_checker.checksum`` over the same tensors laid out as
  the engine holds them (each FP8 weight a transposed ``[K, N]`` view of
  ``[N, K]`` storage): what the engine's own checksum of them costs, the
  reference of issue 55's goal (at most 2x it). A TP=2 engine's narrower
  transposes hash faster than a TP=1 one's;
- ``expected``: ``expected_digests(..., quantization="fp8_per_channel")`` at
  TP=1 and TP=2 (both ranks), with its split: building, loading and vLLM's
  processing of each rank (``load``, both passes at TP=2) and hashing, and
  the memory its pool keeps for the next call (``warm_memory``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench_expected import SHAPE as EXPECTED_SHAPE
from bench_expected import make_checkpoint, warm
from ceiling import machine

ROOT = Path(__file__).resolve().parent.parent
#: bench_expected.py's Llama shape with 8 layers (bench_explain_expected.py's): about 1 GB bf16.
SHAPE = {**EXPECTED_SHAPE, "num_hidden_layers": 8}

EXPECTED = """
import json, sys, time
import weight_checker
ckpt, tp = sys.argv[1], int(sys.argv[2])
weight_checker.expected_digests(ckpt, tp=tp, quantization="fp8_per_channel")  # imports, first build
t = time.perf_counter()
e = weight_checker.expected_digests(ckpt, tp=tp, quantization="fp8_per_channel")
total = time.perf_counter() - t
from weight_checker.expected.vllm import warm_memory
kept = warm_memory.POOL.kept_bytes  # what the pool keeps for the next call
print(json.dumps({"seconds": total, "keys": len(e), "split": dict(e.seconds), "kept": kept}))
"""

HASH = """
import json, sys, time
import torch
import weight_checker
from weight_checker.expected.vllm import quantized
ckpt, tp = sys.argv[1], int(sys.argv[2])
held = []
one_rank, all_ranks = quantized.rank_digests, quantized.ranks_digests
def keep(model, prefix):
    held.extend((prefix + n, t.detach().contiguous()) for n, t in model.named_parameters())
def keep_one(model, prefix):
    keep(model, prefix)
    return one_rank(model, prefix)
def keep_all(models, *args):
    for model, prefix in models:
        keep(model, prefix)
    return all_ranks(models, *args)
quantized.rank_digests, quantized.ranks_digests = keep_one, keep_all
weight_checker.expected_digests(ckpt, tp=tp, quantization="fp8_per_channel")
views = [t.view(-1).view(torch.uint8).numpy() for _, t in held]
# As the engine holds them (every rank's): vLLM keeps qweight.t() of an [N, K] tensor.
engine = {n: (t.t().contiguous().t() if t.dtype == torch.float8_e4m3fn else t) for n, t in held}
def best_of(fn):
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
flat = best_of(lambda: weight_checker.sha256_many(views))
as_held = best_of(lambda: weight_checker.checksum(list(engine.items())))
print(json.dumps({"seconds": flat, "held": as_held, "bytes": sum(v.nbytes for v in views)}))
"""


def run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def setup(doc: str, what: str) -> tuple[argparse.Namespace, Path]:
    """A bench of this ~1 GB checkpoint: its ``--repeat``, the checkpoint
    (written once, in the page cache), the CPU and the checkpoint printed."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    ckpt = make_checkpoint(ROOT / ".bench" / "quantized-0.5b", SHAPE)
    size = (ckpt / "model.safetensors").stat().st_size
    print(machine())
    print(f"checkpoint: {ckpt}, {size / 1e9:.2f} GB bf16 (Llama-shaped, {SHAPE['num_hidden_layers']} layers){what}")
    warm(ckpt)
    return args, ckpt


def main() -> None:
    args, ckpt = setup(__doc__ or "", "")
    for _ in range(args.repeat):
        line = []
        for tp in (1, 2):
            # The reference is this TP's engine: every rank's tensors as it holds them.
            hashed = run(HASH, str(ckpt), str(tp))
            got = run(EXPECTED, str(ckpt), str(tp))
            split = ", ".join(f"{k} {v:.2f}" for k, v in sorted(got["split"].items()))
            line.append(
                f"TP={tp}: hash {hashed['seconds']:.3f} s ({hashed['bytes'] / 1e9:.2f} GB held; "
                f"{hashed['bytes'] / hashed['seconds'] / 1e9:.2f} GB/s), as held {hashed['held']:.3f} s; "
                f"expected {got['seconds']:.2f} s = {got['seconds'] / hashed['seconds']:.1f}x hash, "
                f"{got['seconds'] / hashed['held']:.1f}x as held ({split}; "
                f"{got['kept'] / 1e9:.2f} GB kept for the next call)"
            )
        print("  " + "; ".join(line))


if __name__ == "__main__":
    main()
