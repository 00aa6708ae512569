"""Checksum latency over HTTP on a real vLLM (CPU), plugin off vs on,
side by side in one run.

    .venv/bin/python benches/bench_vllm_http.py [--vocab 131072] [--repeat 7]

The model is a generated Llama with a wide vocabulary, so that most of its
bytes sit in the embedding and lm_head, which the CPU backend keeps visible
(it repacks linear layers into empty parameters). Two measurements:

1. same server, same worker, requests alternating: `POST /weight_checker`
   (served by our plugin) against `POST /collective_rpc
   weight_checker_vllm_reference` (vLLM's own `compute_tensor_digests`,
   run in the same worker); the digests are checked equal;
2. two servers one after the other: `WEIGHT_CHECKER_VLLM_PLUGIN=0` (stock
   vLLM) and the plugin on, `POST /weight_checker` each.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from ceiling import machine
from weight_checker.testing.launch import vllm_server
from weight_checker.testing.models import write_tiny_llama

ROOT = Path(__file__).resolve().parent.parent


def wide_llama(path: Path, vocab: int) -> Path:
    return write_tiny_llama(
        path,
        vocab_size=vocab,
        hidden_size=1024,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def checksum(server) -> dict:
    status, body = server.post("/weight_checker", {"action": "checksum"})
    assert status == 200, body
    return body["checksums"]


def reference(server) -> dict:
    status, body = server.post("/collective_rpc", {"method": "weight_checker_vllm_reference"})
    assert status == 200, body
    return body["results"][0]


def report(label: str, base: list[float], ours: list[float], nbytes: int) -> None:
    b, o = statistics.median(base), statistics.median(ours)
    print(f"\n{label} (median of {len(base)}, {nbytes / 1e9:.3f} GB hashed per request)")
    print(f"  {machine()}")
    print(f"  {'vLLM built-in':32} {b * 1e3:9.1f} ms  {nbytes / b / 1e9:6.2f} GB/s")
    print(f"  {'weight_checker plugin':32} {o * 1e3:9.1f} ms  {nbytes / o / 1e9:6.2f} GB/s")
    print(f"  ratio plugin / built-in: {o / b:.3f}  (speed-up {b / o:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    bench = ROOT / ".bench"
    bench.mkdir(exist_ok=True)
    model = wide_llama(bench / f"wide-llama-{args.vocab}", args.vocab)

    with vllm_server(model, bench / "vllm-on.log") as server:
        ours_digests = checksum(server)
        assert reference(server) == ours_digests, "plugin digests differ from vLLM's"
        log = (bench / "vllm-on.log").read_text(errors="replace")
        nbytes = int(log.rsplit("tensors, ", 1)[1].split(" bytes", 1)[0])
        base, ours = [], []
        for _ in range(args.repeat):
            base.append(timed(lambda s=server: reference(s))[0])
            ours.append(timed(lambda s=server: checksum(s))[0])
        report("1. same worker, alternating requests", base, ours, nbytes)

    runs = {}
    for label, env in (("off", {"WEIGHT_CHECKER_VLLM_PLUGIN": "0"}), ("on", {})):
        with vllm_server(model, bench / f"vllm-{label}.log", env=env) as server:
            digests = checksum(server)
            runs[label] = [timed(lambda s=server: checksum(s))[0] for _ in range(args.repeat)]
            runs[label + "-digests"] = digests
    assert runs["off-digests"] == runs["on-digests"] == ours_digests
    report("2. stock vLLM vs plugin, two servers", runs["off"], runs["on"], nbytes)


if __name__ == "__main__":
    main()
