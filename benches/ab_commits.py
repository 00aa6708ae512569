"""One benchmark, an older commit's Python package against this tree's, side
by side in one run: the rounds alternate (old, new, old, new, ...) so that
the machine's noise falls on both alike.

    .venv/bin/python benches/ab_commits.py --old REV [--rounds 2] -- benches/bench_explain.py --repeat 5

The older commit is checked out in a temporary worktree; its own copy of the
benchmark runs with its own ``python/`` first on ``sys.path``. Both run over
this tree's compiled core (``weight_checker._core``, copied in), so what is
compared is the Python code: a refactor of the package, for one. Where the
core's interface changed too, ``--old-core PATH`` gives the older side the
core built from its commit (a copy of its ``_core`` library). Each run's
output is printed whole, under a line naming the tree and the round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compiled_core() -> Path:
    import weight_checker._core as core

    return Path(core.__file__)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the older commit (any git revision)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--old-core", type=Path, help="the older side's compiled core (default: this tree's)")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...], relative to the repository")
    args = ap.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        ap.error("name the benchmark after --")
    core = compiled_core()
    with tempfile.TemporaryDirectory(prefix="ab-commits-") as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), args.old], check=True)
        try:
            shutil.copy2(args.old_core or core, old / "python" / "weight_checker" / core.name)
            rev = subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", args.old], capture_output=True, text=True, check=True
            ).stdout.strip()
            trees = [(f"old {rev}", old), ("new (this tree)", ROOT)]
            for label, tree in trees:  # which package each run imports: the tree's own, or this is no A/B
                env = {**os.environ, "PYTHONPATH": str(tree / "python")}
                where = subprocess.run(
                    [sys.executable, "-c", "import weight_checker; print(weight_checker.__file__)"],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.strip()
                if not where.startswith(str(tree / "python")):
                    raise SystemExit(f"ab_commits: the {label} run imports {where}, not its tree's package")
                print(f"{label}: {where}", flush=True)
            for r in range(1, args.rounds + 1):
                for label, tree in trees:
                    env = {**os.environ, "PYTHONPATH": str(tree / "python")}
                    print(f"=== {label}, round {r}/{args.rounds}: {' '.join(bench)}", flush=True)
                    subprocess.run([sys.executable, str(tree / bench[0]), *bench[1:]], env=env, cwd=tree, check=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
