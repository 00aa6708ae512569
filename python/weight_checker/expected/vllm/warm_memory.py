"""Memory a quantized rank's build reuses from one call to the next.

A quantized rank's expected digests build the rank's model, materialize
each online-quantized layer's bf16 weight, copy the checkpoint into it and
cast it to FP8 into new tensors: about the rank's bytes in fresh
allocations, every call. Fresh memory pays a page fault and the kernel's
zeroing for every 4 KiB at first touch: a copy into it runs at about 2 GB/s
on the machines here, into memory already touched at 10-15 GB/s. That was
most of the load's time (issue 55).

:func:`serving` puts a torch function mode on the calling thread that serves
the large CPU allocations of vLLM's code (``torch.empty``,
``empty_strided``, ``empty_like``: its parameters, the weights it
materializes) from :data:`POOL`, buffers kept between calls; the FP8 cast
takes its outputs from there too (:func:`empty`). A buffer goes back to the
pool only when torch has freed every tensor over it (a finalizer on the
array torch's storage holds), so a buffer in use is never handed out twice.

A reused buffer is only warm where its pages were written: a weight whose
copies stay deferred (:mod:`.deferred_rows`) never touches its buffer. The
bytes an array is served are made resident in one call to the kernel
(``MADV_POPULATE_WRITE``) before anything writes all of them (the FP8 cast,
the zeroing, a deferred copy written for real), once in the buffer's life;
such writers are served a buffer already resident that far first, the rest
the least resident one: so a call's outputs are never written through page
faults, and a weight that is never written takes no resident memory.
(Measured on an Intel Xeon fam 6 model 207, TP=2 FP8 of a 1 GB model:
14,000-35,000 faults a call before, each first write to a page about 1.3
us; about 170 after.)

What a reused buffer held is never seen: it reads as zeros, as fresh
memory does (torch gives no guarantee either way, and a padding byte the
loader never writes must read as it would have). It is zeroed before it is
handed out, or, under :func:`zeroing_by`, by whoever took that on before
anything reads it (:mod:`.deferred_rows`: only where no copy covers it).
:func:`empty` skips that for a caller that writes every byte itself (the
FP8 cast; the amax-only pass of a TP reduction leaves it unwritten, as
``torch.empty`` would, in a model dropped unread).

Anything the mode does not recognise as a plain contiguous CPU allocation
with its dtype given (a device left to the default, a layout, pinned
memory, ``out=``, strides that are not C order) goes to torch unchanged.
At the end of a call, buffers that call did not use are freed
(:meth:`WarmPool.trim`); :func:`weight_checker.expected.release_buffers`
frees all of them.
"""

from __future__ import annotations

import collections
import contextlib
import math
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

#: Allocations smaller than this are left to torch (their faults cost little).
MIN_BYTES = 1 << 20
#: Buffers are whole 2 MiB units (so that sizes close to one another share buffers).
UNIT = 2 << 20
#: The start of every tensor served is aligned to this (as torch's allocator).
ALIGN = 64


#: ``madvise``'s MADV_POPULATE_WRITE (Linux 5.14; not named by Python's mmap module).
_POPULATE_WRITE = 23
#: Page size: the step of the fallback that writes a byte of each page.
_PAGE = mmap.PAGESIZE


