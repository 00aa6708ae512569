"""Device tensors: a bounded, overlapped device → pinned-host staging pipeline.

vLLM's reference copies every parameter to pageable memory with a blocking
``.cpu()``, one at a time, then hashes it. SHA-256 of one tensor is one
sequential stream, so a pipeline that moves one tensor (or one run of bytes)
at a time hashes at one stream whatever the core count. Here the staging is
the core's streaming feeder applied to device memory: up to K large tensors
(K = the engine's threads x lanes) are open at once and every pinned slot
carries the next piece of each of them, so each slot is hashed as K
parallel streams; each tensor's pieces reach its digest in order. Small
tensors are gathered on the device (one op per run of one dtype) and moved
with one copy per slot. A small ring of pinned host slots bounds host
memory (512 MiB by default); copies run on a side stream, ordered after the
caller's stream, and each slot carries an event so that hashing slot k
overlaps the copy into slot k+1. Non-contiguous tensors are made contiguous
on the device piece by piece, so no temporary is larger than a slot.

The copy engine is injectable: the same scheduler runs CPU→pinned or CPU→CPU
in tests on machines without a GPU (``HostCopyEngine``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from weight_checker import _core
from weight_checker.errors import WeightCheckerError

logger = logging.getLogger(__name__)

MiB = 1 << 20
#: Total pinned host memory the pipeline may hold (all slots together).
DEFAULT_BUDGET_BYTES = 512 * MiB
#: Slots in the ring: one being copied into, the rest being hashed or free.
DEFAULT_SLOTS = 4


class StagingError(WeightCheckerError, RuntimeError):
    """A device-to-host copy failed: names the tensor(s); the copy engine's own
    exception is its ``__cause__`` (re-raising that type with a new message
    would fail for exceptions whose constructor takes other arguments)."""


BUDGET_ENV = "WEIGHT_CHECKER_STAGING_MB"
#: CPU priority of the host copy engine's copier thread: below the hashing
#: threads, so it mostly runs in their gaps (measured on a 2-vCPU AMD EPYC:
#: nice 5-10 best, 0 and 19 a few percent slower; a default, not a per-CPU rule).
COPIER_NICE = 10


def budget_bytes() -> int:
    """The staging budget: ``WEIGHT_CHECKER_STAGING_MB`` if set, else 512 MiB."""
    raw = os.environ.get(BUDGET_ENV)
    if raw is None:
        return DEFAULT_BUDGET_BYTES
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"{BUDGET_ENV} must be a number of MiB, got {raw!r}") from None
    if mb <= 0:
        raise ValueError(f"{BUDGET_ENV} must be positive, got {raw!r}")
    return max(int(mb * MiB), 4096)


class CopyEngine(Protocol):
    """Moves bytes from the source tensors' device into host slots."""

    def alloc(self, nbytes: int) -> Any:
        """A host ``uint8`` tensor of ``nbytes`` (pinned where possible)."""

    def begin(self) -> None:
        """Orders the copies after all work already queued on the sources."""

    def run(self, fn: Callable[[], Any]) -> Any:
        """Runs a device op (making a piece contiguous) where copies are ordered."""

    def copy(self, dst: Any, src: Any) -> None:
        """Queues ``dst.copy_(src)`` (``src``: contiguous ``uint8`` on the device)."""

    def gather(self, dst: Any, tensors: list[Any]) -> list[Any]:
        """Queues the copy of ``tensors``' C-order bytes, back to back, into
        ``dst``; returns what must stay alive until it has landed."""

    def fence(self) -> Any:
        """A handle for every copy queued so far."""

    def wait(self, fence: Any) -> None:
        """Blocks until the copies behind ``fence`` have landed."""

    def free(self, buffers: list[Any]) -> None:
        """Takes back the slots of a finished run (to reuse or drop)."""


_pin_warned = threading.Event()


def alloc_host(nbytes: int, pin: bool) -> Any:
    """A host ``uint8`` buffer; pinned if asked and possible, else pageable
    (with one warning per process)."""
    import torch

    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:
            if not _pin_warned.is_set():
                _pin_warned.set()
                msg = f"weight_checker: pinning {nbytes} bytes failed ({e}); staging through pageable memory"
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
                logger.warning(msg)
    return torch.empty(nbytes, dtype=torch.uint8)


