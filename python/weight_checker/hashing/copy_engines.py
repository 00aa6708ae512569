"""Copy engines: what moves a device tensor's bytes into a host slot, for
the staging pipeline (:mod:`weight_checker.staging`).

``CopyEngine`` is the protocol; ``CudaCopyEngine`` copies on a side CUDA
stream with one event per slot; ``HostCopyEngine`` copies from host tensors
on one low-priority thread, as a DMA engine would (the pipeline's test engine
and CPU proxy). ``alloc_host`` allocates the slots, pinned when it can.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from weight_checker import _core
from weight_checker.hashing.tensor_bytes import gather_bytes

logger = logging.getLogger("weight_checker.staging")

#: CPU priority of the host copy engine's copier thread: below the hashing
#: threads, so it mostly runs in their gaps (measured on a 2-vCPU AMD EPYC:
#: nice 5-10 best, 0 and 19 a few percent slower; a default, not a per-CPU rule).
COPIER_NICE = 10


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
        self.cuda_stream = torch.cuda.Stream(device=self.device)

    def alloc(self, nbytes: int) -> Any:
        return alloc_host(nbytes, pin=True)

    def begin(self) -> None:
        # The weights may still be being written by the caller's CUDA stream (a
        # weight update in flight): copy only after that work.
        self.cuda_stream.wait_stream(self.torch.cuda.current_stream(self.device))

    def run(self, fn: Callable[[], Any]) -> Any:
        # Temporaries are allocated on the side CUDA stream, so the
        # caching allocator reuses them only after its copies.
        with self.torch.cuda.stream(self.cuda_stream):
            return fn()

    def copy(self, dst: Any, src: Any) -> None:
        with self.torch.cuda.stream(self.cuda_stream):
            dst.copy_(src, non_blocking=True)

    def fence(self) -> Any:
        event = self.torch.cuda.Event()
        event.record(self.cuda_stream)
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
