"""`weight-checker checksum` on a ~2 GB multi-shard checkpoint in page cache,
against a Python baseline (`safetensors.safe_open` + `hashlib`, per tensor),
side by side in one run; with --cold, a 70B-shaped checkpoint read from disk
against a plain sequential read of the same files.

    .venv/bin/python benches/bench_checkpoint.py [--gb 2] [--repeat 3]
    .venv/bin/python benches/bench_checkpoint.py --cold [--repeat 5]

The checkpoint (4 shards of bf16 tensors, Llama-like sizes, fixed seed) is
written once under .bench/ and read once before timing so that both sides
read from the page cache. Each side runs in its own process; the figures are
wall time (median), GB/s, the ratio, and peak RSS growth while hashing.

--cold writes a checkpoint of 70B-sized tensors (8192 x 28672 bf16, 470 MB
each; --gb, default 1.9) in two shards under .bench/checkpoint-70b/. Each
repeat drops the page cache before each side (`/proc/sys/vm/drop_caches`
where this process may write it, else `posix_fadvise(DONTNEED)` on the files,
which drops only their clean pages; the line says which, and the fraction of
the data still cached) and times, in alternating order: a plain sequential
read of the files (8 MiB `readinto` into one buffer, nothing else done),
`checksum_checkpoint` (the default, io="auto") and the mapping path forced
(io="map", what a cold checkpoint used to take). Then, warm: the files in the
page cache, `checksum_checkpoint` against `sha256_many` of the same tensors
already in memory (the hashing alone), in two states of the cache: after a
sequential read of the files (large folios: what a copy, a download or a
trainer's write leaves) and after the mapping's own cold read (4 KiB folios,
which cost more page faults to map). Ratios are of speeds: ours / the plain
read, ours warm / in-memory hashing.
"""

from __future__ import annotations

import argparse
import json
import os
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


PLAIN_READ = r"""
import json, sys, time
buf = bytearray(8 << 20)
t = time.perf_counter()
n = 0
for f in sys.argv[1:]:
    with open(f, "rb", buffering=0) as fh:
        while (k := fh.readinto(buf)):
            n += k
print(json.dumps({"seconds": time.perf_counter() - t, "bytes": n}))
"""

OURS_IO = r"""
import json, sys, time
from weight_checker import _core
from weight_checker.checkpoint import checksum_checkpoint
io, files = sys.argv[1], sys.argv[2:]
cached = sum(_core.safetensors_cached_fraction(f) for f in files) / len(files)
_core.lanes()  # the calibration (once a process): not timed
t = time.perf_counter()
out = checksum_checkpoint(files, io=io)
print(json.dumps({"seconds": time.perf_counter() - t, "n": len(out), "cached": cached, "digests": out}))
"""

IN_MEMORY = r"""
import json, sys, time
import weight_checker
files = sys.argv[1:]
views = []
for f in files:
    data = open(f, "rb").read()
    mv = memoryview(data)
    header = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + header])
    base = 8 + header
    for name, info in meta.items():
        if name != "__metadata__":
            b, e = info["data_offsets"]
            views.append(mv[base + b : base + e])
weight_checker._core.lanes()  # the calibration, as in OURS_IO: not timed
t = time.perf_counter()
weight_checker.sha256_many(views)
print(json.dumps({"seconds": time.perf_counter() - t, "n": len(views)}))
"""


def make_70b_checkpoint(root: Path, gb: float) -> list[Path]:
    """Tensors of a 70B model's largest shape (8192 x 28672 bf16), in two
    shards, random bytes (fixed seed)."""
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    stamp = root / f"done-{gb}"
    files = [root / f"model-{i:05d}-of-00002.safetensors" for i in range(1, 3)]
    if stamp.exists():
        return files
    for old in root.glob("*.safetensors"):
        old.unlink()
    torch.manual_seed(0)
    count = max(2, round(gb * 1e9 / (8192 * 28672 * 2)))
    for i, f in enumerate(files):
        tensors = {}
        for j in range(i, count, 2):
            t = torch.empty(8192, 28672, dtype=torch.bfloat16)
            t.view(torch.int16).random_(-32768, 32767)
            tensors[f"model.layers.{j}.mlp.down_proj.weight"] = t
        save_file(tensors, f)
        del tensors
    stamp.touch()
    return files