class HostCopyEngine:
    """Copies from host tensors: the scheduler's test engine and CPU proxy
    (CPU→CPU, or CPU→pinned with ``pin=True``).

    Like a device's copy engine it is asynchronous: ``copy`` and ``gather``
    queue, one copier thread works the queue, ``fence``/``wait`` order the
    hashing after the copies. The copier runs at a lower CPU priority
    (nice 10, for that thread only), so that copying mostly fills the hashing
    threads' gaps instead of time-slicing with them (a GPU's DMA engine takes
    no CPU at all); and a hashing thread that would wait for a copy does
    queued copies itself meanwhile, so a slot is never waited for while
    nobody copies at full priority.

    The last run's slots are kept for the next run (one ring per process, at
    most the budget): fresh pageable pages would otherwise be faulted in and
    zeroed on every run, as torch's caching host allocator spares the CUDA
    engine's pinned slots."""

    _spare: ClassVar[dict[tuple[bool, int], list[Any]]] = {}
    _spare_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, pin: bool = False):
        self.pin = pin
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # Copies are numbered as queued; `_low` is the first number not yet
        # done (every copy below it is done), `_finished` the ones done above.
        self._progress = threading.Condition()
        self._queued = 0
        self._low = 0
        self._finished: set[int] = set()

    def alloc(self, nbytes: int) -> Any:
        with self._spare_lock:
            spare = self._spare.get((self.pin, nbytes))
            if spare:
                return spare.pop()
        return alloc_host(nbytes, self.pin)

    def free(self, buffers: list[Any]) -> None:
        if self._queue is not None:
            # The copier drains what is queued (skipping copies after an
            # error) and exits; joined so that no copy touches a slot after
            # it is given back, nor outlives the interpreter.
            self._queue.put(None)
            self._queue = None
            if self._thread is not None:
                self._thread.join()
                self._thread = None
        if not buffers:
            return
        with self._spare_lock:
            HostCopyEngine._spare = {(self.pin, buffers[0].numel()): list(buffers)}

    def begin(self) -> None:
        self._error = None  # a failed run's error does not outlive it

    def run(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def gather(self, dst: Any, tensors: list[Any]) -> list[Any]:
        # One call copies them all from host memory (no device to gather on).
        self._put(("gather", dst, tensors))
        return []

    def copy(self, dst: Any, src: Any) -> None:
        self._put(("copy", dst, src))

    def _put(self, item: tuple) -> None:
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._copier, args=(self._queue,), name="weight-checker-copy", daemon=True
            )
            self._thread.start()
        self._queue.put((self._queued, *item))
        self._queued += 1

    def fence(self) -> Any:
        """Every copy queued so far (their count)."""
        return self._queued

    def wait(self, fence: Any) -> None:
        while True:
            with self._progress:
                if self._low >= fence:
                    break
            try:
                item = self._queue.get_nowait() if self._queue is not None else None
            except queue.Empty:
                item = None
            if item is None:
                # Nothing left to help with: the rest is in the copier's hands.
                with self._progress:
                    self._progress.wait_for(lambda: self._low >= fence)
                break
            self._do(item)
        if self._error is not None:
            raise self._error

    def _copier(self, work: queue.SimpleQueue) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COPIER_NICE)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass
        while (item := work.get()) is not None:
            self._do(item)

    def _do(self, item: tuple) -> None:
        number, kind, dst, src = item
        if self._error is None:
            try:
                if kind == "gather":
                    _core.copy_into(dst.numpy(), *src)
                elif src.is_cpu and dst.is_cpu:
                    # One thread: torch's copy_ would fan out to its OpenMP
                    # pool, over the cores the hashing needs.
                    _core.copy_into(dst.numpy(), src)
                else:
                    dst.copy_(src)
            except BaseException as e:
                self._error = e
        with self._progress:
            self._finished.add(number)
            while self._low in self._finished:
                self._finished.discard(self._low)
                self._low += 1
            self._progress.notify_all()


class CudaCopyEngine:
    """Copies on a side CUDA stream into pinned slots, with one event per slot."""

    def __init__(self, device: Any):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def alloc(self, nbytes: int) -> Any:
        return alloc_host(nbytes, pin=True)

    def begin(self) -> None:
        # The weights may still be being written by the caller's stream (a
        # weight update in flight): copy only after that work.
        self.stream.wait_stream(self.torch.cuda.current_stream(self.device))

    def run(self, fn: Callable[[], Any]) -> Any:
        # Temporaries are allocated on the side stream, so the caching
        # allocator reuses them only after that stream's copies.
        with self.torch.cuda.stream(self.stream):
            return fn()

    def copy(self, dst: Any, src: Any) -> None:
        with self.torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def fence(self) -> Any:
        event = self.torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, fence: Any) -> None:
        fence.synchronize()

    def gather(self, dst: Any, tensors: list[Any]) -> list[Any]:
        # One device op (a cat), then one copy.
        src = self.run(lambda: gather_bytes(tensors))
        self.copy(dst, src)
        return [src]

    def free(self, buffers: list[Any]) -> None:
        pass  # torch's caching host allocator keeps pinned blocks for reuse


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
        """Messages this slot advances: what the engine hashes in parallel."""
        return len(self.streamed) + len(self.packed)


#: Packed tensors up to this size are gathered on the device (one op per run
#: of one dtype) instead of being copied one by one: below it, per-copy
#: overhead (a launch, a DMA setup) costs more than the extra device copy.
GATHER_MAX_BYTES = 1 << 20

#: Pieces of large tensors are cut at multiples of this (when they are larger):
#: whole SHA-256 blocks and whole pages for the copies.
PIECE_ALIGN = 4096


