"""Digests made in idle time (weight_checker.hashing.idle), against hashlib:
the background run itself, its cancellation, and which digests a later
checksum may take (the very tensor, unchanged, its memory not written)."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import numpy as np
import pytest
import torch
from weight_checker import _core
from weight_checker.hashing import idle

pytestmark = pytest.mark.skipif(not idle.available(), reason="no SCHED_IDLE on this host")


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _hashed(hashing: idle.IdleHashing, tensors: list[torch.Tensor], timeout: float = 30.0) -> None:
    """Waits until the background has hashed every one of ``tensors``."""
    end = time.monotonic() + timeout
    while any(hashing.digest_of(t) is None for t in tensors):
        assert time.monotonic() < end, "the background never hashed them"
        time.sleep(0.01)


def _finished(hasher: _core.BackgroundHasher, n: int, timeout: float = 60.0) -> dict[int, str | None]:
    """The next ``n`` jobs the hasher gives back: ``{id: digest}``."""
    got: dict[int, str | None] = {}
    end = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < end, "the background never gave them back"
        got.update(hasher.take_digests())
        time.sleep(0.005)
    return got


def _runtimes() -> dict[int, int]:
    """Each thread of this process: the CPU time it ran (ns)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            out[int(tid)] = int(f.read().split()[0])
    return out


def test_the_background_equals_hashlib_on_its_thread_alone():
    rng = np.random.default_rng(0)
    buffers = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 63, 64, 4097, 3 << 20, 17 << 20)]
    tensor = torch.arange(1 << 20, dtype=torch.int32)
    hasher = _core.BackgroundHasher(8 << 20)
    hasher.submit(range(8), [*map(torch.from_numpy, buffers), tensor[256:]])
    got = _finished(hasher, 8)
    assert [got[i] for i in range(8)] == [hashlib.sha256(b).hexdigest() for b in buffers] + [_sha(tensor[256:])]
    strided = tensor.reshape(1024, 1024)[:, ::2]
    for refused in (strided, buffers[2]):  # a buffer export is released attached to Python: never on its thread
        with pytest.raises(ValueError, match="buffer 1 is not a contiguous tensor"):
            hasher.submit([8, 9], [tensor, refused])
    assert hasher.idle() and hasher.take_digests() == []  # nothing of a refused submit queued
    # Eight large buffers, which a default run spreads over the pool: none of
    # its threads (nor this one) runs a moment of the background's run.
    large = [np.full(32 << 20, i, dtype=np.uint8) for i in range(8)]
    _core.digest_many(large[:2])  # the pool started
    before = _runtimes()
    hasher.submit(range(10, 18), map(torch.from_numpy, large))
    got = _finished(hasher, 8)
    after = _runtimes()
    assert [got[10 + i] for i in range(8)] == [hashlib.sha256(b).hexdigest() for b in large]
    tid = hasher.thread_id
    assert tid is not None
    others = sum(after[t] - before.get(t, 0) for t in after if t not in (tid, threading.get_native_id()))
    assert after[tid] - before[tid] > 50e6 and others < 10e6, (after[tid] - before[tid], others)
    assert hasher.hashed_bytes == sum(b.nbytes for b in (*buffers, tensor[256:].numpy(), *large))


def test_a_closed_hasher_stops_its_run_gives_every_buffer_back_and_stops_no_other():
    import sys

    big = torch.ones(512 << 20, dtype=torch.uint8)
    refs = sys.getrefcount(big)
    mine, theirs = _core.BackgroundHasher(1 << 30), _core.BackgroundHasher(1 << 30)
    mine.submit([1, 2], [big, big])
    theirs.submit([1], [big])
    time.sleep(0.02)
    mine.close()
    mine.submit([3], [big])  # after the close: dropped
    assert mine.wait(30) and mine.idle()
    assert mine.take_digests() == [(1, None), (2, None)]  # stopped, and given back
    assert _finished(theirs, 1) == {1: _sha(big)}  # one owner's close stops no other's run
    assert sys.getrefcount(big) == refs  # no reference kept anywhere
    assert mine.hashed_bytes == 0


