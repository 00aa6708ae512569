"""No copy on the way to the hasher: peak RSS while hashing large tensors.

Each case runs in a fresh interpreter so that its peak RSS (ru_maxrss) is its
own. The tensor is allocated and touched first; hashing it must then raise the
peak by far less than the tensor's size. `benches/zero_copy_rss.py` prints the
same figures for a 2 GB tensor.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
import torch
import weight_checker

gb, layout = float(sys.argv[1]), sys.argv[2]
n = int(gb * (1 << 30))
t = torch.empty(n, dtype=torch.uint8)
t.fill_(7)
if layout == "transposed":
    t = t.view(1 << 14, -1).t()
# VmHWM (not ru_maxrss, which a child inherits from its parent across exec).
peak = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
before = peak()
weight_checker.checksum({"w": t})
print(json.dumps({"tensor": n, "growth": peak() - before}))
"""


def peak_growth(gb: float, layout: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(gb), layout], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_hashing_does_not_copy_the_tensor(layout):
    r = peak_growth(1.0, layout)
    # A copy would add 1 GiB; gathering a strided view uses 1 MiB pieces.
    assert r["growth"] < 64 << 20, r