def plan_slots(sizes: list[int], slot_bytes: int, streams: int, kinds: list[Any] | None = None) -> list[SlotPlan]:
    """The streaming feeder's plan for staged bytes.

    Up to ``streams`` large tensors are open at once, largest first; every
    slot carries the next piece of each open one (``slot_bytes / streams``
    bytes, more when fewer are open), so each slot feeds the engine
    ``streams`` messages at once and a finished tensor's place goes to the
    next at once. Tensors of at most ``slot_bytes / streams`` bytes are
    packed whole into the room the open ones leave, grouped by ``kinds``
    (their dtypes) so that each run of one kind is gathered with one device
    op and moved with one copy.
    """
    if slot_bytes <= 0 or streams <= 0:
        raise ValueError("slot_bytes and streams must be positive")
    chunk = max(slot_bytes // streams, 1)
    large = sorted((i for i, n in enumerate(sizes) if n > chunk), key=lambda i: -sizes[i])
    small = [i for i, n in enumerate(sizes) if n <= chunk]
    if kinds is not None and len(set(kinds)) > 1:
        order = {k: j for j, k in enumerate(dict.fromkeys(kinds[i] for i in small))}
        small.sort(key=lambda i: order[kinds[i]])
    plans: list[SlotPlan] = []
    open_: list[list[int]] = []  # [index, bytes planned so far]
    next_large = next_small = 0
    while next_large < len(large) or open_ or next_small < len(small):
        while len(open_) < streams and next_large < len(large):
            open_.append([large[next_large], 0])
            next_large += 1
        plan = SlotPlan()
        if open_:
            # Leave room for small tensors while lanes are free for them.
            room = (streams - len(open_)) * chunk if next_small < len(small) else 0
            share = (slot_bytes - room) // len(open_)
            if share > PIECE_ALIGN:
                share -= share % PIECE_ALIGN
            for o in open_:
                take = min(sizes[o[0]] - o[1], share)
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
        plans.append(plan)
    return plans


def nbytes_of(t: Any) -> int:
    return t.numel() * t.element_size()


def _flat_bytes(t: Any) -> Any:
    """A contiguous tensor's bytes as a flat ``uint8`` view."""
    import torch

    # as_strided, not view(-1): a one-element tensor counts as contiguous
    # whatever its stride, and `view(uint8)` needs a unit stride.
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def byte_pieces(t: Any, start: int, stop: int) -> Iterator[Any]:
    """Contiguous ``uint8`` tensors (on ``t``'s device) that together hold
    bytes ``[start, stop)`` of ``t``'s C-order bytes. Only sub-blocks of ``t``
    are ever made contiguous, each at most ``stop - start`` bytes."""
    if start >= stop:
        return
    if t.is_contiguous():
        yield _flat_bytes(t)[start:stop]
        return
    row = nbytes_of(t[0])  # non-contiguous implies dim >= 1 and numel > 0
    while start < stop:
        r = start // row
        row_start = r * row
        if start == row_start and stop >= row_start + row:
            r_end = stop // row  # whole rows only: at most stop - start bytes
            yield _flat_bytes(t[r:r_end].contiguous())
            start = r_end * row
        else:
            seg_stop = min(stop, row_start + row)
            yield from byte_pieces(t[r], start - row_start, seg_stop - row_start)
            start = seg_stop


def gather_bytes(tensors: list[Any]) -> Any:
    """The C-order bytes of ``tensors`` (one dtype) back to back, as one
    ``uint8`` tensor on their device: one op (``flatten_dense_tensors``, a
    single ``cat``) instead of one copy per tensor."""
    import torch

    flat = torch._utils._flatten_dense_tensors(tensors)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


@dataclass
class StagingStats:
    """What one staged run used and where its time went: for logs,
    benchmarks (``benches/gpu_check.py``) and the bound's tests."""

    slot_bytes: int = 0
    slots: int = 0
    host_bytes: int = 0  # all slots together: never above the budget
    copies: int = 0
    max_temp_bytes: int = 0  # largest device temporary (contiguous piece or gather)
    streams: int = 0  # K: messages the engine keeps in flight
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
) -> tuple[list[str], list[bool]]:
    """Digests and all-zero flags of ``tensors`` (all on one device), staged
    through at most ``budget`` bytes of host slots, ``streams`` messages
    (default: the engine's threads x lanes) hashed at once."""
    import torch

    budget = budget_bytes() if budget is None else budget
    if budget <= 0 or slots <= 0:
        raise ValueError("staging budget and slot count must be positive")
    names = names if names is not None else [f"#{i}" for i in range(len(tensors))]
    streams = streams or _core.streams()
    dtypes = [t.dtype for t in tensors]
    prepared = [_resolve(t) if d.is_complex else t for t, d in zip(tensors, dtypes, strict=True)]
    sizes = [t.nbytes for t in prepared]
    slot_bytes = max(budget // slots, 1)
    plans = plan_slots(sizes, slot_bytes, streams, dtypes)
    # Never allocate more than the data needs.
    slot_bytes = min(slot_bytes, max((p.nbytes for p in plans), default=1)) or 1
    stats = stats if stats is not None else StagingStats()
    stats.slot_bytes, stats.streams = slot_bytes, streams
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
