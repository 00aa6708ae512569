"""The staging scheduler (slots, packing, chunking, overlap) on the CPU.

The copy engine is injected: these tests run the same scheduler that stages
CUDA tensors, with host→host (or host→pinned, where pinning works) copies.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import weight_checker
from hypothesis import given
from hypothesis import strategies as st
from weight_checker import _core
from weight_checker.hashing import copy_engines, staging
from weight_checker.staging import HostCopyEngine, StagingStats, digest_staged, plan_slots

from .conftest import vllm_digest
from .test_digests import random_tensor


def make_tensor(kind: str, n: int, seed: int) -> torch.Tensor:
    if kind == "flat":
        return random_tensor((n,), torch.uint8, seed)
    if kind == "bf16":
        return random_tensor((n // 2 + 1,), torch.bfloat16, seed)
    if kind == "transposed":
        return random_tensor((max(n // 64, 1), 16), torch.float32, seed).t()
    if kind == "strided3d":
        return random_tensor((3, max(n // 96, 1), 8), torch.int16, seed).permute(1, 2, 0)[:, ::2]
    return random_tensor((0, 4), torch.float16, seed)  # "empty"


tensor_specs = st.lists(
    st.tuples(
        st.sampled_from(["flat", "bf16", "transposed", "strided3d", "empty"]),
        st.one_of(st.integers(1, 300), st.integers(1, 40_000)),
    ),
    min_size=1,
    max_size=14,
)


@given(
    tensor_specs,
    st.integers(64, 20_000),
    st.integers(1, 5),
    st.integers(1, 9),
    st.randoms(use_true_random=False),
)
def test_staged_digests_equal_hashlib_in_any_order(specs, budget, slots, streams, rnd):
    tensors = [make_tensor(kind, n, i) for i, (kind, n) in enumerate(specs)]
    names = [f"t{i}" for i in range(len(tensors))]
    stats = StagingStats()
    digests, zero = digest_staged(
        tensors, names, engine=HostCopyEngine(), budget=budget, slots=slots, stats=stats, streams=streams
    )
    assert digests == [vllm_digest(t) for t in tensors]
    assert zero == [not bool(t.count_nonzero()) for t in tensors]
    # The bound: all slots together within the budget; no device temporary
    # larger than a slot.
    assert stats.host_bytes <= budget
    assert stats.max_temp_bytes <= stats.slot_bytes
    # Order does not matter: the same tensor gets the same digest.
    order = list(range(len(tensors)))
    rnd.shuffle(order)
    shuffled, _ = digest_staged(
        [tensors[i] for i in order], engine=HostCopyEngine(), budget=budget, slots=slots, streams=streams
    )
    assert dict(zip(order, shuffled, strict=True)) == dict(enumerate(digests))


def test_plan_streams_large_and_packs_small():
    sizes = [10, 20, 0, 250, 5, 400, 300]
    plans = plan_slots(sizes, slot_bytes=100, streams=2)
    # Every byte planned exactly once, each tensor's pieces in order.
    for i, n in enumerate(sizes):
        pieces = [(b, e) for p in plans for j, b, e, _ in p.streamed if j == i]
        whole = [p for p in plans for j, _ in p.packed if j == i]
        if n > 50:
            assert pieces[0][0] == 0 and pieces[-1][1] == n and not whole
            assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
        else:
            assert len(whole) == 1 and not pieces
    # Largest first, two at a time, each with half a slot.
    assert [(j, b, e) for j, b, e, _ in plans[0].streamed] == [(5, 0, 50), (6, 0, 50)]
    assert all(p.nbytes <= 100 for p in plans)
    # Offsets inside a slot do not overlap.
    for p in plans:
        spans = sorted([(o, o + e - b) for _, b, e, o in p.streamed] + [(o, o + sizes[j]) for j, o in p.packed])
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@given(
    st.lists(st.integers(0, 5000), min_size=1, max_size=40),
    st.integers(64, 4000),
    st.integers(1, 8),
    st.integers(0, 2),
)
def test_every_slot_carries_min_k_unfinished_streams(sizes, slot_bytes, streams, lead):
    """The feeder's promise: each slot advances min(K, tensors not yet
    finished) messages at once, within the slot, every byte once, in order,
    with or without leads."""
    plans = plan_slots(sizes, slot_bytes, streams, lead=lead)
    planned = [0] * len(sizes)
    done = [False] * len(sizes)
    for p in plans:
        unfinished = done.count(False)
        assert p.streams >= min(streams, unfinished), (p, unfinished)
        assert p.nbytes <= slot_bytes
        for j, b, e, _ in p.streamed:
            assert b == planned[j] and e > b
            planned[j] = e
            done[j] = e == sizes[j]
        for j, _ in p.packed:
            assert planned[j] == 0 and not done[j]
            planned[j] = sizes[j]
            done[j] = True
    assert planned == sizes and all(done)


class FaultyEngine(HostCopyEngine):
    def __init__(self, fail_copy_at: int | None = None, fail_wait_at: int | None = None):
        super().__init__()
        self.copies = self.waits = 0
        self.fail_copy_at, self.fail_wait_at = fail_copy_at, fail_wait_at

    def copy(self, dst, src):
        self.copies += 1
        if self.copies == self.fail_copy_at:
            raise RuntimeError("injected copy failure")
        super().copy(dst, src)

    def wait(self, fence):
        self.waits += 1
        if self.waits == self.fail_wait_at:
            raise RuntimeError("injected hash-side failure")
        super().wait(fence)


def run_with_timeout(fn, seconds=20):
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), "staging hung"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("at", [1, 3, 7])
def test_copy_error_surfaces_naming_the_tensor(at):
    tensors = [random_tensor((1000,), torch.uint8, i) for i in range(10)]
    names = [f"layer.{i}" for i in range(10)]
    with pytest.raises(RuntimeError, match=r"tensor 'layer\.\d+': staging copy failed: injected"):
        run_with_timeout(
            lambda: digest_staged(tensors, names, engine=FaultyEngine(fail_copy_at=at), budget=2000, slots=2)
        )


class CopyEngineError(Exception):
    """An engine's own exception whose constructor takes more than a message."""

    def __init__(self, device: int, reason: str):
        super().__init__(f"device {device}: {reason}")
        self.device = device


