"""`weight-checker checksum` on a ~2 GB multi-shard checkpoint in page cache,
against a Python baseline (`safetensors.safe_open` + `hashlib`, per tensor),
side by side in one run.

    .venv/bin/python benches/bench_checkpoint.py [--gb 2] [--repeat 3]

The checkpoint (4 shards of bf16 tensors, Llama-like sizes, fixed seed) is
written once under .bench/ and read once before timing so that both sides
read from the page cache. Each side runs in its own process; the figures are
wall time (median), GB/s, the ratio, and peak RSS growth while hashing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ceiling import machine

ROOT = Path(__file__).resolve().parent.parent

BASELINE = r"""
import hashlib, json, sys, time
import torch
from safetensors import safe_open
files = sys.argv[1:]
# VmHWM (not ru_maxrss, which a child inherits from its parent across exec).
peak = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
before = peak()
t = time.perf_counter()
out = {}
for f in files:
    with safe_open(f, framework="pt") as st:
        for name in st.keys():
            x = st.get_tensor(name)
            out[name] = hashlib.sha256(x.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
print(json.dumps({"seconds": time.perf_counter() - t, "rss_growth": peak() - before, "n": len(out)}))
"""

OURS = r"""
import json, sys, time
from weight_checker.checkpoint import checksum_checkpoint
# VmHWM (not ru_maxrss, which a child inherits from its parent across exec).
peak = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
before = peak()
t = time.perf_counter()
out = checksum_checkpoint(sys.argv[1:])
print(json.dumps({"seconds": time.perf_counter() - t, "rss_growth": peak() - before, "n": len(out)}))
"""


def make_checkpoint(root: Path, gb: float) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    stamp = root / f"done-{gb}"
    files = [root / f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    if stamp.exists():
        return files
    torch.manual_seed(0)
    per_shard = int(gb * 1e9 / 4)
    hidden = 2048
    for i, f in enumerate(files):
        tensors, size, j = {}, 0, 0
        while size < per_shard:
            rows = [5632, 2048, 512, 1][j % 4]
            t = torch.empty(rows, hidden, dtype=torch.bfloat16)
            t.view(torch.int16).random_(-32768, 32767)
            tensors[f"model.layers.{i}.{j}.weight"] = t
            size += t.numel() * 2
            j += 1
        save_file(tensors, f)
    stamp.touch()
    return files


def run(script: str, files: list[Path]) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *map(str, files)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cli_seconds(files: list[Path]) -> float:
    cli = Path(sys.executable).with_name("weight-checker")
    t = time.perf_counter()
    subprocess.run([str(cli), "checksum", "--no-progress", "-o", "/dev/null", *map(str, files)], check=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    files = make_checkpoint(ROOT / ".bench" / "checkpoint", args.gb)
    nbytes = sum(f.stat().st_size for f in files)
    for f in files:  # into the page cache, a chunk at a time
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    base, ours, cli = [], [], []
    for _ in range(args.repeat):
        base.append(run(BASELINE, files))
        ours.append(run(OURS, files))
        cli.append(cli_seconds(files))
    b = statistics.median(r["seconds"] for r in base)
    o = statistics.median(r["seconds"] for r in ours)
    c = statistics.median(cli)
    print(machine())
    print(f"checkpoint: {len(files)} shards, {nbytes / 1e9:.2f} GB, {base[0]['n']} tensors (median of {args.repeat})")
    print(f"  {'':36} {'seconds':>8} {'GB/s':>6} {'peak RSS growth':>16}")
    growth = lambda rs: max(r["rss_growth"] for r in rs) / 2**20  # noqa: E731
    print(f"  {'safe_open + hashlib (per tensor)':36} {b:8.3f} {nbytes / b / 1e9:6.2f} {growth(base):12.0f} MiB")
    print(f"  {'weight_checker.checkpoint (in process)':36} {o:8.3f} {nbytes / o / 1e9:6.2f} {growth(ours):12.0f} MiB")
    print(f"  {'weight-checker checksum (whole CLI)':36} {c:8.3f} {nbytes / c / 1e9:6.2f}")
    print(f"  speed-up vs baseline: {b / o:.2f}x in process, {b / c:.2f}x for the whole CLI")


if __name__ == "__main__":
    main()
