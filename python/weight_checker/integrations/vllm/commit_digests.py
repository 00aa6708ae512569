"""Digests as each layer commits, hashed while the update goes on.

vLLM's weight-update lifecycle reloads layer by layer
(``vllm.model_executor.model_loader.reload.layerwise``): a layer's new
weights are buffered until all of them have arrived, then processed and
copied into the layer's kernel tensors (``_copy_and_restore_kernel_tensors``).
So once that copy returns, the layer's tensors hold what the update commits,
while the transfer goes on with the next layers, unless a later load writes
them again: a tensor of that layer sent again in the same start, or one vLLM
never moves to the meta device (a MoE gate's ``e_score_correction_bias``),
is loaded in place by its own weight loader, so the committed tensors get a
loader that counts those writes.

A :class:`CommitDigests` session, begun on a worker before an update sent
with ``"checksum": true``, hashes each layer's host tensors on a background
thread right after that copy (the Rust core releases the GIL), so that the
hashing overlaps the rest of the transfer. At the finish the worker walks its
model as for any checksum and takes an early digest only for the very
tensor object that was hashed, with the same layout, that nothing has
written since: torch's version counter of the tensor is unchanged (every
in-place op on it or a view of it, from any thread, bumps it), and no copy
was counted into its storage (vLLM writes through ``.data``, which torch
does not count; every copy its reload makes into a kernel tensor goes
through the wrapped function and every later load through the counting
loader, so a storage shared by two layers, written by the second after the
first was hashed, is seen); every other tensor (a layer
finished only at the finish, attention layers, device tensors, anything the
walk expands) is hashed then, as before. The digests are therefore the
same as a checksum taken after the finish, byte for byte; the early ones
only save time.

A session lives from the first flagged update after a start to that
start's finish; a start, a reload, a load or a reset of the weights ends it
(:func:`ends_session`), so digests are never carried from one update to
the next. Where the running vLLM has no layerwise reload (or names it
otherwise), and for engines that write the weights in place (no layerwise
commit), nothing is hashed early and the finish hashes everything. Device
tensors are hashed at the finish too: the overlap for them needs a GPU to
build and measure.
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from typing import Any

from weight_checker.integrations.vllm import logger

#: The session of the update in progress on this worker, if any.
_session: CommitDigests | None = None
_session_lock = threading.Lock()
_install_lock = threading.Lock()

LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
COPY = "_copy_and_restore_kernel_tensors"


def _storage_key(t: Any) -> int:
    return int(t.untyped_storage().data_ptr())


def _layout(t: Any) -> tuple[Any, ...]:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _version(t: Any) -> int | None:
    """torch's count of in-place writes into ``t`` (shared by its views and
    ``detach()`` aliases, bumped by every in-place op, ``copy_`` and indexed
    write through any of them); ``None`` where it keeps none (an inference
    tensor): such a tensor is hashed at the finish."""
    try:
        return int(t._version)
    except (AttributeError, RuntimeError):
        return None


def _storage_ref(t: Any) -> Any:
    """A weak reference to ``t``'s storage: expired once that memory is
    freed, so that a storage swapped out (``p.data = ...``) and a new one
    allocated at the same address never pass for the one hashed."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


#: (tensor, its alias, the storage's writes, layout, torch's version counter,
#: a weak reference to its storage), all taken when it is queued.
_Queued = tuple[Any, Any, int, tuple[Any, ...], int, Any]


