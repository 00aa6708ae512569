"""expected_digests on a ~1B-parameter Llama-shaped checkpoint, against the
time to hash the same bytes.

    .venv/bin/python benches/bench_expected.py [--repeat 3] [--no-cold] [--only target|lora]

The checkpoint (hidden 2048, intermediate 5632, 16 layers, 16 heads, 4 KV
heads, vocab 32000: 0.97 B parameters, 1.94 GB bf16, one shard) is written
once under .bench/. Each figure runs in a fresh process:

- ``sha256_many``: the checkpoint's tensors (and the adapter's, in the
  model's dtype) already in memory, hashed; the floor for hashing those bytes
  (the engine's ranks hold about the same bytes);
- two cases: the target alone, and the target with one rank-16 LoRA adapter
  on every linear layer given as the trainer's tensors (``--only`` picks one);
- ``expected_digests`` at TP=1 and TP=2 (both ranks), page cache warm: total
  time, its split into building + loading the rank models and hashing them,
  and the peak RSS against a process that imports vLLM and configures the
  same model without loading it;
- "a step" is the second call in one process, as a trainer makes one per
  step; the first call also imports vLLM's model code (reported apart);
- cold (the checkpoint's pages evicted with ``POSIX_FADV_DONTNEED`` before the
  timed call): the bytes read from the disk (``/proc/self/io`` read_bytes)
  against the checkpoint's size, so that t ranks are seen not to mean t reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from ceiling import machine

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
}

COMMON = """
import json, resource, sys, time
def io_read():
    with open("/proc/self/io") as f:
        return int(next(l for l in f if l.startswith("read_bytes")).split()[1])
def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
def anon_mib():  # private memory now (RSS also counts the mapped checkpoint's page-cache pages)
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("RssAnon")).split()[1]) / 1024
"""

ADAPTER = """
def adapter(lora):
    import torch
    from weight_checker.testing.models import lora_config, lora_tensors
    if lora != "lora":
        return {}
    shape = json.load(open(sys.argv[1] + "/config.json"))
    tensors = lora_tensors(7, r=16, config=shape, embeddings=False)
    return {"loras": {"a": (tensors, lora_config(r=16, alpha=32, embeddings=False))}, "max_lora_rank": 16,
            "max_loras": 1}
"""

HASH_ONLY = (
    COMMON
    + ADAPTER
    + """
from safetensors.torch import load_file
import torch, weight_checker
tensors = list(load_file(sys.argv[1] + "/model.safetensors").values())
lora = adapter(sys.argv[2])
if lora:  # the slots hold the adapter in the model's dtype (rank 16 = max_lora_rank: no padding)
    tensors += [t.to(torch.bfloat16) for t in lora["loras"]["a"][0].values()]
t = time.perf_counter()
weight_checker.sha256_many(tensors)
print(json.dumps({"seconds": time.perf_counter() - t, "bytes": sum(x.nbytes for x in tensors)}))
"""
)

VLLM_ONLY = (
    COMMON
    + """
import os
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
from vllm.engine.arg_utils import EngineArgs
import weight_checker, torch
EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
           tensor_parallel_size=int(sys.argv[2])).create_engine_config()
print(json.dumps({"peak_mib": peak_mib(), "anon_mib": anon_mib()}))
"""
)

EXPECT = (
    COMMON
    + ADAPTER
    + """
