"""Device tensors: a bounded, overlapped device → pinned-host staging pipeline.

vLLM's reference copies every parameter to pageable memory with a blocking
``.cpu()``, one at a time, then hashes it. SHA-256 of one tensor is one
sequential stream, so a pipeline that moves one tensor (or one run of bytes)
at a time hashes at one stream whatever the core count. Here the staging is
the core's streaming feeder applied to device memory: up to K large tensors
(K = the scheduler's threads x lanes) are open at once and every pinned slot
carries the next piece of each of them, so each slot is hashed as K
parallel streams; each tensor's pieces reach its digest in order. Small
tensors are gathered on the device (one op per run of one dtype) and moved
with one copy per slot. A small ring of pinned host slots bounds host
memory (512 MiB by default); copies run on a side CUDA stream, ordered after
the caller's, and each slot carries an event so that hashing slot k
overlaps the copy into slot k+1. Non-contiguous tensors are made contiguous
on the device piece by piece, so no temporary is larger than a slot.

The copy engine is injectable (:mod:`weight_checker.copy_engines`): the same
scheduler runs CPU→pinned or CPU→CPU in tests on machines without a GPU
(``HostCopyEngine``). This module holds the memory budget, the slot planner
and the pipeline; :mod:`weight_checker.tensor_bytes` the byte views.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from weight_checker import _core, settings
from weight_checker.errors import InputError, StagingError
from weight_checker.hashing.copy_engines import CopyEngine, CudaCopyEngine
from weight_checker.hashing.tensor_bytes import byte_pieces

__all__ = ["StagingStats", "budget_bytes", "digest_mixed", "digest_staged", "plan_slots"]

logger = logging.getLogger(__name__)

MiB = 1 << 20
#: Total pinned host memory the pipeline may hold (all slots together).
DEFAULT_BUDGET_BYTES = 512 * MiB
#: Slots in the ring: one being copied into, the rest being hashed or free.
DEFAULT_SLOTS = 4


BUDGET_ENV = "WEIGHT_CHECKER_STAGING_MB"


def budget_bytes() -> int:
    """The staging budget: ``WEIGHT_CHECKER_STAGING_MB`` if set, else 512 MiB
    (:class:`~weight_checker.errors.SettingsError` for a value it does not take)."""
    mb = settings.get(BUDGET_ENV)
    if mb is None:
        return DEFAULT_BUDGET_BYTES
    return max(int(mb * MiB), 4096)


@dataclass
class SlotPlan:
    """What one slot carries.

    ``streamed``: ``(index, start, stop, offset)``, bytes ``[start, stop)`` of
    a large tensor's C-order bytes at ``offset`` in the slot; at most one piece
    per tensor per slot, and a tensor's pieces follow each other in slot order.
    ``packed``: ``(index, offset)``, whole small tensors, runs of one dtype
    gathered on the device and moved with one copy per run.
    """

    streamed: list[tuple[int, int, int, int]] = field(default_factory=list)
    packed: list[tuple[int, int]] = field(default_factory=list)
    nbytes: int = 0

    @property
    def streams(self) -> int:
        """Messages this slot advances: what the scheduler hashes in parallel."""
        return len(self.streamed) + len(self.packed)


#: Packed tensors up to this size are gathered on the device (one op per run
#: of one dtype) instead of being copied one by one: below it, per-copy
#: overhead (a launch, a DMA setup) costs more than the extra device copy.
GATHER_MAX_BYTES = 1 << 20

#: Pieces of large tensors are cut at multiples of this (when they are larger):
#: whole SHA-256 blocks and whole pages for the copies.
PIECE_ALIGN = 4096


def plan_slots(
    sizes: list[int], slot_bytes: int, streams: int, kinds: list[Any] | None = None, lead: int = 0
) -> list[SlotPlan]:
    """The streaming feeder's plan for staged bytes, made for the whole set
    before the first copy.

    Up to ``streams`` large tensors are open at once, largest first; every
    slot carries the next piece of each open one (``slot_bytes / streams``
    bytes, more when fewer are open), so each slot feeds the scheduler
    ``streams`` messages at once and a finished tensor's place goes to the
    next at once. Tensors of at most ``slot_bytes / streams`` bytes are
    packed whole into the room the open ones leave, grouped by ``kinds``
    (their dtypes) so that each run of one kind is gathered with one device
    op and moved with one copy.

    ``lead``: the largest tensors that end the run on one stream each
    (``_core.dominant_chains``). Each gets, from the first slot, a share of
    every slot in proportion to its bytes left (so that they and the rest end
    together), copied first; the rest share what is left. Each slot is one
    run of the scheduler, which gives such a piece a worker of its own: the
    chain advances at one stream's full rate from the start, instead of at a
    fraction of it while the others are open.
    """
    if slot_bytes <= 0 or streams <= 0:
        raise InputError("slot_bytes and streams must be positive")
    chunk = max(slot_bytes // streams, 1)
    large = sorted((i for i, n in enumerate(sizes) if n > chunk), key=lambda i: -sizes[i])
    small = [i for i, n in enumerate(sizes) if n <= chunk]
    if kinds is not None and len(set(kinds)) > 1:
        order = {k: j for j, k in enumerate(dict.fromkeys(kinds[i] for i in small))}
        small.sort(key=lambda i: order[kinds[i]])
    leads = set(large[: max(lead, 0)])
    left_total = sum(sizes)
    plans: list[SlotPlan] = []
    open_: list[list[int]] = []  # [index, bytes planned so far]
    next_large = next_small = 0
    while next_large < len(large) or open_ or next_small < len(small):
        while len(open_) < streams and next_large < len(large):
            open_.append([large[next_large], 0])
            next_large += 1
        plan = SlotPlan()
        if open_:
            # Room for small tensors while fewer than `streams` are open.
            room = (streams - len(open_)) * chunk if next_small < len(small) else 0
            # The leads first: their share of the slot follows their bytes
            # left, leaving the room and at least a byte to every other open one.
            rest_n = sum(1 for o in open_ if o[0] not in leads)
            for o in open_:
                if o[0] not in leads:
                    continue
                left = sizes[o[0]] - o[1]
                want = left if left_total == left else slot_bytes * left // left_total
                if want > PIECE_ALIGN:
                    want -= want % PIECE_ALIGN
                take = min(left, max(want, 1), max(slot_bytes - plan.nbytes - rest_n - room, 1))
                plan.streamed.append((o[0], o[1], o[1] + take, plan.nbytes))
                plan.nbytes += take
                o[1] += take
            rest = [o for o in open_ if o[0] not in leads]
            if rest:
                share = max((slot_bytes - plan.nbytes - room) // len(rest), 1)
                if share > PIECE_ALIGN:
                    share -= share % PIECE_ALIGN
                for o in rest:
                    take = min(sizes[o[0]] - o[1], share, slot_bytes - plan.nbytes)
                    if take <= 0:
                        continue
                    plan.streamed.append((o[0], o[1], o[1] + take, plan.nbytes))
                    plan.nbytes += take
                    o[1] += take
            open_ = [o for o in open_ if o[1] < sizes[o[0]]]
        # Small tensors, whole, back to back (the hot loop for models of many
        # small parameters: locals only).
        packed, used, n_small = plan.packed, plan.nbytes, len(small)
        while next_small < n_small:
            i = small[next_small]
            size = sizes[i]
            if used + size > slot_bytes:
                break
            packed.append((i, used))
            used += size
            next_small += 1
        plan.nbytes = used
        left_total -= used
        plans.append(plan)
    return plans


@dataclass
class StagingStats:
    """What one staged run used and where its time went: for logs,
    benchmarks (``benches/gpu_check.py``) and the bound's tests."""

    slot_bytes: int = 0
    slots: int = 0
    host_bytes: int = 0  # all slots together: never above the budget
    copies: int = 0
    max_temp_bytes: int = 0  # largest device temporary (contiguous piece or gather)
    streams: int = 0  # K: messages the scheduler keeps in flight
    lead: int = 0  # the largest tensors given the most of every slot (their chains end the run)
    slot_streams: list[int] = field(default_factory=list)  # messages each slot carried
    copy_seconds: float = 0.0  # issuing copies (and device ops), on the caller's thread
    wait_seconds: float = 0.0  # hashing thread waiting for copies to land
    hash_seconds: float = 0.0  # hashing thread hashing


