"""The compiled core: backends, the GIL, the incremental multi-hasher."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import weight_checker
from hypothesis import given
from hypothesis import strategies as st
from weight_checker import _core


def test_kernel_env_var_forces_the_fallback():
    code = "import weight_checker as w; print(w.kernel(), w._core.small_lanes())"
    env = dict(os.environ, WEIGHT_CHECKER_KERNEL="portable")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["portable", "1"]


def test_gil_is_released_while_hashing():
    big = np.random.default_rng(0).integers(0, 256, 768 << 20, dtype=np.uint8)
    span: dict[str, float] = {}

    def hash_it():
        span["start"] = time.perf_counter()
        weight_checker.sha256_many([big])
        span["end"] = time.perf_counter()

    worker = threading.Thread(target=hash_it)
    ticks: list[float] = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    start, end = span["start"], span["end"]
    margin = (end - start) * 0.2
    inside = [t for t in ticks if start + margin < t < end - margin]
    # With the GIL held for the whole call, this thread could not run at all
    # in the middle of it.
    assert len(inside) > 100, (len(inside), end - start)


@given(
    st.lists(st.binary(max_size=3000), min_size=1, max_size=8),
    st.lists(st.integers(0, 3000), max_size=10),
    st.integers(1, 4),
)
def test_multihasher_random_chunkings(messages, cuts, rounds):
    m = _core.MultiHasher(len(messages))
    pieces = []
    for i, msg in enumerate(messages):
        points = sorted({0, len(msg), *(c % (len(msg) + 1) for c in cuts)})
        pieces.append([(i, msg[a:b]) for a, b in itertools.pairwise(points)])
    for r in range(rounds):
        feeds = []
        for p in pieces:
            take = len(p) if r == rounds - 1 else -(-len(p) // rounds)
            feeds += p[:take]
            del p[:take]
        m.update(feeds)
    assert [m.bytes_fed(i) for i in range(len(messages))] == [len(x) for x in messages]
    digests, zero = m.finish()
    assert digests == [hashlib.sha256(x).hexdigest() for x in messages]
    assert zero == [not any(x) for x in messages]


def test_multihasher_errors():
    m = _core.MultiHasher(2)
    with pytest.raises(IndexError, match="index 5"):
        m.update([(5, b"x")])
    with pytest.raises(TypeError, match="tuples"):
        m.update([b"x"])
    m.finish()
    with pytest.raises(RuntimeError, match="finished"):
        m.update([(0, b"x")])


def test_hash_floor_times_each_pass_and_refuses_bad_sizes():
    times = _core.hash_floor(300, 4096, repeat=2)
    # Each pass hashed 1.2 MB: no core does that in under 12 us (100 GB/s);
    # a pass that skipped the hashing would report less.
    assert len(times) == 2 and all(t > 300 * 4096 / 100e9 for t in times)
    for bad in [(0, 4096), (10, 4096, 0), (1 << 20, 1 << 13)]:
        with pytest.raises(ValueError, match="hash_floor"):
            _core.hash_floor(*bad)


def test_lanes_are_calibrated_and_the_env_var_overrides():
    assert _core.lanes() in (1, 2, 4, 16)
    figures = dict(_core.calibrate())
    assert set(figures) == {1, 2, 4} and all(v > 0 for v in figures.values())
    code = "from weight_checker import _core; print(_core.lanes(), _core.streams(), _core.threads())"
    for want in ("1", "2", "4", "16"):
        env = dict(os.environ, WEIGHT_CHECKER_LANES=want)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        lanes, streams, threads = map(int, out.stdout.split())
        if _core.kernel() == "portable":
            expect = 1
        elif want == "16":
            expect = 16 if has_avx512() else 4
        else:
            expect = int(want)
        assert lanes == expect and streams == lanes * threads


def test_streams_leave_room_for_the_wide_kernel_where_it_is_faster():
    """Feeders (the staging pipeline) open ``streams()`` messages at once: 16
    per thread where this CPU's streaming rates favour the AVX-512 kernel and
    the lanes chosen are at least two (so that a run of many tensors can use
    it); the kernel's lanes per thread elsewhere."""
    wide, four = _core.calibrate_wide()
    per_thread = 16 if wide > four and _core.lanes() >= 2 else _core.lanes()
    assert _core.streams() == _core.threads() * per_thread
    assert (wide > 0) == (has_avx512() and _core.kernel() != "portable" and "WEIGHT_CHECKER_LANES" not in os.environ)


def has_avx512() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    return "avx512f" in flags and "avx512bw" in flags


def test_small_tensors_of_one_length_through_either_kernel_match_hashlib():
    """Many equal-length messages go sixteen at a time through the AVX-512
    kernel where it was chosen (or forced), through the SHA-NI lanes else."""
    msgs = [bytes((i * 31 + j) & 0xFF for j in range(4096)) for i in range(70)]
    msgs += [bytes([i]) * 100 for i in range(37)] + [b"\0" * 4096] * 17
    want = [hashlib.sha256(m).hexdigest() for m in msgs]
    code = (
        "import sys, json; from weight_checker import _core; msgs = json.load(sys.stdin);"
        "print(json.dumps([_core.small_lanes(), _core.lanes(), _core.sha256_many([bytes.fromhex(m) for m in msgs])]))"
    )
    payload = json.dumps([m.hex() for m in msgs])
    wide = has_avx512() and _core.kernel() != "portable"
    for lanes_env, small in (("16", 16 if wide else None), ("4", 4 if _core.kernel() != "portable" else 1)):
        env = dict(os.environ, WEIGHT_CHECKER_LANES=lanes_env)
        out = subprocess.run([sys.executable, "-c", code], env=env, input=payload, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        small_lanes, lanes, digests = json.loads(out.stdout)
        assert digests == want
        if small is not None:
            assert small_lanes == small
        assert lanes == (16 if wide and lanes_env == "16" else 4 if _core.kernel() != "portable" else 1)
    assert _core.sha256_many(msgs) == want
    assert _core.small_lanes() in (1, 2, 4, 16)
    wide_rate, narrow_rate = _core.calibrate_small()
    assert (wide_rate > 0 and narrow_rate > 0) == wide


def test_a_llama_shaped_set_matches_hashlib_whatever_the_assignment():
    """Two embeddings among 48 layer tensors (Llama-shaped, a quarter of the
    benchmark's sizes): where the run model says so, one core hashes the
    embeddings on SHA-NI while the other runs the layers on the wide kernel
    (`_core.describe_assignment` says which assignment this CPU got)."""
    h, inter, vocab, kv = 2048 // 2, 5632 // 2, 32000, 512 // 2
    sizes = [vocab * h * 2] * 2
    for _ in range(8):
        sizes += [(h + 2 * kv) * h * 2, h * h * 2, 2 * inter * h * 2, h * inter * 2, h * 2, h * 2]
    rng = np.random.default_rng(5)
    msgs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    msgs[7][: len(msgs[7]) // 2] = 0  # a long zero run, then data
    assignment = _core.describe_assignment(sizes)
    assert weight_checker.sha256_many(msgs) == [hashlib.sha256(m).hexdigest() for m in msgs], assignment