def test_the_background_thread_runs_at_the_idle_policy_and_never_takes_the_gil():
    import ctypes

    hasher = _core.BackgroundHasher(1 << 30)
    buffer = torch.full((64 << 20,), 3, dtype=torch.uint8)
    start = time.monotonic()
    hasher.submit([0], [buffer])
    _finished(hasher, 1)
    alone = time.monotonic() - start  # what the job takes on this host now
    tid = hasher.thread_id
    assert tid is not None and os.sched_getscheduler(tid) == os.SCHED_IDLE
    # This thread now sleeps holding the GIL (a C call through PyDLL, which
    # keeps it): a run that needed the GIL could not even start. Sleeping,
    # it leaves its core free; on a host whose cores others keep busy, an
    # idle-policy thread preempted while holding the GIL would stall the
    # whole process.
    libc = ctypes.PyDLL(None)
    hasher.submit([1], [buffer])
    libc.usleep(ctypes.c_uint(int(min(max(1.0, 10 * alone), 20.0) * 1e6)))
    assert hasher.take_digests() == [(1, _sha(buffer))], alone


def test_digests_taken_only_of_the_very_tensor_unchanged():
    torch.manual_seed(0)
    kept, bumped, written, replaced = (torch.randn(1 << 16) for _ in range(4))
    small = torch.randn(16)  # under MIN_BYTES: never queued
    strided = torch.randn(512, 512).t()  # not contiguous: never queued
    with idle.session() as hashing:
        assert hashing is not None and idle.current() is hashing
        idle.submit([kept, bumped, written, replaced, small, strided])
        _hashed(hashing, [kept, bumped, written, replaced])
        assert hashing.digest_of(small) is None and hashing.digest_of(strided) is None
        bumped.add_(1)  # in place through torch: its version changes
        written.numpy()[:] = 0  # a write torch does not see ...
        idle.invalidate(written.untyped_storage().data_ptr())  # ... told as the deferred copies tell it
        alias = kept.view(-1)  # another object over the same bytes: not the tensor hashed
        names = ["kept", "bumped", "written", "alias", "small", "strided", "replaced"]
        tensors = [kept, bumped, written, alias, small, strided, torch.zeros(1 << 16)]
        assert hashing.digest_of(kept) == _sha(kept)
        assert [hashing.digest_of(t) for t in (bumped, written, alias)] == [None, None, None]
        digests = idle.digests(names, tensors)  # the session's last question: it stops
    assert digests == [_sha(t) for t in tensors]
    assert idle.current() is None
    assert hashing.wait(30)  # closing does not wait for it; it ends on its own
    idle.submit([kept])  # outside a session: nothing
    assert idle.digests(["kept"], [kept]) == [_sha(kept)]


def test_a_tensor_rebound_or_of_no_version_gives_no_digest():
    """``.data =`` moves a parameter to other memory without a version
    change; an inference tensor keeps no version: neither digest is taken,
    and a rebinding while the background reads it frees nothing under it."""
    torch.manual_seed(1)
    moved = torch.nn.Parameter(torch.randn(1 << 16), requires_grad=False)
    big = torch.nn.Parameter(torch.ones(1 << 28, dtype=torch.uint8), requires_grad=False)
    with torch.inference_mode():
        frozen = torch.randn(1 << 16)
    with idle.session() as hashing:
        assert hashing is not None
        hashing.submit([moved, frozen, big])
        big.data = torch.zeros(16, dtype=torch.uint8)  # while it is hashed: its old storage stays alive
        _hashed(hashing, [moved])
        moved.data = torch.randn(1 << 16)
        assert hashing.digest_of(moved) is None and hashing.digest_of(frozen) is None
        end = time.monotonic() + 30
        while not hashing.idle() and time.monotonic() < end:
            time.sleep(0.01)
        assert hashing.digest_of(big) is None
        assert idle.digests(["moved", "frozen", "big"], [moved, frozen, big]) == [_sha(t) for t in (moved, frozen, big)]


def test_a_rebinding_never_lands_where_the_hashed_memory_lay():
    """``.data =`` keeps the version; the allocator, given the old memory
    back, would put the new bytes at the very address hashed. The session
    keeps that memory until it ends, so no rebinding can land there."""
    torch.manual_seed(2)
    for _ in range(4):
        with idle.session() as hashing:
            assert hashing is not None
            p = torch.nn.Parameter(torch.randn(1 << 16), requires_grad=False)
            first = p.data_ptr()
            hashing.submit([p])
            _hashed(hashing, [p])
            for k in range(8):
                p.data = torch.full_like(p, float(k))
                assert p.data_ptr() != first, "a rebinding landed on the memory hashed"
            assert hashing.digest_of(p) is None
            assert idle.digests(["p"], [p]) == [_sha(p)]