class OddlyFailingEngine(HostCopyEngine):
    def copy(self, dst, src):
        raise CopyEngineError(3, "link down")

    def gather(self, dst, srcs):
        raise CopyEngineError(3, "link down")


def test_a_copy_engine_error_of_any_type_names_the_tensor_and_keeps_its_cause():
    from weight_checker.errors import StagingError

    tensors = [random_tensor((1000,), torch.uint8, i) for i in range(4)]
    names = [f"w{i}" for i in range(4)]
    for budget in (None, 2000):  # small tensors gathered in one slot, or each copied
        with pytest.raises(StagingError, match=r"tensor 'w\d'.*: staging copy failed: device 3: link down") as err:
            run_with_timeout(lambda b=budget: digest_staged(tensors, names, engine=OddlyFailingEngine(), budget=b))
        assert isinstance(err.value.__cause__, CopyEngineError) and err.value.__cause__.device == 3


@pytest.mark.parametrize("at", [1, 2, 5])
def test_hash_side_error_surfaces(at):
    tensors = [random_tensor((1000,), torch.uint8, i) for i in range(10)]
    with pytest.raises(RuntimeError, match="injected hash-side failure"):
        run_with_timeout(lambda: digest_staged(tensors, engine=FaultyEngine(fail_wait_at=at), budget=2000, slots=2))


class BrokenCopier(HostCopyEngine):
    """Queues copies that fail inside the copier thread (a size mismatch)."""

    def copy(self, dst, src):
        super().copy(dst[: max(dst.numel() - 1, 0)], src)


def test_a_failure_in_the_copier_thread_surfaces_without_hanging():
    tensors = [random_tensor((1000,), torch.uint8, i) for i in range(6)]
    with pytest.raises(ValueError, match="destination has"):
        run_with_timeout(lambda: digest_staged(tensors, engine=BrokenCopier(), budget=2000, slots=2))


def test_pinned_engine_falls_back_with_one_warning():
    tensors = [random_tensor((5000,), torch.uint8, 1)]
    copy_engines._pin_warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d1, _ = digest_staged(tensors, engine=HostCopyEngine(pin=True), budget=4096, slots=2)
        d2, _ = digest_staged(tensors, engine=HostCopyEngine(pin=True), budget=4096, slots=2)
    assert d1 == d2 == [vllm_digest(tensors[0])]
    pin_warnings = [w for w in caught if "pinning" in str(w.message)]
    assert len(pin_warnings) == (0 if torch.cuda.is_available() else 1)


def test_budget_env_var(monkeypatch):
    monkeypatch.setenv(staging.BUDGET_ENV, "64")
    assert staging.budget_bytes() == 64 << 20
    monkeypatch.setenv(staging.BUDGET_ENV, "lots")
    with pytest.raises(ValueError, match=r"WEIGHT_CHECKER_STAGING_MB=.lots.: expected a positive number"):
        staging.budget_bytes()


