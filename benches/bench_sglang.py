"""This package's checksum inside a real SGLang engine against SGLang's own
``/weights_checker`` checksum, side by side in one run (issue 49).

    .venv/bin/python benches/bench_sglang.py [--repeat 5] [--shape llama8b-layers|qwen2.5-0.5b] [--layers 2]

One SGLang 0.5.23 server on this CPU (TP=1, the test-only kernel stand-in,
``weight_checker.testing.sglang``) serves one of two shapes, bf16:

- ``llama8b-layers`` (the default): a Llama with an 8B model's layer shapes
  (hidden 4096, MLP 14336, 32 heads, 8 KV heads; ``--layers`` of them, about
  0.44 GB a layer), a 1000-row vocabulary: a few large tensors;
- ``qwen2.5-0.5b``: Qwen2.5-0.5B's own shapes (hidden 896, MLP 4864, 14
  heads, 2 KV heads, 24 layers, 151,936-row vocabulary tied to the head:
  0.99 GB, 170 tensors): a model of about 1 GB as it is.

The two requests alternate, each timed from the client (HTTP, SGLang's
fan-out to the rank and back included):

- the reference: ``POST /weights_checker {"action": "checksum"}``, SGLang's
  own: one tensor at a time, ``hashlib``'s SHA-256 on one core, 8 bytes kept;
- ``POST /weight_checker {"action": "checksum"}``: this package's route, the
  Rust core over the same tensors in the rank, full SHA-256.

Both walk the same tensors (the run checks that the keys agree and that every
digest starts with SGLang's value). It prints the medians, their ratio, and
the rate against this machine's calibrated ceiling.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


#: shape name -> (architecture, config fields)
SHAPES = {
    "llama8b-layers": (
        "llama",
        {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
         "num_hidden_layers": 2},
    ),
    "qwen2.5-0.5b": (
        "qwen2",
        {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
         "num_hidden_layers": 24, "vocab_size": 151936, "tie_word_embeddings": True},
    ),
}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b-layers")
    ap.add_argument("--layers", type=int, default=2, help="llama8b-layers: how many")
    args = ap.parse_args()

    import weight_checker
    from weight_checker.testing.sglang.launch import sglang_python, sglang_server
    from weight_checker.testing.sglang.models import write_tiny_sglang_model

    python = sglang_python(ROOT)
    if python is None:
        print("bench_sglang: no SGLang environment (scripts/dev-env.sh makes .venv-sglang)", file=sys.stderr)
        return 2
    arch, shapes = SHAPES[args.shape]
    if args.shape == "llama8b-layers":
        shapes = {**shapes, "num_hidden_layers": args.layers}
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        # The test tokenizer's 1000 tokens: only the model's tensors matter here.
        model = write_tiny_sglang_model(Path(tmp) / args.shape, arch, tokenizer_vocab=1000, **shapes)
        nbytes = (model / "model.safetensors").stat().st_size
        print(f"cpu: {cpu_name()}; kernel {weight_checker.kernel()}")
        layers = shapes["num_hidden_layers"]
        print(f"model: {args.shape} ({arch}), {layers} layers, {nbytes / 1e9:.2f} GB (safetensors)")
        with sglang_server(model, Path(tmp) / "server.log", python) as server:
            times: dict[str, list[float]] = {"sglang": [], "ours": []}
            ours: dict[str, str] = {}
            theirs: dict[str, str] = {}
            for _ in range(args.repeat):
                start = time.perf_counter()
                status, body = server.post("/weights_checker", {"action": "checksum", "selector": "target"})
                times["sglang"].append(time.perf_counter() - start)
                assert status == 200 and body["success"], body
                (rank,) = body["ranks"]
                theirs = rank["checksums"]
                start = time.perf_counter()
                status, body = server.post("/weight_checker", {"action": "checksum"})
                times["ours"].append(time.perf_counter() - start)
                assert status == 200, body
                ours = {k.split(":", 4)[4]: v for k, v in body["checksums"].items()}
            assert set(ours) == set(theirs), set(ours) ^ set(theirs)
            assert all(ours[k][:16] == theirs[k] for k in ours), "a digest that does not extend SGLang's value"
            log = server.log_text()
    ref, mine = statistics.median(times["sglang"]), statistics.median(times["ours"])
    rates = [line for line in log.splitlines() if "weight_checker:" in line and "GB/s" in line]
    print(f"tensors: {len(ours)}; requests alternate, {args.repeat} each, medians")
    print(f"SGLang's /weights_checker checksum: {ref:.3f} s (runs {', '.join(f'{t:.3f}' for t in times['sglang'])})")
    print(f"this package's /weight_checker:     {mine:.3f} s (runs {', '.join(f'{t:.3f}' for t in times['ours'])})")
    print(f"ratio: {mine / ref:.3f} of SGLang's (goal <= 0.35)")
    if rates:
        print("in the rank (its last INFO line):", rates[-1].split("weight_checker:", 1)[1].strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