import os
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
import vllm, weight_checker, torch
path, tp, cold, lora = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "cold", adapter(sys.argv[4])
t = time.perf_counter()
first = weight_checker.expected_digests(path, tp=tp, **lora)  # imports vLLM's model code, builds, loads, hashes
first_s = time.perf_counter() - t
if cold:  # evict the checkpoint's pages only: vLLM's own files stay cached
    fd = os.open(path + "/model.safetensors", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
before = io_read()
t = time.perf_counter()
out = weight_checker.expected_digests(path, tp=tp, **lora)  # a trainer's next step, same process
seconds = time.perf_counter() - t
assert out == first
print(json.dumps({"first": first_s, "seconds": seconds, "split": out.seconds, "keys": len(out),
                  "peak_mib": peak_mib(), "anon_mib": anon_mib(), "read_bytes": io_read() - before}))
"""
)


def make_checkpoint(path: Path, shape: dict[str, int] | None = None) -> Path:
    """A bf16 Llama checkpoint of ``shape`` (default :data:`SHAPE`) at ``path``, written once."""
    shape = shape or SHAPE
    if (path / "model.safetensors").exists():
        return path
    import torch
    import transformers
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = transformers.LlamaConfig(**shape, torch_dtype="bfloat16")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    h, i, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(layers):
        pre = f"model.layers.{n}."
        shapes |= {
            pre + "self_attn.q_proj.weight": (h, h),
            pre + "self_attn.k_proj.weight": (kv, h),
            pre + "self_attn.v_proj.weight": (kv, h),
            pre + "self_attn.o_proj.weight": (h, h),
            pre + "mlp.gate_proj.weight": (i, h),
            pre + "mlp.up_proj.weight": (i, h),
            pre + "mlp.down_proj.weight": (h, i),
            pre + "input_layernorm.weight": (h,),
            pre + "post_attention_layernorm.weight": (h,),
        }
    torch.manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        # Weights as a trained model's are distributed (no NaN: an FP8
        # quantization of them is the real computation, bench_quantized.py).
        tensors[name] = (torch.randn(shape) * 0.02).to(torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def run(script: str, *args: str) -> dict:
    """The last line of ``script``'s output, run in a fresh process."""
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm(path: Path) -> None:
    with open(path / "model.safetensors", "rb") as f:
        while f.read(64 << 20):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache runs")
    ap.add_argument("--only", choices=["target", "lora"], help="one of the two cases (default: both)")
    args = ap.parse_args()
    ckpt = make_checkpoint(ROOT / ".bench" / "expected-1b")
    size = (ckpt / "model.safetensors").stat().st_size
    print(machine())
    print(f"checkpoint: {ckpt}, {size / 1e9:.2f} GB (Llama-shaped, {SHAPE['num_hidden_layers']} layers)")
    warm(ckpt)
    for case in [args.only] if args.only else ["target", "lora"]:
        what = "the target" if case == "target" else "the target + one rank-16 adapter on every linear layer"
        print(f"\n== {what}")
        hashes = [run(HASH_ONLY, str(ckpt), case) for _ in range(args.repeat)]
        h = statistics.median(r["seconds"] for r in hashes)
        print(f"  sha256_many over the same bytes in memory: {h:.3f} s ({hashes[0]['bytes'] / h / 1e9:.2f} GB/s)")
        for tp in (1, 2):
            measure(ckpt, size, case, tp, h, args)


def measure(ckpt: Path, size: int, case: str, tp: int, h: float, args: argparse.Namespace) -> None:
    base = run(VLLM_ONLY, str(ckpt), str(tp))
    runs = [run(EXPECT, str(ckpt), str(tp), "warm", case) for _ in range(args.repeat)]
    t = statistics.median(r["seconds"] for r in runs)
    first = statistics.median(r["first"] for r in runs)
    best = min(runs, key=lambda r: r["seconds"])
    shard = size / tp / 2**20
    print(f"\n expected_digests, TP={tp} (all {tp} rank(s), {best['keys']} keys), median of {args.repeat}, warm")
    print(
        f"  a step: {t:.3f} s = {t / h:.2f} x the hashing time (goal <= 1.5); "
        f"load {best['split']['load']:.3f} s + hash {best['split']['hash']:.3f} s (best run)"
    )
    print(f"  the first call in a process (imports vLLM's model code): {first:.3f} s")
    print(
        f"  peak RSS {max(r['peak_mib'] for r in runs):.0f} MiB (with the mapped checkpoint's page-cache pages);"
        f" private memory after {max(r['anon_mib'] for r in runs):.0f} MiB; vLLM imported and configured alone"
        f" {base['peak_mib']:.0f} MiB ({base['anon_mib']:.0f} private) + one rank's shard {shard:.0f} MiB"
    )
    if not args.no_cold and case == "target":
        cold = run(EXPECT, str(ckpt), str(tp), "cold", case)
        print(
            f"  cold (checkpoint evicted from the page cache): {cold['seconds']:.3f} s, read from disk"
            f" {cold['read_bytes'] / 1e9:.2f} GB = {cold['read_bytes'] / size:.2f} x the checkpoint"
        )
        warm(ckpt)


if __name__ == "__main__":
    main()