def test_a_copy_deferred_into_a_hashed_tensor_takes_its_digest_away(monkeypatch):
    """The deferred copies tell the session when they write a memory: a copy
    recorded into a tensor already hashed (its bytes change, its version
    does not), and its replay, leave it to the last step."""
    from weight_checker.expected.vllm import deferred_rows, warm_memory

    monkeypatch.setattr(warm_memory, "MIN_BYTES", 0)
    source = torch.randn(1 << 16)
    with idle.session() as hashing:
        assert hashing is not None
        with warm_memory.serving(mode=False), deferred_rows.DeferredCopies(serves=True) as copies:
            target = torch.empty(1 << 16, dtype=torch.float32, device="cpu")  # served by the pool
            target.fill_(2.0)
            hashing.submit([target])
            _hashed(hashing, [target])
            assert hashing.digest_of(target) == _sha(target.clone())  # (a numpy view of it would hand it out)
            copies.note_source("w", source)
            target.copy_(source)  # recorded, not written: the version stays
            assert deferred_rows.pending_pieces(target)
            assert hashing.digest_of(target) is None
        assert torch.equal(target, source)  # written as the mode ended
        assert idle.digests(["target"], [target]) == [_sha(source)]


def test_a_session_left_by_an_exception_stops_its_thread():
    with pytest.raises(ValueError), idle.session() as hashing:
        assert hashing is not None
        hashing.submit([torch.randn(1 << 20) for _ in range(8)])
        raise ValueError("the call failed")
    assert hashing.wait(30)
    assert idle.current() is None


def test_no_background_where_the_host_has_no_idle_policy(monkeypatch):
    monkeypatch.setattr(idle, "available", lambda: False)
    with idle.session() as hashing:
        assert hashing is None and idle.current() is None
        t = torch.randn(1 << 16)
        idle.submit([t])
        assert idle.digests(["t"], [t]) == [_sha(t)]


def test_fp8_expected_digests_hash_in_the_background_and_equal_those_hashed_at_the_end(models, monkeypatch):
    """A TP=2 online FP8 call: part of its tensors hashed in idle time, the
    digests equal to a call that hashes everything at the end; a TP=1 call
    opens no session (measured: too little idle to gain)."""
    import weight_checker

    path = models.path("tiny-llama")
    sessions: list[idle.IdleHashing] = []
    original = idle.IdleHashing.close

    def close(self: idle.IdleHashing) -> None:
        # A call this small ends before its background runs: here it asks for
        # its digests once everything submitted is hashed.
        end = time.monotonic() + 30
        while not self.idle() and time.monotonic() < end:
            time.sleep(0.005)
        sessions.append(self)
        original(self)

    taken: list[str] = []
    digest_of = idle.IdleHashing.digest_of

    def counted(self: idle.IdleHashing, tensor: torch.Tensor) -> str | None:
        digest = digest_of(self, tensor)
        if digest is not None:
            taken.append(digest)
        return digest

    monkeypatch.setattr(idle.IdleHashing, "close", close)
    monkeypatch.setattr(idle.IdleHashing, "digest_of", counted)
    monkeypatch.setattr(idle, "MIN_BYTES", 0)
    sessions.clear()
    assert weight_checker.expected_digests(path, tp=1, quantization="fp8_per_channel") and not sessions
    with_idle = dict(weight_checker.expected_digests(path, tp=2, quantization="fp8_per_channel"))
    assert sessions and sum(s.hashed_bytes for s in sessions) > 0, "nothing was hashed in the background"
    # Every FP8 weight and scale of both ranks was hashed in the background
    # and taken (a 2-layer model: 4 linear layers a rank, each a weight and a scale).
    assert len(taken) >= 16, len(taken)
    assert set(taken) <= set(with_idle.values())
    with monkeypatch.context() as m:
        m.setattr(idle, "available", lambda: False)
        at_the_end = dict(weight_checker.expected_digests(path, tp=2, quantization="fp8_per_channel"))
    assert with_idle == at_the_end
