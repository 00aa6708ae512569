"""Device tensors: a bounded, overlapped device → pinned-host staging pipeline.

vLLM's reference copies every parameter to pageable memory with a blocking
``.cpu()``, one at a time, then hashes it. Here the C-order bytes of all
device tensors are treated as one stream cut into slot-sized pieces: many
small tensors share one slot (one copy), a large tensor spans several slots
and is hashed incrementally, chunk by chunk, by the core's ``MultiHasher``.
A small ring of pinned host slots bounds host memory (512 MiB by default);
copies run on a side stream, ordered after the caller's stream, and each slot
carries an event so that hashing slot k overlaps the copy into slot k+1.
Non-contiguous tensors are made contiguous on the device piece by piece, so
no temporary is ever larger than a slot.

The copy engine is injectable: the same scheduler runs CPU→pinned or CPU→CPU
in tests on machines without a GPU.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from weight_checker import _core

logger = logging.getLogger(__name__)

MiB = 1 << 20
#: Total pinned host memory the pipeline may hold (all slots together).
DEFAULT_BUDGET_BYTES = 512 * MiB
#: Slots in the ring: one being copied into, the rest being hashed or free.
DEFAULT_SLOTS = 4
BUDGET_ENV = "WEIGHT_CHECKER_STAGING_MB"


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

    def fence(self) -> Any:
        """A handle for every copy queued so far."""

    def wait(self, fence: Any) -> None:
        """Blocks until the copies behind ``fence`` have landed."""


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
    """Synchronous copies from host tensors: the scheduler's test engine
    (CPU→CPU, or CPU→pinned with ``pin=True``). Overlap still happens: the
    hashing thread works on one slot while this thread copies into the next."""

    def __init__(self, pin: bool = False):
        self.pin = pin

    def alloc(self, nbytes: int) -> Any:
        return alloc_host(nbytes, self.pin)

    def begin(self) -> None:
        pass

    def run(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def fence(self) -> Any:
        return None

    def wait(self, fence: Any) -> None:
        pass


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


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, stop)`` of tensor ``index``'s C-order bytes, placed at
    ``offset`` in a slot."""

    index: int
    start: int
    stop: int
    offset: int


def plan_slots(sizes: list[int], slot_bytes: int) -> list[list[Piece]]:
    """Cuts the concatenated bytes of all tensors into slot-sized pieces.

    Small tensors share a slot; a tensor larger than a slot spans several,
    in order, so its chunks reach the hasher in order.
    """
    if slot_bytes <= 0:
        raise ValueError("slot_bytes must be positive")
    slots: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for index, size in enumerate(sizes):
        pos = 0
        while pos < size:
            take = min(size - pos, slot_bytes - used)
            current.append(Piece(index, pos, pos + take, used))
            used += take
            pos += take
            if used == slot_bytes:
                slots.append(current)
                current, used = [], 0
    if current:
        slots.append(current)
    return slots


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


@dataclass
class StagingStats:
    """What one staged run used: for logs, benchmarks and the bound's tests."""

    slot_bytes: int = 0
    slots: int = 0
    host_bytes: int = 0  # all slots together: never above the budget
    copies: int = 0
    max_temp_bytes: int = 0  # largest contiguous-ised piece made on the device


def digest_staged(
    tensors: list[Any],
    names: list[str] | None = None,
    *,
    engine: CopyEngine,
    budget: int | None = None,
    slots: int = DEFAULT_SLOTS,
    stats: StagingStats | None = None,
) -> tuple[list[str], list[bool]]:
    """Digests and all-zero flags of ``tensors`` (all on one device), staged
    through at most ``budget`` bytes of host slots."""
    budget = budget_bytes() if budget is None else budget
    if budget <= 0 or slots <= 0:
        raise ValueError("staging budget and slot count must be positive")
    names = names if names is not None else [f"#{i}" for i in range(len(tensors))]
    prepared = [_resolve(t) for t in tensors]
    sizes = [nbytes_of(t) for t in prepared]
    slot_bytes = max(budget // slots, 1)
    plans = plan_slots(sizes, slot_bytes)
    # Never allocate more than the data needs.
    slot_bytes = min(slot_bytes, max((p[-1].offset + p[-1].stop - p[-1].start for p in plans), default=1))
    stats = stats if stats is not None else StagingStats()
    stats.slot_bytes = slot_bytes
    multi = _core.MultiHasher(len(prepared))
    ring = [engine.alloc(slot_bytes) for _ in range(min(slots, len(plans)))]
    stats.slots = len(ring)
    stats.host_bytes = slot_bytes * len(ring)
    inflight: list[Future | None] = [None] * len(ring)
    # One hashing thread: slots are hashed in the order they were filled, so
    # every digest gets its chunks in order. The hashing itself is parallel.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-checker-hash") as hasher:
        try:
            engine.begin()
            for k, plan in enumerate(plans):
                s = k % len(ring)
                if inflight[s] is not None:
                    inflight[s].result()  # the slot is free again (or re-raise)
                    inflight[s] = None
                slot = ring[s]
                keep = []
                for p in plan:
                    try:
                        offset = p.offset
                        for src in engine.run(lambda p=p: list(byte_pieces(prepared[p.index], p.start, p.stop))):
                            n = src.numel()
                            own = prepared[p.index].untyped_storage().data_ptr()
                            if src.untyped_storage().data_ptr() != own:  # a device temporary
                                stats.max_temp_bytes = max(stats.max_temp_bytes, n)
                            engine.copy(slot[offset : offset + n], src)
                            stats.copies += 1
                            keep.append(src)
                            offset += n
                    except Exception as e:
                        raise type(e)(f"tensor '{names[p.index]}': staging copy failed: {e}") from e
                fence = engine.fence()
                feeds = [(p.index, slot[p.offset : p.offset + p.stop - p.start]) for p in plan]
                inflight[s] = hasher.submit(_hash_slot, engine, fence, multi, feeds, keep)
            for f in inflight:
                if f is not None:
                    f.result()
        except BaseException:
            # Let queued hashes finish or fail before the slots go away; the
            # first error is the one raised.
            for f in inflight:
                if f is not None:
                    f.cancel()
            raise
    return multi.finish()


def _hash_slot(engine: CopyEngine, fence: Any, multi: Any, feeds: list, keep: list) -> None:
    engine.wait(fence)
    keep.clear()  # device temporaries may be reused once their copies landed
    multi.update(feeds)


def _resolve(t: Any) -> Any:
    """The tensor whose memory holds the logical bytes (conjugate bits resolved)."""
    t = t.detach()
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