def test_unsupported_device_is_named():
    with pytest.raises(_core.DeviceTensorError, match=r"'w'.*meta"):
        weight_checker.checksum({"ok": torch.ones(2), "w": torch.empty(3, device="meta")})


RSS_SCRIPT = r"""
import json, torch
from weight_checker.staging import HostCopyEngine, StagingStats, digest_staged
tensors = [torch.full((16 << 20,), i % 251, dtype=torch.uint8) for i in range(64)]  # 1 GiB
tensors += [torch.full((3000,), 7, dtype=torch.uint8) for _ in range(200)]
# VmHWM (not ru_maxrss, which a child inherits from its parent across exec).
peak = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
before = peak()
stats = StagingStats()
digest_staged(tensors, engine=HostCopyEngine(pin=True), budget=64 << 20, slots=4, stats=stats)
print(json.dumps({"growth": peak() - before, "host_bytes": stats.host_bytes}))
"""


def test_staging_bound_holds_for_a_1gb_parameter_set():
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["host_bytes"] <= 64 << 20
    # Slots (64 MiB) plus allocator slack; a host snapshot would be 1 GiB.
    assert r["growth"] < (64 + 48) << 20, r


def test_gpu_check_script_dry_run(tmp_path):
    # The prepared GPU script must run; without CUDA it checks and times the
    # same code paths at tiny sizes with host staging.
    script = str(Path(__file__).parent.parent / "benches" / "gpu_check.py")
    env = dict(os.environ, OUT=str(tmp_path))
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run benches/gpu_check.py itself")
    subprocess.run([sys.executable, script, "--smoke"], env=env, check=True, capture_output=True)
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r["digest_check"]["mismatches"] == [] and r["staged_check"]["mismatches"] == []


class RecordingEngine(HostCopyEngine):
    """The host copy engine, recording which tensor each copy is queued for, in order."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.owner = {t.untyped_storage().data_ptr(): i for i, t in enumerate(tensors)}
        self.copied: list[int] = []

    def copy(self, dst, src) -> None:
        self.copied.append(self.owner[src.untyped_storage().data_ptr()])
        super().copy(dst, src)

    def gather(self, dst, tensors):
        self.copied += [self.owner[t.untyped_storage().data_ptr()] for t in tensors]
        return super().gather(dst, tensors)


@pytest.mark.parametrize("place", ["first", "middle", "last"])
@pytest.mark.parametrize("lead", [0, 1])
def test_the_largest_tensors_first_pieces_are_copied_and_hashed_before_any_smaller_ones(monkeypatch, place, lead):
    """Whatever the model order (the largest first, in the middle, last: an
    ``lm_head``), the whole set is planned before the first copy: the largest
    tensor's first piece is the first copied and leads the first slot hashed.
    With a lead (a chain that ends the run), it has the most of every slot
    until it ends, and ends in the last slot with the rest."""
    big = random_tensor((1 << 20,), torch.bfloat16, 99)  # 2 MiB
    others = [random_tensor((1 << 17,), torch.bfloat16, i) for i in range(8)]  # 8 x 256 KiB
    at = {"first": 0, "middle": 4, "last": 8}[place]
    tensors = [*others[:at], big, *others[at:]]
    hashed: list[list[int]] = []
    hash_slot = staging._hash_slot

    def recording(engine, fence, multi, slot, feeds, keep, stats):
        hashed.append([i for i, _, _ in feeds])
        return hash_slot(engine, fence, multi, slot, feeds, keep, stats)

    monkeypatch.setattr(staging, "_hash_slot", recording)
    engine = RecordingEngine(tensors)
    stats = StagingStats()
    digests, _ = digest_staged(tensors, engine=engine, budget=1 << 20, slots=4, streams=4, lead=lead, stats=stats)
    assert digests == [vllm_digest(t) for t in tensors]
    assert engine.copied[0] == at, engine.copied[:5]
    assert hashed[0][0] == at, hashed[0]
    assert stats.lead == lead
    plans = plan_slots([t.nbytes for t in tensors], stats.slot_bytes, 4, lead=lead)
    if lead:
        # The chain has the largest piece of every slot, and ends with the rest.
        for plan in plans:
            pieces = {i: e - b for i, b, e, _ in plan.streamed}
            assert at in pieces and pieces[at] == max(pieces.values()), plan
        assert len(hashed) == len(plans)
