"""Hash what vLLM's loader would copy, without copying it.

A rank's expected digests used to cost a copy of every weight into the rank's
parameters and then a hash of those parameters: at TP=1 the copy alone is
most of a second for 2 GB, against about a second to hash them. Yet nearly
every byte the loader writes is a plain ``param.narrow(...).copy_(weight
view)``: the parameter's bytes *are* the weight's bytes, in order.

:class:`DeferredWrites` runs vLLM's real loaders (every decision, every
narrow, every shard offset stays vLLM's) under a torch function mode that
records such a copy instead of doing it: the destination's byte range in the
arena and the source view. A parameter whose recorded pieces tile it exactly
is then hashed from the pieces themselves (a single piece, strided or not,
as one tensor; several contiguous pieces as one stream of a
``MultiHasher``), so the bytes are read once, by the hash.

Exactness comes first. Anything the mode cannot prove is a plain copy of
bytes that stay put is done for real, after replaying what is pending:

- a copy that casts, broadcasts, reads a temporary the loader made, or
  writes a strided destination: the parameter's pending pieces are replayed
  into the arena, then the copy runs, and later writes to it are real;
- any other operation that could read or write the arena (``torch.equal``
  in the re-tying of embeddings, an indexed assignment, a ``.cpu()``), or
  write a tensor the weights came from: every pending piece is replayed
  first and the rest of the load runs as it always did;
- after the load, a parameter not tiled exactly (a gap, an overlap) is
  replayed before it is hashed, as is every parameter that is not hashed by
  its own name (a part of a shared-weight parameter, say).

The sources must not change until the digests are made, as they must not
while the loader reads them.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from weight_checker.errors import ExpectedDigestsError

# Operations that hand out a tensor's memory to what torch does not see
# (numpy, a raw storage, a DLPack capsule): whatever they lead to may write
# it, unseen by the version counter.
ESCAPES = frozenset({"numpy", "untyped_storage", "storage", "_typed_storage", "__array__", "__dlpack__"})

# Operations that only describe a tensor or make a view of it: neither read
# nor write its elements. Properties (``.data``, ``.shape``, ...) come as ``__get__``.
_METADATA = frozenset(
    {
        "__get__", "narrow", "view", "__getitem__", "chunk", "split", "size", "dim", "stride", "numel",
        "is_contiguous", "data_ptr", "storage_offset", "element_size", "__len__", "detach",
        "as_strided", "t", "transpose", "permute", "unsqueeze", "squeeze", "expand", "unflatten",
        "get_device", "is_floating_point", "is_complex", "nelement",
    }
)  # fmt: skip


def op_name(func: Any) -> str:
    """What an operation is called: an operator overload's base name
    (``torch.ops.aten.fill_.Scalar`` is ``fill_``, in place like ``Tensor.fill_``)."""
    return str(getattr(func, "__name__", "")).split(".")[0]


def describes_only(name: str, args: Any) -> bool:
    """Whether an operation only describes or views its tensor: basic
    indexing does, advanced indexing (a tensor, list or array index) reads."""
    if name != "__getitem__":
        return name in _METADATA
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, int | slice) for p in parts)


class Piece:
    """One deferred write: ``nbytes`` at ``offset`` of the arena become the
    C-order bytes of ``source`` (``None``: zeros), the weight ``name`` gave."""

    __slots__ = ("dtype", "name", "nbytes", "offset", "shape", "source", "storage", "version")

    def __init__(self, offset: int, nbytes: int, shape: Any, dtype: Any, source: Any, name: str | None = None):
        self.offset, self.nbytes, self.shape, self.dtype, self.name = offset, nbytes, shape, dtype, name
        # An alias of its own: re-pointing the loader's tensor (``.data =``)
        # does not change what was read; an in-place write to the bytes bumps
        # the version, and freeing them (``untyped_storage().resize_(0)``, as
        # FSDP reshards) moves or shrinks the storage: both are checked before
        # the bytes are read again.
        self.source = None if source is None else source.view(source.shape)
        self.version = None if source is None else source._version
        self.storage = None if source is None else _extent(source)

    def check(self) -> None:
        """Raises, naming the weight, if its bytes may no longer be the ones the
        loader was given: written in place, or freed."""
        if self.source is None:
            return
        if _extent(self.source) != self.storage:
            raise ExpectedDigestsError(
                f"weight '{self.name}': its memory was freed or resized while expected_digests ran (an FSDP "
                "reshard?): give tensors that stay allocated until the call returns"
            )
        if self.source._version != self.version:
            raise ExpectedDigestsError(
                f"weight '{self.name}': it was written while expected_digests ran (a reused staging buffer?): "
                "give tensors that stay unchanged until the call returns"
            )


def _extent(t: Any) -> tuple[int, int] | None:
    """``t``'s storage: its address and size in bytes."""
    try:
        storage = t.untyped_storage()
        return int(storage.data_ptr()), int(storage.nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_address(t: Any) -> int | None:
    """The address of ``t``'s storage; ``None`` where it has none to give
    (a sparse or wrapper tensor): then it is treated as touching the arena."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _zero(value: Any) -> bool:
    """Whether ``fill_(value)`` writes all-zero bytes (``-0.0`` does not)."""
    if isinstance(value, bool | int):
        return value == 0
    return isinstance(value, float) and value == 0 and math.copysign(1.0, value) > 0


class DeferredWrites(TorchFunctionMode):
    """Records a load's plain copies into ``arena`` (a flat uint8 tensor)
    whose parameters are ``params`` (views of it), while ``with`` is active.
    :meth:`note_source` registers a tensor the weights gave (only such
    tensors are read later); :meth:`flush` replays everything pending."""

    def __init__(self, arena: Any, params: list[Any]):
        super().__init__()
        self._arena = arena
        self._base: int = arena.untyped_storage().data_ptr()
        spans: list[tuple[int, int]] = sorted((p.data_ptr() - self._base, p.nbytes) for p in params if p.nbytes)
        self._starts: list[int] = [s for s, _ in spans]
        self._ends: list[int] = [s + n for s, n in spans]
        #: parameter start offset -> pieces in the order written.
        self.pending: dict[int, list[Piece]] = {}
        self._real: set[int] = set()  # parameters written for real: no more deferring
        #: storage address of a stable weight -> its name.
        self._sources: dict[int, str] = {}
        self._passthrough = False
        self.replayed_bytes = 0
        #: Bytes left to :class:`PendingDigests`, hashed where the weights lie.
        self.in_place_bytes = 0

    def note_source(self, name: str, tensor: Any) -> None:
        """``tensor``, the weight ``name``, is stable (see
        :class:`~weight_checker.expected.weights.Pass`): a copy of it may be
        deferred. Not an inference tensor: torch keeps no version counter
        for those, so a write to one could not be told."""
        if hasattr(tensor, "untyped_storage") and tensor.device.type == "cpu" and not tensor.is_inference():
            storage = storage_address(tensor)
            if storage is not None:
                self._sources[storage] = name

    def _in_arena(self, t: Any) -> bool:
        return bool(t.device.type == "cpu" and storage_address(t) == self._base)

    def _param_of(self, offset: int, nbytes: int) -> int | None:
        """The start of the parameter holding ``[offset, offset + nbytes)``."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset + nbytes > self._ends[i]:
            return None
        return self._starts[i]

    def replay(self, start: int) -> None:
        """Writes the pending pieces of the parameter at ``start`` into the arena."""
        import torch

        for piece in self.pending.pop(start, []):
            piece.check()
            region = self._arena[piece.offset : piece.offset + piece.nbytes]
            if piece.source is None:
                region.zero_()
            else:
                with torch.no_grad():
                    region.view(piece.dtype).view(piece.shape).copy_(piece.source)
            self.replayed_bytes += piece.nbytes

    def release(self) -> None:
        """Drops the pending pieces and the weights noted: nothing here keeps the weights alive any longer."""
        self.pending.clear()
        self._sources.clear()

    def flush(self) -> None:
        """Replay every pending write; later writes in this load are real."""
        for start in list(self.pending):
            self.replay(start)
        self._passthrough = True

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self._passthrough:
            name = op_name(func)
            if name in ("copy_", "fill_", "zero_") and args and self._in_arena(args[0]):
                if self._defer(name, args, kwargs):
                    return args[0]
            elif not describes_only(name, args) and self._touches(name, args, kwargs):
                self.flush()
        return func(*args, **kwargs)

    def _touches(self, name: str, args: Any, kwargs: Any) -> bool:
        """Whether an operation could read or write the arena (any tensor
        argument, in a list too, or ``out=``), or write a tensor the weights
        came from: in place (``add_``, ``x[i] = y``, ``out=``, ``inplace=True``)
        or by handing its memory out (``numpy()``, ``untyped_storage()``...)."""
        import torch

        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        storages = [storage_address(t) if t.device.type == "cpu" else -1 for t in tensors]
        if any(s is None or s == self._base for s in storages):
            return True
        writes = (
            name.endswith("_")
            or name.startswith("__i")
            or name == "__setitem__"
            or "out" in kwargs
            or bool(kwargs.get("inplace"))
            or name in ESCAPES
        )
        return writes and any(s in self._sources for s in storages)

    def _defer(self, name: str, args: Any, kwargs: Any) -> bool:
        """Records the write to the arena ``args`` describe, or, where it is
        not a plain copy of bytes that stay put, prepares a real one."""
        import torch

        dst = args[0]
        if dst.numel() == 0:
            return False  # writes nothing (an embedding with no padding rows)
        offset = dst.data_ptr() - self._base
        # A destination of whole rows (a column slice of a matrix: a padded
        # row-parallel weight) is recorded row by row; it spans from its
        # first row's start to its last row's end.
        rows = [dst] if dst.is_contiguous() else _rows_of(dst)
        span = dst.nbytes if rows is None or len(rows) == 1 else rows[-1].data_ptr() + rows[-1].nbytes - dst.data_ptr()
        start = self._param_of(offset, span)
        if start is None:
            self.flush()  # a write across parameters: no longer ours to track
            return False
        others = [a for a in tree_leaves((args[1:], kwargs)) if isinstance(a, torch.Tensor)]
        if any(a.device.type == "cpu" and storage_address(a) in (None, self._base) for a in others):
            self.flush()  # reads the arena (a copy from another parameter): every byte in place first
            return False
        if start not in self._real and rows is not None:
            if name == "copy_":
                src = args[1] if len(args) > 1 else kwargs.get("src")
                if (
                    isinstance(src, torch.Tensor)
                    and src.device.type == "cpu"
                    and src.dtype == dst.dtype
                    and src.shape == dst.shape
                    and storage_address(src) in self._sources
                ):
                    name = self._sources[storage_address(src)]  # type: ignore[index]
                    pieces = self.pending.setdefault(start, [])
                    for i, row in enumerate(rows):
                        part = src if len(rows) == 1 else src[i]
                        pieces.append(Piece(row.data_ptr() - self._base, row.nbytes, row.shape, row.dtype, part, name))
                    return True
            else:
                value = args[1] if name == "fill_" and len(args) > 1 else kwargs.get("value", 0)
                if name == "zero_" or _zero(value):
                    pieces = self.pending.setdefault(start, [])
                    for row in rows:
                        pieces.append(Piece(row.data_ptr() - self._base, row.nbytes, row.shape, row.dtype, None))
                    return True
        self.replay(start)
        self._real.add(start)
        return False

    def tiled(self, start: int, nbytes: int) -> list[Piece] | None:
        """The pending pieces of the parameter at ``start``, in byte order,
        when they cover its ``nbytes`` exactly once; else ``None``."""
        pieces = sorted(self.pending.get(start, ()), key=lambda p: p.offset)
        at = start
        for piece in pieces:
            if piece.offset != at:
                return None
            at += piece.nbytes
        return pieces if pieces and at == start + nbytes else None

    def tiles(self, param: Any) -> bool:
        """Whether ``param``'s pending pieces cover it exactly once (all its bytes recorded, none written yet)."""
        return self._in_arena(param) and self.tiled(param.data_ptr() - self._base, param.nbytes) is not None

    def left_unwritten(self, param: Any) -> bool:
        """Whether this load left bytes of ``param`` unwritten, as far as the
        mode saw: no real write to it, and its recorded pieces (none, or with
        a gap) do not cover it (``False`` once writes pass through: unknown)."""
        if self._passthrough or not self._in_arena(param):
            return False
        start = param.data_ptr() - self._base
        if start in self._real:
            return False
        at = start
        for piece in sorted(self.pending.get(start, ()), key=lambda p: p.offset):
            if piece.offset > at:
                return True
            at = max(at, piece.offset + piece.nbytes)
        return bool(at < start + param.nbytes)

    def replay_param(self, param: Any) -> None:
        """Writes ``param``'s pending pieces into the arena (where it is one of its parameters)."""
        if self._in_arena(param):
            self.replay(param.data_ptr() - self._base)

    def checksum(self, model: Any, prefix: str, later: PendingDigests) -> dict[str, str]:
        """:func:`weight_checker.checksum` of ``model`` as it would be had
        every write been done. Parameters tiled by pieces are left to
        ``later`` (their bytes are the weights', which stay put; the arena
        is the next rank's); the rest are hashed now, from the arena."""
        from weight_checker.hashing.block_states import digests_marked
        from weight_checker.hashing.walk import collect

        names, tensors = collect(model)
        span = dict(zip(self._starts, self._ends, strict=True))
        whole: list[int | None] = [None] * len(tensors)
        for i, t in enumerate(tensors):
            if not self._in_arena(t):
                continue
            offset = t.data_ptr() - self._base
            if t.is_contiguous() and span.get(offset) == offset + t.nbytes:
                whole[i] = offset
            elif t.nbytes:
                self.flush()  # a part of a parameter is hashed: every byte must be in the arena
        deferred: dict[int, list[Piece]] = {}
        for start in {s for s in whole if s is not None and s in self.pending}:
            pieces = self.tiled(start, span[start] - start)
            if pieces is not None and all(p.source is None or rows_contiguous(p.source) for p in pieces):
                deferred[start] = pieces
            elif pieces is not None and len(pieces) == 1 and pieces[0].source is not None:
                deferred[start] = pieces  # one piece of any layout: hashed now, from where it lies
        for start in [s for s in self.pending if s not in deferred]:
            self.replay(start)  # hashed from the arena, so its bytes must be there
        now: list[int] = []
        sources: list[Any] = []
        for i, at in enumerate(whole):
            pieces = deferred.get(at) if at is not None else None
            if pieces is None:
                now.append(i)
                sources.append(tensors[i])
            elif len(pieces) == 1 and pieces[0].source is not None and not rows_contiguous(pieces[0].source):
                pieces[0].check()
                now.append(i)
                sources.append(pieces[0].source)
            else:
                later.add(prefix + names[i], pieces, like=tensors[i])
                self.in_place_bytes += sum(p.nbytes for p in pieces)
        hexes = digests_marked(
            [prefix + names[i] for i in now], [names[i] for i in now], sources, [tensors[i] for i in now]
        )
        # Nothing here keeps the weights alive any longer (a checkpoint's
        # mapping is released when the call ends, not at the next collection).
        self.release()
        return {prefix + names[i]: h for i, h in zip(now, hexes, strict=True)}


def _rows_of(t: Any) -> list[Any] | None:
    """The rows of a matrix view whose rows are each contiguous and apart
    (a column slice), in order; ``None`` for any other layout."""
    if t.dim() != 2 or t.stride(1) != 1 or t.stride(0) < t.shape[1]:
        return None
    return list(t.unbind(0))


def rows_contiguous(t: Any) -> bool:
    """Whether ``t``'s rows are contiguous (a ``MultiHasher`` reads them in place)."""
    return bool(t.is_contiguous() or (t.dim() >= 1 and t.stride(-1) == 1))


class PendingDigests:
    """Digests of parameters whose bytes are the weights' own, hashed
    together once every rank is loaded: one scheduler run for all ranks'
    parameters, as one for the whole checkpoint would be. A weight written
    in place through torch since it was recorded (its version counter moves:
    any in-place op on it or a view of it) is an error, never a wrong digest.
    Writes torch cannot see are the caller's to avoid, as for every digest
    of memory in use: through ``.data``, a raw pointer (a C++ optimizer
    step), a numpy view made before the call, or the checkpoint file under
    its mapping (docs/python-api.md, the caller's precondition)."""

    def __init__(self) -> None:
        self._keys: list[str] = []
        self._pieces: list[list[Piece]] = []
        self._markings: list[Any] = []
        self._done: dict[str, str] = {}
        #: Seconds spent hashing.
        self.seconds = 0.0

    def add(self, key: str, pieces: list[Piece], like: Any = None) -> None:
        """``key``'s bytes are ``pieces``, in order; ``like``: the parameter
        they make (its block states are recorded where that is asked:
        :mod:`weight_checker.hashing.block_states`)."""
        from weight_checker.hashing import block_states

        self._keys.append(key)
        self._pieces.append(pieces)
        self._markings.append(block_states.marks_for(key, like) if like is not None else None)

    def drop(self) -> None:
        """Forgets every piece not hashed yet (a call that failed): the weights are no longer held here."""
        self._keys, self._pieces, self._markings = [], [], []

    def finish(self) -> dict[str, str]:
        """``{key: hex}`` of everything added (by earlier calls too)."""
        started = time.perf_counter()
        self._done.update(self._hash())
        self.seconds += time.perf_counter() - started
        return self._done

    def _hash(self) -> dict[str, str]:
        import torch

        from weight_checker import _core
        from weight_checker.hashing import block_states

        if not self._keys:
            return {}
        captured = getattr(_CAPTURE, "pieces", None)
        if captured is not None:  # a layout (capturing_pieces): where the bytes come from, nothing read
            out = {}
            for key, pieces in zip(self._keys, self._pieces, strict=True):
                out[key] = f"{PLACEHOLDER}{len(captured)}"
                captured.append(pieces)
            self._keys, self._pieces, self._markings = [], [], []
            return out
        for pieces in self._pieces:
            for piece in pieces:
                piece.check()
        gap = max((p.nbytes for ps in self._pieces for p in ps if p.source is None), default=0)
        zeros = torch.zeros(gap, dtype=torch.uint8)
        multi = _core.MultiHasher(len(self._keys))
        for i, marking in enumerate(self._markings):
            block_states.mark(multi, i, marking)
        multi.update(
            [(i, zeros[: p.nbytes] if p.source is None else p.source) for i, ps in enumerate(self._pieces) for p in ps]
        )
        block_states.collect(multi, list(enumerate(self._markings)))
        hexes, _ = multi.finish()
        out = dict(zip(self._keys, hexes, strict=True))
        self._keys, self._pieces, self._markings = [], [], []
        return out


_CAPTURE = threading.local()
#: What :class:`PendingDigests` gives, under :func:`capturing_pieces`, in
#: place of a digest: this prefix and the index of the key's pieces.
PLACEHOLDER = "pieces:"


def capturing() -> bool:
    """Whether this thread is inside :func:`capturing_pieces` (a layout: the weights are no bytes)."""
    return getattr(_CAPTURE, "pieces", None) is not None


@contextlib.contextmanager
def capturing_pieces() -> Iterator[list[list[Piece]]]:
    """On this thread, inside: :class:`PendingDigests` hashes nothing; each
    key it was given reads ``pieces:<i>``, ``i`` its pieces' index in the
    list yielded (the layout of a load: :mod:`weight_checker.expected.vllm.layout`)."""
    previous = getattr(_CAPTURE, "pieces", None)
    captured: list[list[Piece]] = []
    _CAPTURE.pieces = captured
    try:
        yield captured
    finally:
        _CAPTURE.pieces = previous
