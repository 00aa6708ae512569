"""`checksum_checkpoint` of two builds side by side: the package in this
environment against another build of it (an older commit's ``python/``
folder with its ``_core`` built), alternating in fresh processes, so that a
shared machine's noise falls on both.

    git worktree add /tmp/wc-old OLD_COMMIT
    (cd /tmp/wc-old && CARGO_TARGET_DIR=/tmp/wc-old-target cargo build --release --features python --lib \\
        && cp /tmp/wc-old-target/release/libweight_checker.so python/weight_checker/_core.abi3.so)
    .venv/bin/python benches/ab_checkpoint.py --old /tmp/wc-old/python [--io auto|map|read] [--pairs 8] [--cold]

Warm: the checkpoint of ``bench_checkpoint.py`` (2.01 GB, page cache), one
warm-up call then one timed call a process. ``--cold``: the 70B-shaped
checkpoint of ``bench_checkpoint.py --cold``, the page cache dropped before
each run (root: ``/proc/sys/vm/drop_caches``). Prints every run and the
medians, new/old.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the other build's python/ folder (its weight_checker package)")
    ap.add_argument("--io", default="auto", choices=["auto", "map", "read"])
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()
    folder = ROOT / ".bench" / ("checkpoint-70b" if args.cold else "checkpoint")
    files = sorted(str(f) for f in folder.glob("*.safetensors"))
    if not files:
        sys.exit(f"no checkpoint under {folder}: run benches/bench_checkpoint.py{' --cold' if args.cold else ''} first")
    timed = f"t = time.perf_counter(); c(f, io={args.io!r}); print(time.perf_counter() - t)"
    code = "import sys, time; from weight_checker.checkpoint import checksum_checkpoint as c; f = sys.argv[1:]; "
    code += timed if args.cold else f"c(f, io={args.io!r}); {timed}"
    runs: dict[str, list[float]] = {"old": [], "new": []}
    for i in range(args.pairs):
        for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
            env = dict(os.environ)
            if side == "old":
                env["PYTHONPATH"] = args.old
            else:
                env.pop("PYTHONPATH", None)
            if args.cold:
                subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)
            out = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"{side}: {out.stderr.strip()[-500:]}")
            runs[side].append(float(out.stdout.strip().splitlines()[-1]))
    old, new = statistics.median(runs["old"]), statistics.median(runs["new"])
    print(json.dumps(runs))
    print(
        f"io={args.io}{' cold' if args.cold else ''}: old median {old:.3f} s, new {new:.3f} s, new/old {new / old:.3f}"
    )


if __name__ == "__main__":
    main()