def digest_staged(
    tensors: list[Any],
    names: list[str] | None = None,
    *,
    engine: CopyEngine,
    budget: int | None = None,
    slots: int = DEFAULT_SLOTS,
    stats: StagingStats | None = None,
    streams: int | None = None,
    lead: int | None = None,
) -> tuple[list[str], list[bool]]:
    """Digests and all-zero flags of ``tensors`` (all on one device), staged
    through at most ``budget`` bytes of host slots, ``streams`` messages
    (default: the scheduler's threads x lanes) hashed at once; ``lead``: the
    largest tensors that lead every slot (default: those that end the run
    alone, ``_core.dominant_chains``; see :func:`plan_slots`)."""
    import torch

    budget = budget_bytes() if budget is None else budget
    if budget <= 0 or slots <= 0:
        raise InputError("staging budget and slot count must be positive")
    names = names if names is not None else [f"#{i}" for i in range(len(tensors))]
    streams = streams or _core.streams()
    dtypes = [t.dtype for t in tensors]
    prepared = [_resolve(t) if d.is_complex else t for t, d in zip(tensors, dtypes, strict=True)]
    sizes = [t.nbytes for t in prepared]
    slot_bytes = max(budget // slots, 1)
    lead = _core.dominant_chains(sizes) if lead is None else lead
    plans = plan_slots(sizes, slot_bytes, streams, dtypes, lead)
    # Never allocate more than the data needs.
    slot_bytes = min(slot_bytes, max((p.nbytes for p in plans), default=1)) or 1
    stats = stats if stats is not None else StagingStats()
    stats.slot_bytes, stats.streams, stats.lead = slot_bytes, streams, lead
    multi = _core.MultiHasher(len(prepared))
    ring = [engine.alloc(slot_bytes) for _ in range(min(slots, len(plans)))]
    stats.slots = len(ring)
    stats.host_bytes = slot_bytes * len(ring)
    inflight: list[Future | None] = [None] * len(ring)
    # One hashing thread: slots are hashed in the order they were filled, so
    # every digest gets its pieces in order. The hashing itself is parallel.
    try:
        with torch.no_grad(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-checker-hash") as hasher:
            try:
                engine.begin()
                for k, plan in enumerate(plans):
                    s = k % len(ring)
                    pending = inflight[s]
                    if pending is not None:
                        pending.result()  # the slot is free again (or re-raise)
                        inflight[s] = None
                    start = time.perf_counter()
                    keep = _fill_slot(engine, ring[s], plan, prepared, names, sizes, dtypes, stats)
                    stats.copy_seconds += time.perf_counter() - start
                    stats.slot_streams.append(plan.streams)
                    feeds = [(i, off, stop - begin) for i, begin, stop, off in plan.streamed]
                    feeds += [(i, off, sizes[i]) for i, off in plan.packed]
                    fence = engine.fence()
                    inflight[s] = hasher.submit(_hash_slot, engine, fence, multi, ring[s], feeds, keep, stats)
                for f in inflight:
                    if f is not None:
                        f.result()
            except BaseException:
                # Queued hashes are dropped; the one running finishes (the
                # executor joins it) before the slots are given back. The
                # first error is the one raised.
                for f in inflight:
                    if f is not None:
                        f.cancel()
                raise
    finally:
        engine.free(ring)  # nothing reads or writes the slots any more
    return multi.finish()


def _fill_slot(
    engine: CopyEngine,
    slot: Any,
    plan: SlotPlan,
    tensors: list[Any],
    names: list[str],
    sizes: list[int],
    dtypes: list[Any],
    stats: StagingStats,
) -> list[Any]:
    """Queues the copies of one slot; returns the device temporaries, which
    must live until those copies have landed."""
    keep: list[Any] = []
    packed = plan.packed
    # Pieces of large tensors, and packed tensors big enough that one copy of
    # their own costs nothing extra: copied as they are.
    direct = list(plan.streamed)
    direct += [(i, 0, sizes[i], off) for i, off in packed if sizes[i] > GATHER_MAX_BYTES]
    for i, begin, stop, offset in direct:
        try:

            def pieces(i: int = i, begin: int = begin, stop: int = stop) -> list[Any]:
                return list(byte_pieces(tensors[i], begin, stop))

            for src in engine.run(pieces):
                n = src.numel()
                if src.untyped_storage().data_ptr() != tensors[i].untyped_storage().data_ptr():
                    stats.max_temp_bytes = max(stats.max_temp_bytes, n)  # a device temporary
                engine.copy(slot[offset : offset + n], src)
                stats.copies += 1
                keep.append(src)
                offset += n
        except Exception as e:
            raise StagingError(f"tensor '{names[i]}': staging copy failed: {e}") from e
    # Runs of small tensors of one dtype, back to back in the slot: gathered
    # on the device with one op, moved with one copy.
    small = [(i, off) for i, off in packed if sizes[i] <= GATHER_MAX_BYTES]
    j, n_small = 0, len(small)
    while j < n_small:
        end = j + 1
        dtype = dtypes[small[j][0]]
        stop = small[j][1] + sizes[small[j][0]]
        while end < n_small and small[end][1] == stop and dtypes[small[end][0]] == dtype:
            stop += sizes[small[end][0]]
            end += 1
        run = [tensors[k] for k, _ in small[j:end]]
        first = small[j][1]
        n = stop - first
        try:
            if n:
                keep += engine.gather(slot[first : first + n], run)
                stats.max_temp_bytes = max(stats.max_temp_bytes, n)
                stats.copies += 1
        except Exception as e:
            which = ", ".join(f"'{names[k]}'" for k, _ in small[j : min(end, j + 3)])
            more = f" and {end - j - 3} more" if end - j > 3 else ""
            raise StagingError(f"tensor {which}{more}: staging copy failed: {e}") from e
        j = end
    return keep


def _hash_slot(
    engine: CopyEngine, fence: Any, multi: Any, slot: Any, feeds: list, keep: list, stats: StagingStats
) -> None:
    start = time.perf_counter()
    engine.wait(fence)
    keep.clear()  # device temporaries may be reused once their copies landed
    waited = time.perf_counter()
    multi.update_at(slot, feeds)
    stats.wait_seconds += waited - start
    stats.hash_seconds += time.perf_counter() - waited


def _resolve(t: Any) -> Any:
    """The tensor whose memory holds the logical bytes (conjugate bits resolved)."""
    if t.is_complex() and t.is_conj():
        t = t.resolve_conj()
    return t


def digest_mixed(names: list[str], tensors: list[Any]) -> tuple[list[str], list[bool]]:
    """Digests of tensors on any mix of devices: host ones directly, device
    ones staged per device."""
    digests: list[str] = [""] * len(tensors)
    zero: list[bool] = [False] * len(tensors)
    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(None if t.is_cpu else t.device, []).append(i)
    for device, idx in groups.items():
        sub_t = [tensors[i] for i in idx]
        sub_n = [names[i] for i in idx]
        if device is None:
            d, z = _core.digest_many(sub_t, sub_n)
        elif device.type == "cuda":
            d, z = digest_staged(sub_t, sub_n, engine=CudaCopyEngine(device))
        else:
            raise _core.DeviceTensorError(
                f"tensor '{sub_n[0]}' is on device {device}; only CPU and CUDA tensors are supported"
            )
        for i, di, zi in zip(idx, d, z, strict=True):
            digests[i], zero[i] = di, zi
    return digests, zero
