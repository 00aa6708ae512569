"""Peak RSS growth while weight_checker hashes a 2 GiB tensor (no copy).

    .venv/bin/python benches/zero_copy_rss.py [--gb 2]

Runs each layout in a fresh interpreter (tests/test_memory.py's script) and
prints the peak-RSS growth during `weight_checker.checksum`, next to the
tensor's size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_memory import peak_growth


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    args = ap.parse_args()
    for layout in ("contiguous", "transposed"):
        r = peak_growth(args.gb, layout)
        print(
            f"{layout:>11}: tensor {r['tensor'] / 2**30:.2f} GiB, "
            f"peak RSS growth while hashing {r['growth'] / 2**20:.1f} MiB"
        )


if __name__ == "__main__":
    main()
