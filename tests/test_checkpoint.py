"""Checkpoints through the streaming feeder: every tensor one stream, read
through the mapping in windows, pages dropped behind, cancellable."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file
from weight_checker import _core
from weight_checker.checkpoint import checksum_checkpoint

MiB = 1 << 20
# Around the core's 4 MiB window and its read-ahead threshold (1 MiB).
sizes = st.one_of(
    st.integers(0, 300),
    st.sampled_from([MiB - 1, MiB, 4 * MiB - 3, 4 * MiB, 4 * MiB + 5, 9 * MiB + 7]),
    st.integers(1, 6 * MiB),
)


@settings(max_examples=25)
@given(st.lists(st.lists(sizes, min_size=1, max_size=4), min_size=1, max_size=3), st.integers(0, 2**32 - 1))
def test_digests_equal_hashlib_for_any_mix(tmp_path_factory, shards, seed):
    root = tmp_path_factory.mktemp("ckpt")
    rng = np.random.default_rng(seed)
    want = {}
    for s, shard in enumerate(shards):
        tensors = {}
        for t, n in enumerate(shard):
            a = rng.integers(0, 256, n, dtype=np.uint8)
            tensors[f"s{s}.t{t}"] = a
            want[f"s{s}.t{t}"] = hashlib.sha256(a.tobytes()).hexdigest()
        save_file(tensors, str(root / f"shard{s}.safetensors"))
    assert checksum_checkpoint([root]) == want


def random_checkpoint(root, per_file: int, nbytes: int, seed: int):
    """Two files of ``per_file`` random uint8 tensors of ``nbytes`` each."""
    rng = np.random.default_rng(seed)
    for f in range(2):
        tensors = {f"f{f}.w{i}": rng.integers(0, 256, nbytes, dtype=np.uint8) for i in range(per_file)}
        save_file(tensors, str(root / f"part{f}.safetensors"))
    return root


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """1 GiB in two files of 4 tensors each: larger than the RSS bound."""
    return random_checkpoint(tmp_path_factory.mktemp("big"), 4, 128 * MiB, seed=0)


RSS_SCRIPT = r"""
import json, sys
from weight_checker import _core
from weight_checker.checkpoint import checksum_checkpoint
# VmHWM (not ru_maxrss, which a child inherits from its parent across exec).
peak = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
before = peak()
out = checksum_checkpoint([sys.argv[1]])
print(json.dumps({"growth": peak() - before, "n": len(out)}))
"""


def test_resident_memory_stays_bounded(big_checkpoint):
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(big_checkpoint)], capture_output=True, text=True, check=True
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["n"] == 8
    # K streams x 4 MiB windows, plus slack; the file is 1 GiB.
    assert r["growth"] < 100 * MiB, r


@pytest.fixture(scope="module")
def many_tensor_checkpoint(tmp_path_factory):
    """1 GiB as 64 tensors of 16 MiB: enough messages for 16 lanes a thread."""
    return random_checkpoint(tmp_path_factory.mktemp("many"), 32, 16 * MiB, seed=1)


@pytest.mark.parametrize("lanes", ["4", "16"])
def test_resident_memory_stays_bounded_with_many_lanes(many_tensor_checkpoint, lanes):
    """With 16 lanes a thread (the wide kernel) as with 4, what the mapping
    keeps resident depends on the messages in flight, not on the file: each
    lane's window (a share of 32 MiB, 1-4 MiB) plus up to a large folio
    mapped beyond it."""
    env = dict(os.environ, WEIGHT_CHECKER_LANES=lanes)
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT + "print(_core.streams())", str(many_tensor_checkpoint)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    *_, result, streams = out.stdout.strip().splitlines()
    r, streams = json.loads(result), int(streams)
    assert r["n"] == 64
    window = min(4 * MiB, max(1 * MiB, 32 * MiB // streams))
    assert r["growth"] < streams * (window + 4 * MiB) + 32 * MiB, (r, streams)


@pytest.fixture
def one_thread():
    # One thread: the run then takes long enough (>100 ms) on any machine
    # for a progress call to land in the middle of it.
    _core.set_threads(1)
    yield
    _core.set_threads(0)


def test_progress_reports_and_an_exception_cancels(big_checkpoint, one_thread):
    seen: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        seen.append((done, total))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checksum_checkpoint([big_checkpoint], progress=progress)
    assert len(seen) == 1 and seen[0][0] < seen[0][1] == 8 * 128 * MiB
    # The run is not poisoned: the next one completes.
    calls: list[tuple[int, int]] = []
    digests = checksum_checkpoint([big_checkpoint], progress=lambda d, t: calls.append((d, t)))
    assert len(digests) == 8 and calls[-1] == (8 * 128 * MiB, 8 * 128 * MiB)