def drop_caches(files: list[Path]) -> str:
    """Drops the files' pages from the page cache; says how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "caches dropped (/proc/sys/vm/drop_caches)"
    except OSError as e:
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return f"cannot write /proc/sys/vm/drop_caches ({e.strerror}): posix_fadvise(DONTNEED) on the files instead"


def cold(args: argparse.Namespace) -> None:
    files = make_70b_checkpoint(ROOT / ".bench" / "checkpoint-70b", args.gb)
    nbytes = sum(f.stat().st_size for f in files)
    names = ("plain read", "ours (io=auto)", "ours (io=map, the mapping)")
    times: dict[str, list[float]] = {n: [] for n in names}
    cached: dict[str, list[float]] = {n: [] for n in names[1:]}
    how, digests = "", None
    for r in range(args.repeat):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            how = drop_caches(files)
            if name == "plain read":
                out = run(PLAIN_READ, files)
                assert out["bytes"] == nbytes
            else:
                out = run(OURS_IO, ["auto" if "auto" in name else "map", *files])
                cached[name].append(out["cached"])
                if digests is None:
                    digests = out["digests"]
                elif out["digests"] != digests:
                    sys.exit(f"{name}: digests differ from the first run's")
            times[name].append(out["seconds"])
    # Warm, in two page-cache states: how fast the mapping is depends on the
    # size of the folios the cache holds, which is set by how the pages came
    # in. A sequential read (a copy, a download, the read path) or a write
    # (the trainer saving) leaves large folios that map 2 MiB at a fault; the
    # mapping's own cold read (MADV_WILLNEED readahead) leaves 4 KiB folios
    # that map 64 KiB at a fault.
    warm: dict[str, tuple[float, float]] = {}
    for state, fill in (("after a sequential read", PLAIN_READ), ("after the mapping's own cold read", OURS_IO)):
        drop_caches(files)
        run(fill, files if fill is PLAIN_READ else ["map", *files])
        warm_ours, warm_mem = [], []
        for r in range(args.repeat):
            if r % 2:
                warm_mem.append(run(IN_MEMORY, files)["seconds"])
            warm_ours.append(run(OURS_IO, ["auto", *files])["seconds"])
            if not r % 2:
                warm_mem.append(run(IN_MEMORY, files)["seconds"])
        warm[state] = statistics.median(warm_ours), statistics.median(warm_mem)
    print(machine())
    count = len(digests or {})
    print(f"cold checkpoint: {len(files)} shards, {nbytes / 1e9:.2f} GB, {count} tensors of 8192 x 28672 bf16")
    print(f"  {how}; median of {args.repeat}, each side after its own drop, in alternating order")
    plain = statistics.median(times["plain read"])
    print(f"  {'':28} {'seconds':>8} {'GB/s':>6} {'of plain read':>14} {'cached at start':>16}")
    for name in names:
        t = statistics.median(times[name])
        c = f"{min(cached[name]):.0%}-{max(cached[name]):.0%}" if name in cached else ""
        print(f"  {name:28} {t:8.3f} {nbytes / t / 1e9:6.2f} {plain / t:14.2f} {c:>16}")
    print("  runs (s): " + "; ".join(f"{n}: " + " ".join(f"{x:.2f}" for x in times[n]) for n in names))
    print(f"warm (page cache), median of {args.repeat}, ours (io=auto: the mapping) against sha256_many in memory:")
    for state, (o, m) in warm.items():
        speeds = f"ours {o:6.3f} s {nbytes / o / 1e9:5.2f} GB/s, in memory {m:6.3f} s {nbytes / m / 1e9:5.2f} GB/s"
        print(f"  {state:34} {speeds}: {m / o:.2f} of in-memory hashing")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=None, help="checkpoint size (default 2, or 1.9 with --cold)")
    ap.add_argument("--repeat", type=int, default=None, help="runs a side (default 3, or 5 with --cold)")
    ap.add_argument("--cold", action="store_true", help="from disk, against a plain read (see above)")
    args = ap.parse_args()
    if args.cold:
        args.gb = args.gb or 1.9
        args.repeat = args.repeat or 5
        cold(args)
        return
    args.gb = args.gb or 2.0
    args.repeat = args.repeat or 3
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