class _Buffer:
    __slots__ = ("array", "mapping", "resident", "size", "used")

    def __init__(self, size: int):
        # An anonymous private mapping of its own: zeros, as fresh memory
        # reads (``mmap``'s default is a shared one, accounted as shmem).
        try:
            self.mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as e:  # as torch's allocator fails: out of memory, said in one line
            raise MemoryError(
                f"the expected digests' memory pool could not map {size:,} bytes ({e.strerror or e})"
            ) from e
        self.array = np.frombuffer(self.mapping, dtype=np.uint8)
        self.size = size
        self.used = False
        #: Bytes from the start whose pages were all written at least once
        #: (:meth:`make_resident`; an array is always served from the start).
        self.resident = 0

    def make_resident(self, nbytes: int) -> None:
        """The pages of the first ``nbytes`` faulted in now, their bytes
        unchanged: one call to the kernel, where a first write to each page
        would trap. The rest of the buffer is left as it is."""
        if nbytes <= self.resident:
            return
        start = self.resident
        end = min(self.size, -(-nbytes // _PAGE) * _PAGE)
        try:
            self.mapping.madvise(_POPULATE_WRITE, start, end - start)
        except (OSError, ValueError):  # an older kernel: a byte of each page written back as it is
            pages = self.array[start:end:_PAGE]
            np.bitwise_or(pages, 0, out=pages)
        self.resident = end


class WarmPool:
    """Buffers served to one call at a time (the callers hold
    ``rank_model.LOCK``); finalizers return them from any thread."""

    def __init__(self) -> None:
        self._free: list[_Buffer] = []
        self._lock = threading.Lock()
        # Buffers freed since the last locked call. A finalizer never takes
        # the lock: a garbage collection that runs while it is held (an
        # allocation inside a locked section) runs finalizers on this thread.
        self._returned: collections.deque[_Buffer] = collections.deque()
        #: address of each served array alive -> the serial number it was served under, the array, its buffer.
        self._live: dict[int, tuple[int, weakref.ref[np.ndarray], _Buffer]] = {}
        self._serial = 0
        #: Bytes handed out from reused buffers / from new ones (tests/test_warm_memory.py reads them).
        self.reused_bytes = 0
        self.fresh_bytes = 0

    def take(self, nbytes: int, zeroed: bool, written: bool = True) -> np.ndarray:
        """``nbytes`` of a buffer, 64-byte aligned, as a uint8 array; zeros if
        ``zeroed``. The buffer returns to the pool when the array is freed.
        ``zeroed=False``: the caller writes every byte (:func:`empty`), unless
        not ``written`` (then nothing is made resident for it)."""
        need = nbytes + ALIGN
        lazily = getattr(_LOCAL, "zero_later", None)
        # Whoever writes it all is served a buffer resident that far first; an
        # allocation a deferred copy may never write, the least resident one.
        writes = (not zeroed and written) or (zeroed and lazily is None)

        def preferred(b: _Buffer) -> tuple[int, int]:
            return (b.size, b.resident < nbytes if writes else b.resident)

        with self._lock:
            self._drain()
            fits = [b for b in self._free if need <= b.size <= max(2 * need, need + 4 * UNIT)]
            buffer = min(fits, key=preferred) if fits else None
            if buffer is not None:
                self._free.remove(buffer)
        reused = buffer is not None
        if buffer is None:
            buffer = _Buffer(-(-need // UNIT) * UNIT)
        buffer.used = True
        start = (-buffer.array.ctypes.data) % ALIGN
        view = buffer.array[start : start + nbytes]
        address = view.ctypes.data
        with self._lock:
            self._serial += 1
            serial = self._serial
            self._live[address] = (serial, weakref.ref(view), buffer)
        weakref.finalize(view, self._give_back, buffer, address)
        if not zeroed and written:
            buffer.make_resident(start + nbytes)  # the caller writes it all next
        if reused:
            self.reused_bytes += nbytes
            # Zeroed now, unless whoever took that on for this pool does it before it is read.
            if zeroed and (lazily is None or not lazily(self, address, serial, nbytes)):
                buffer.make_resident(start + nbytes)
                torch.from_numpy(view).zero_()
        else:
            self.fresh_bytes += nbytes
        return view

    def make_resident(self, address: int, serial: int, nbytes: int) -> None:
        """The first ``nbytes`` of the array served at ``address`` under
        ``serial`` made resident (:meth:`_Buffer.make_resident`): its caller
        is about to write them (a deferred copy written for real)."""
        with self._lock:
            entry = self._live.get(address)
        if entry is not None and entry[0] == serial:
            buffer = entry[2]
            buffer.make_resident(address - buffer.array.ctypes.data + nbytes)

    def serial(self, address: int) -> int | None:
        """The serial number of the served array alive at ``address``
        (``None``: none is): what tells one allocation there from a later one."""
        with self._lock:
            entry = self._live.get(address)
        return None if entry is None else entry[0]

    def array(self, address: int, serial: int) -> np.ndarray | None:
        """The array served at ``address`` under ``serial``, held (so alive)
        by the caller, or ``None`` if it was freed since."""
        with self._lock:
            entry = self._live.get(address)
        array = entry[1]() if entry is not None and entry[0] == serial else None
        return array

    def live_bytes(self) -> int:
        """Bytes of the arrays served and not freed yet."""
        with self._lock:
            views = [entry[1]() for entry in self._live.values()]
        return sum(v.nbytes for v in views if v is not None)

    def _give_back(self, buffer: _Buffer, address: int) -> None:
        # No lock (see __init__). The address is no longer live before the
        # buffer can be served again: it is served only once drained.
        self._live.pop(address, None)
        self._returned.append(buffer)

    def _drain(self) -> None:
        """The buffers freed since, onto the free list (the lock held)."""
        while self._returned:
            self._free.append(self._returned.popleft())

    def trim(self) -> None:
        """Frees the buffers the call now ending did not use; the rest wait for the next."""
        with self._lock:
            self._drain()
            self._free = [b for b in self._free if b.used]
            for b in self._free:
                b.used = False

    @contextlib.contextmanager
    def trimming(self) -> Iterator[None]:
        """One call: on the way out, however it ends, :meth:`trim`."""
        try:
            yield
        finally:
            self.trim()

    def clear(self) -> None:
        with self._lock:
            self._drain()
            self._free = []

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            self._drain()
            return sum(b.size for b in self._free)


@contextlib.contextmanager
def young_garbage() -> Iterator[None]:
    """One call's garbage kept young: the cyclic collector is paused inside
    and, on the way out, collects its two young generations only.

    A call builds a model a rank, and a model's modules sit in cycles
    (:func:`.quantized.drop_tensors`). With the collector running, they
    outlive a young collection or two and are promoted, and every few calls
    the promoted objects trigger a full collection of the process: with vLLM
    imported, 0.35 s (measured on an Intel Xeon fam 6 model 207), more than
    the hash of a 1 GB model. Paused, the call's cycles are still young when
    it ends and a young collection frees them. The collector's state on the
    way in is restored: a caller that paused it keeps it paused. (The switch
    is the process's: another thread that pauses it meanwhile finds it
    running again once the call ends.)"""
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            gc.collect(1)


def spare_bytes() -> int:
    """Bytes a call may hold at once (the ranks of a one-pass TP reduction:
    :mod:`.quantized`): half of what this process may still take, the least of the memory the kernel says is
    available (``MemAvailable``, else the free pages) and its cgroup's
    headroom (a container's limit: the host's memory is not the pod's)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            available = 0
    headroom = _cgroup_headroom()
    return (available if headroom is None else min(available, headroom)) // 2


def _cgroup_headroom() -> int | None:
    """This process's cgroup memory limit less its usage (v2, else v1);
    ``None`` where no limit is set or none can be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":  # v2
            pair = ("memory.max", "memory.current")
            root = "/sys/fs/cgroup"
        elif "memory" in controllers.split(","):  # v1
            pair = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            root = "/sys/fs/cgroup/memory"
        else:
            continue
        for where in (f"{root}{path}", root):  # the process's own, or the namespace's root
            try:
                with open(f"{where}/{pair[0]}") as f:
                    limit = f.read().strip()
                with open(f"{where}/{pair[1]}") as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
                return None
            return max(0, int(limit) - usage)
    return None


#: The process's pool (one call at a time: ``rank_model.LOCK``).
POOL = WarmPool()
_LOCAL = threading.local()


@contextlib.contextmanager
def zeroing_by(take_on: Any) -> Iterator[None]:
    """On this thread, inside: a reused buffer that must read as zeros is
    not zeroed when served if ``take_on(pool, address, serial, nbytes)``
    returns true: it must then see that it is before anything reads it
    (:class:`.deferred_rows.DeferredCopies` writes zeros only where its
    pieces do not, if at all)."""
    previous = getattr(_LOCAL, "zero_later", None)
    _LOCAL.zero_later = take_on
    try:
        yield
    finally:
        _LOCAL.zero_later = previous


def empty(shape: tuple[int, ...], dtype: torch.dtype, written: bool = True) -> torch.Tensor:
    """A contiguous CPU tensor the caller writes in full: from the pool
    (not zeroed) while :func:`serving` is active on this thread, else torch's.
    ``written=False``: a tensor never written (nor read), as ``torch.empty``'s."""
    pool = getattr(_LOCAL, "pool", None)
    nbytes = math.prod(shape) * dtype.itemsize
    if pool is None or nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    return _tensor(pool.take(nbytes, zeroed=False, written=written), shape, dtype)


def _tensor(view: np.ndarray, shape: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(view).view(dtype).view(tuple(shape))


@contextlib.contextmanager
def serving(pool: WarmPool | None = None, mode: bool = True) -> Iterator[None]:
    """On this thread, inside: large plain CPU allocations come from ``pool``
    (:data:`POOL`). ``mode=False``: only :func:`empty` does; the caller's own
    function mode serves the rest (:func:`served`: one Python call per torch
    operation instead of two)."""
    pool = POOL if pool is None else pool
    previous = getattr(_LOCAL, "pool", None)
    _LOCAL.pool = pool
    try:
        with _Allocations(pool) if mode else contextlib.nullcontext():
            yield
    finally:
        _LOCAL.pool = previous


def served(func: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``func(*args, **kwargs)`` served from the pool of :func:`serving`, if
    it is a large plain contiguous CPU allocation (else ``None``: torch's)."""
    pool: WarmPool | None = getattr(_LOCAL, "pool", None)
    wanted = _recognised(func, tuple(args), kwargs) if pool is not None else None
    if pool is None or wanted is None:
        return None
    shape, dtype = wanted
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES:
        return None
    return _tensor(pool.take(nbytes, zeroed=True), shape, dtype)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _size(args: tuple[Any, ...]) -> tuple[int, ...] | None:
    """``torch.empty``'s size, given as ints or one sequence of them."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in args):
        return tuple(args)
    return None


def _plain(kwargs: dict[str, Any], allowed: frozenset[str]) -> bool:
    """Only arguments that leave a plain, CPU, strided, unpinned tensor with no grad."""
    if set(kwargs) - allowed:
        return False
    device = kwargs.get("device")
    return (
        device is not None
        and torch.device(device).type == "cpu"
        and kwargs.get("layout", torch.strided) in (None, torch.strided)
        and not kwargs.get("requires_grad", False)
        and not kwargs.get("pin_memory", False)
        and kwargs.get("memory_format", torch.contiguous_format) in (None, torch.contiguous_format)
    )


_EMPTY = frozenset({"dtype", "device", "layout", "requires_grad", "pin_memory", "memory_format"})
_STRIDED = frozenset({"dtype", "device", "layout", "requires_grad", "pin_memory"})


class _Allocations(TorchFunctionMode):
    """Serves this thread's large plain allocations from the pool of :func:`serving`."""

    def __init__(self, pool: WarmPool):
        super().__init__()
        self._pool = pool

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensor = served(func, args, kwargs)
        return func(*args, **kwargs) if tensor is None else tensor


def _recognised(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], Any] | None:
    """The shape and dtype of a plain contiguous CPU allocation with its dtype given, else ``None``."""
    if func is torch.empty:
        shape, given = _size(args), kwargs
        ok = _plain(given, _EMPTY)
    elif func is torch.empty_strided:
        size = kwargs.get("size", args[0] if args else None)
        stride = kwargs.get("stride", args[1] if len(args) > 1 else None)
        given = {k: v for k, v in kwargs.items() if k not in ("size", "stride")}
        shape = _size((size,)) if size is not None and len(args) <= 2 else None
        ok = shape is not None and stride is not None and tuple(stride) == _contiguous_strides(shape)
        ok = ok and _plain(given, _STRIDED)
    elif func is torch.empty_like:
        source = kwargs.get("input", args[0] if args else None)
        if not isinstance(source, torch.Tensor) or len(args) > 1 or not source.is_contiguous():
            return None
        given = {k: v for k, v in kwargs.items() if k not in ("input", "memory_format")}
        given.setdefault("dtype", source.dtype)
        given.setdefault("device", source.device)
        shape = tuple(source.shape)
        layout_kept = kwargs.get("memory_format", torch.preserve_format) in (
            torch.preserve_format,
            torch.contiguous_format,
        )
        ok = layout_kept and source.layout == torch.strided and _plain(given, _STRIDED)
    else:
        return None
    dtype = given.get("dtype")
    if not ok or shape is None or not isinstance(dtype, torch.dtype):
        return None
    return shape, dtype