class CommitDigests:
    """Early digests of one update on one worker (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Copies seen into each storage (by its address) during the session.
        self._writes: dict[int, int] = {}
        #: id(tensor) -> (a weak reference to it, digest, the storage's writes
        #: when it was queued, layout, torch's version counter then). Weak: a
        #: session never keeps a model alive.
        self._digests: dict[int, tuple[Any, str, int, tuple[Any, ...], int, Any]] = {}
        #: Batches of :data:`_Queued`, all taken when the batch is queued.
        self._queue: queue.SimpleQueue[list[_Queued] | None] = queue.SimpleQueue()
        #: Batches queued and not yet hashed (see :meth:`wait_hashed`).
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._accepting = True
        #: Set where a commit could not be followed: then no early digest is
        #: taken at all (a write may have gone uncounted).
        self.broken = False
        #: Bytes hashed in the background (some may be written again later).
        self.hashed_bytes = 0
        self.failed: str | None = None
        self._thread = threading.Thread(target=self._run, name="weight-checker-commit-digests", daemon=True)
        self._thread.start()

    def _count_write(self, t: Any) -> int | None:
        """Counts a write into ``t``'s storage (the lock held); the count, or
        ``None`` where it has no storage to write (meta, a subclass)."""
        try:
            key = _storage_key(t)
        except Exception:
            return None
        self._writes[key] = self._writes.get(key, 0) + 1
        return self._writes[key]

    def written(self, tensors: list[Any]) -> None:
        """Counts a write into each of ``tensors``' storages (a weight loader
        that wrote a committed tensor in place: see :func:`_count_loads`)."""
        with self._lock:
            for t in tensors:
                self._count_write(t)

    def committed(self, tensors: list[Any], followed: list[bool] | None = None) -> None:
        """Called on the worker's thread right after vLLM copied a layer's
        processed weights into ``tensors``: counts the write to each storage
        and, while the update is in progress, queues the hashing of those
        whose later loads are ``followed`` (their loader counts: see
        :func:`_count_loads`)."""
        with self._lock:
            host = []
            for t, seen in zip(tensors, followed or [True] * len(tensors), strict=True):
                mark = self._count_write(t)
                version = _version(t)
                if mark is not None and version is not None and seen and t.device.type == "cpu":
                    # The alias (``detach``) holds the storage: a ``.data``
                    # swap while it is hashed can neither free the bytes
                    # being read nor pass for the layout that was hashed.
                    # The version is read before the hash: a write during
                    # it, or any time before the finish, sends the tensor
                    # to be hashed again.
                    host.append((t, t.detach(), mark, _layout(t), version, _storage_ref(t)))
            if not (self._accepting and host):
                return
            self._pending += 1
            self._queue.put(host)

    def give_up(self) -> None:
        """A commit could not be followed: no early digest is taken."""
        with self._lock:
            self.broken = True

    def stop_queueing(self) -> None:
        """No more hashing is queued (the finish begins); writes are still counted."""
        with self._lock:
            if not self._accepting:
                return
            self._accepting = False
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._hash(item)
            finally:
                del item  # nothing of a batch is held while the next is awaited
                with self._lock:
                    self._pending -= 1
                    self._idle.notify_all()

    def wait_hashed(self, timeout: float | None = None) -> bool:
        """Waits until every batch queued so far is hashed (the session stays
        open); false on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _hash(self, item: list[_Queued]) -> None:
        from weight_checker import _core

        tensors = [alias for _, alias, _, _, _, _ in item]
        try:
            digests, _ = _core.digest_many(tensors, [f"tensor {i}" for i in range(len(tensors))])
        except Exception as e:  # those tensors are hashed at the finish
            self.failed = f"{type(e).__name__}: {e}"[:300]
            return
        with self._lock:
            for (t, _, mark, layout, version, storage), digest in zip(item, digests, strict=True):
                self._digests[id(t)] = (weakref.ref(t), digest, mark, layout, version, storage)
                self.hashed_bytes += t.numel() * t.element_size()

    def take(self, tensors: list[Any]) -> list[str | None]:
        """Waits for the queued hashing to end; then, for each tensor, its
        early digest where it is still valid (the same object and layout, no
        copy into its storage since it was queued and no in-place write torch
        counted: its version counter unchanged), else ``None``."""
        self._thread.join()
        out: list[str | None] = []
        with self._lock:
            if self.broken:
                return [None] * len(tensors)
            for t in tensors:
                entry = self._digests.get(id(t))
                valid = (
                    entry is not None
                    and entry[0]() is t
                    and entry[3] == _layout(t)
                    and self._writes.get(_storage_key(t)) == entry[2]
                    and _version(t) == entry[4]
                    and not entry[5].expired()  # the memory hashed is still the tensor's
                )
                out.append(entry[1] if valid and entry is not None else None)
        return out


def install() -> bool:
    """Wraps vLLM's layerwise copy into kernel tensors (once a process) so
    that a session sees every layer as it commits. False where this vLLM has
    no such function: then nothing is hashed early."""
    import importlib

    try:
        layerwise = importlib.import_module(LAYERWISE)
    except ImportError:
        return False
    with _install_lock:
        original = getattr(layerwise, COPY, None)
        if not callable(original):
            return False
        if getattr(original, "_weight_checker_wrapped", False):
            return True

        @functools.wraps(original)
        def copy_and_restore_kernel_tensors(layer: Any, info: Any, *args: Any, **kwargs: Any) -> Any:
            kernel = getattr(info, "kernel_tensors", None)
            result = original(layer, info, *args, **kwargs)
            session = _session
            if session is not None and kernel is not None:
                try:
                    parameters, buffers = kernel
                    tensors = [*parameters.values(), *buffers.values()]
                    # Once committed, a layer's own tensors are loaded in place
                    # by their original loaders (a tensor sent again, one vLLM
                    # never moves to meta): those writes are counted too, and
                    # a tensor whose loader cannot count is hashed at the finish.
                    session.committed(tensors, [_count_loads(t) for t in tensors])
                except Exception:  # the update must never fail because of us
                    # A write may have gone uncounted: no early digest at all.
                    session.give_up()
                    logger.exception("weight_checker: cannot follow a layer's commit; every digest comes at the finish")
            return result

        copy_and_restore_kernel_tensors._weight_checker_wrapped = True  # type: ignore[attr-defined]
        setattr(layerwise, COPY, copy_and_restore_kernel_tensors)
        return True


def _count_loads(tensor: Any) -> bool:
    """Gives ``tensor`` a weight loader that counts, in the session of the
    moment, a write into its storage (and into the ``param`` it is given),
    then calls the loader it had (vLLM's ``default_weight_loader`` where it
    had none: vLLM's models fall back to that one). Once per tensor; a no-op
    count outside a session. False where ``tensor`` cannot take it (its
    later loads would not be seen)."""
    loader = getattr(tensor, "weight_loader", None)
    if getattr(loader, "_weight_checker_counts", False):
        return True
    if loader is None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        loader = default_weight_loader
    target = weakref.ref(tensor)

    @functools.wraps(loader)
    def counted_loader(*args: Any, **kwargs: Any) -> Any:
        try:
            return loader(*args, **kwargs)
        finally:
            session = _session
            if session is not None:
                written = [t for t in (target(), kwargs.get("param", args[0] if args else None)) if t is not None]
                session.written([t for t in written if hasattr(t, "untyped_storage")])

    counted_loader._weight_checker_counts = True  # type: ignore[attr-defined]
    try:
        tensor.weight_loader = counted_loader
    except (AttributeError, TypeError):  # cannot take an attribute: its loads are not seen
        return False
    return getattr(tensor, "weight_loader", None) is counted_loader


def begin() -> bool:
    """Begins a session on this worker, or keeps the one begun by an
    earlier update of the same start (every start, reload, load and reset
    ends a session: :func:`ends_session`). False where nothing can be hashed
    early (see :func:`install`)."""
    global _session
    if not install():
        end()
        return False
    with _session_lock:
        if _session is None:
            _session = CommitDigests()
    return True


def ends_session(method: Any) -> Any:
    """``method`` (a worker method that starts an update, reloads, loads or
    resets weights) ending this worker's session first: early digests are
    only ever taken within one start and its finish, where every copy into
    the model's tensors goes through vLLM's layerwise commit."""
    if getattr(method, "_weight_checker_ends_session", False):
        return method

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        end()
        return method(*args, **kwargs)

    wrapper._weight_checker_ends_session = True  # type: ignore[attr-defined]
    return wrapper


def end() -> CommitDigests | None:
    """Ends this worker's session, if any, and returns it (no more hashing
    is queued; copies are no longer counted once it is dropped)."""
    global _session
    with _session_lock:
        session, _session = _session, None
    if session is not None:
        session.stop_queueing()
    return session


def current() -> CommitDigests | None:
    return _session
