"""Online FP8 from the weights' bytes where they lie: no bf16 copy.

An online ``fp8_per_channel`` rank's load copies every linear layer's
checkpoint tensors into a bf16 weight vLLM materializes for it, then its
processing reads that weight twice (the amax of each row, then the cast)
and drops it. The copy is a third of the rank's work, and nothing but the
two reads ever sees it.

:class:`DeferredCopies` runs vLLM's loaders and processing unchanged under a
torch function mode that records such a copy instead of doing it: a plain
``copy_`` of a stable weight (:meth:`note_source`) of the same dtype and
shape into a contiguous part of memory :mod:`.warm_memory` served (so its
lifetime is known). :func:`pieces_of` then gives the FP8 arithmetic
(:mod:`.fp8_kernels`) a weight's rows as the pieces of the weights they
are, when the recorded pieces tile it exactly by whole rows; the core reads
them where they lie (``_core.fp8_row_abs_max_piece``,
``fp8_quantize_piece``).

Exactness comes first, as in :mod:`.deferred`: any other operation that
touches a memory with pending pieces (a read, a write, a copy that casts)
has those pieces written for real first, and memory handed out (a numpy
view, a raw pointer, a storage) is written for real from then on; an
operation that could write a weight the pieces came from has every pending
piece written first, and deferring stops; when the mode ends, every piece
still pending is written. A weight written in place through torch, or
freed, after it was recorded (checked again after the core has read it) is
an error naming it (``Piece.check``), never a wrong digest. A write torch
cannot see (a raw pointer, another thread's numpy view) is the caller's to
avoid, as for every digest of memory in use (:class:`.deferred.PendingDigests`).

One exception to "written when the mode ends": a weight's pieces handed on
(:func:`hand_on`, a layer held back at TP > 1) stay unwritten until a later
mode that adopts them (``DeferredCopies(adopt=...)``) ends; nothing may read
that memory in between (the caller keeps the layer unread until then).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from weight_checker.expected.vllm import warm_memory
from weight_checker.expected.vllm.deferred import ESCAPES, Piece, describes_only, op_name, storage_address
from weight_checker.expected.vllm.warm_memory import WarmPool
from weight_checker.hashing import idle

_LOCAL = threading.local()
#: Bytes of weights read where they lie, and written for real after all, by
#: every :class:`DeferredCopies` of the process (tests/test_warm_memory.py reads them).
TOTALS = {"in_place": 0, "replayed": 0}


@dataclass(frozen=True)
class RowPiece:
    """Rows ``first..first + rows`` of a weight, read from ``source`` (a flat
    numpy view of 2-byte items): row ``n`` is ``source[n * stride:][:cols]``.
    ``recorded``: the copy it stands for (:meth:`check` after reading: the
    weight was not written meanwhile, as far as torch can tell)."""

    first: int
    rows: int
    source: Any
    stride: int
    recorded: Piece

    def check(self) -> None:
        # Quietly: the check asks for the weight's storage, which the mode
        # would otherwise take for its memory handed out (and stop deferring).
        mode = getattr(_LOCAL, "mode", None)
        quiet = mode is not None and mode._quiet
        if mode is not None:
            mode._quiet = True
        try:
            self.recorded.check()
        finally:
            if mode is not None:
                mode._quiet = quiet


class DeferredCopies(TorchFunctionMode):
    """The recording mode (see the module docstring); one rank's load and
    processing, on the thread that enters it."""

    def __init__(
        self,
        pool: WarmPool | None = None,
        discard: bool = False,
        serves: bool = False,
        adopt: list[Handed] | None = None,
    ):
        """``discard``: the model is dropped unread when the mode ends (a TP
        reduction's amax pass), so what is still pending then is not written.
        ``serves``: it also serves allocations, as ``warm_memory.serving``'s
        mode would (entered with ``mode=False``): one mode on the thread, not two.
        ``adopt``: pieces an earlier mode handed on (:func:`hand_on`), pending
        here as if recorded here."""
        super().__init__()
        self._discard = discard
        self._serves = serves
        self._pool = warm_memory.POOL if pool is None else pool
        #: storage address -> (the pool's serial of that allocation, pieces in the order written).
        self.pending: dict[int, tuple[int, list[Piece]]] = {}
        self._real: set[tuple[int, int]] = set()
        self._sources: dict[int, str] = {}
        self._stopped = False
        self._quiet = False
        #: Bytes written for real after all, and bytes read where they lie.
        self.replayed_bytes = 0
        self.in_place_bytes = 0
        #: storage address -> the list its pending pieces are handed to when the mode
        #: ends, and the serial of the allocation they were pending in then.
        self._hand_on: dict[int, tuple[list[Handed], int]] = {}
        for handed in adopt or ():
            self.pending[handed.address] = (handed.serial, handed.pieces)
            self._sources.update(handed.sources)

    def __enter__(self) -> DeferredCopies:
        super().__enter__()
        self._previous = getattr(_LOCAL, "mode", None)
        _LOCAL.mode = self
        self._zeroing = warm_memory.zeroing_by(self._zero_later)
        self._zeroing.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._zeroing.__exit__(*exc)
            if exc[0] is None and not self._discard:
                for address, (into, serial) in self._hand_on.items():
                    self._hand(address, serial, into)
                self.flush()
        finally:
            _LOCAL.mode = self._previous
            self.pending.clear()
            self._sources.clear()
            super().__exit__(*exc)

    def _zero_later(self, pool: WarmPool, address: int, serial: int, nbytes: int) -> bool:
        """A reused allocation of this mode's pool that must read as zeros: a
        zero piece under everything written later, written only if something
        reads it before the pieces over it are (:func:`pieces_of` skips it
        where they cover the weight). Another pool's is zeroed when served."""
        if pool is not self._pool:
            return False
        self.pending[address] = (serial, [Piece(0, nbytes, (nbytes,), torch.uint8, None)])
        return True

    def note_source(self, name: str, tensor: Any) -> None:
        """``tensor``, the weight ``name``, is stable: a copy of it may be deferred."""
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and not tensor.is_inference():
            storage = storage_address(tensor)
            if storage is not None:
                self._sources[storage] = name

    # --- what is pending ----------------------------------------------------------------------------

    def _alive(self, address: int) -> list[Piece] | None:
        """The pieces pending at ``address``, while the allocation they were
        recorded for is alive (a freed one's are dropped)."""
        entry = self.pending.get(address)
        if entry is None:
            return None
        if self._pool.serial(address) != entry[0]:
            del self.pending[address]
            return None
        return entry[1]

    def replay(self, address: int) -> None:
        """Writes the pieces pending at ``address`` for real. A piece whose
        weight changed since (``Piece.check``) raises, and the pieces not
        yet written stay pending: every later touch raises again."""
        entry = self.pending.get(address)
        if entry is None:
            return
        serial, pieces = entry
        memory = self._pool.array(address, serial)  # held while written: it cannot be freed meanwhile
        if memory is None:
            del self.pending[address]
            return  # freed: nothing reads it any more
        if pieces and pieces[0].source is None and _tiles(pieces[1:], 0, memory.nbytes):
            del pieces[0]  # the zeros under the whole allocation: every byte is written over them
        idle.invalidate(address)  # written now: a digest hashed of it before is not taken
        self._pool.make_resident(address, serial, memory.nbytes)  # faulted in at once, not a page at a time
        quiet, self._quiet = self._quiet, True
        try:
            whole = torch.from_numpy(memory)
            while pieces:
                piece = pieces[0]
                piece.check()
                region = whole[piece.offset : piece.offset + piece.nbytes].view(piece.dtype).view(piece.shape)
                with torch.no_grad():
                    region.zero_() if piece.source is None else region.copy_(piece.source)
                pieces.pop(0)
                self.replayed_bytes += piece.nbytes
                TOTALS["replayed"] += piece.nbytes
            del self.pending[address]
        finally:
            self._quiet = quiet

    def _make_real(self, address: int) -> None:
        """The allocation at ``address`` written for real, now and from now on
        (its memory was handed out where later writes would not be seen)."""
        serial = self._pool.serial(address)
        idle.invalidate(address)  # handed out: it may be written where no version counts
        if serial is not None:
            self.replay(address)
            self._real.add((address, serial))

    def _hand(self, address: int, serial: int, into: list[Handed]) -> None:
        """The pieces pending at ``address`` moved to ``into``, if its
        allocation is the one served under ``serial`` (alive, not a later one)."""
        pieces = self._alive(address)
        if not pieces or self.pending[address][0] != serial:
            return
        sources = {}
        quiet, self._quiet = self._quiet, True  # asking for a weight's storage hands nothing out
        try:
            for piece in pieces:
                storage = storage_address(piece.source) if piece.source is not None else None
                if storage is not None:
                    sources[storage] = self._sources.get(storage, piece.name or "")
        finally:
            self._quiet = quiet
        into.append(Handed(address, self.pending.pop(address)[0], pieces, sources))

    def flush(self) -> None:
        """Every pending piece written; nothing more is deferred."""
        for address in list(self.pending):
            self.replay(address)
        self._stopped = True

    # --- the mode ------------------------------------------------------------------------------------

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._serves:
            tensor = warm_memory.served(func, args, kwargs)
            if tensor is not None:
                return tensor
        if not self._quiet:
            name = op_name(func)
            if name == "copy_" and not self._stopped and self._defer(args, kwargs):
                return args[0]
            if name == "data_ptr" or name in ESCAPES:
                self._escape(args)
            if not describes_only(name, args):
                self._touch(name, args, kwargs)
        return func(*args, **kwargs)

    def _escape(self, args: Any) -> None:
        """A raw pointer, a numpy array or a storage of served memory handed
        out: what is written through it is not seen, so its allocation is
        written for real from here on."""
        for t in _tensors(args[:1]):
            address = storage_address(t) if t.device.type == "cpu" else None
            if address is not None:
                self._make_real(address)

    def _touch(self, name: str, args: Any, kwargs: Any) -> None:
        """Pending pieces of any memory the operation reads or writes are
        written first; an operation that may write a weight they came from
        (in place, through ``out=``, or by handing its memory out) writes
        them all, and deferring stops."""
        if not (self.pending or self._sources):
            return
        tensors = [t for t in _tensors((args, kwargs)) if t.device.type == "cpu"]
        if not tensors:
            return
        storages = [storage_address(t) for t in tensors]
        if None in storages:
            self.flush()
            return
        in_place = name.endswith("_") or name.startswith("__i") or name == "__setitem__" or name in ESCAPES
        written = list(_tensors(args[0])) if (in_place or kwargs.get("inplace")) and args else []
        written += _tensors(kwargs.get("out"))
        if any(storage_address(t) in self._sources for t in written):
            self.flush()
            return
        for s in storages:
            if s in self.pending:
                self.replay(s)  # type: ignore[arg-type]

    def _defer(self, args: Any, kwargs: Any) -> bool:
        """Records ``dst.copy_(src)`` when it is a plain copy of a stable
        weight into served memory; else ``False`` (the copy runs for real,
        after whatever it touches is written)."""
        if not args or not isinstance(args[0], torch.Tensor) or set(kwargs) - {"non_blocking"}:
            return False
        dst = args[0]
        src = args[1] if len(args) > 1 else None
        if len(args) != 2 or not isinstance(src, torch.Tensor) or dst.device.type != "cpu" or dst.numel() == 0:
            return False
        address = storage_address(dst)
        if address is None or not dst.is_contiguous():
            return False
        serial = self._pool.serial(address)
        if serial is None or (address, serial) in self._real:
            return False
        source_storage = storage_address(src)
        if address in self._sources:  # a weight the pieces may come from is written: all written first
            self.flush()
            return False
        if (
            src.device.type != "cpu"
            or src.dtype != dst.dtype
            or src.shape != dst.shape
            or src.is_neg()
            or src.is_conj()
            or source_storage not in self._sources
            or source_storage in self.pending
        ):
            if self._alive(address) is not None:
                self.replay(address)
                self._real.add((address, serial))  # written for real from here on
            return False
        pieces = self._alive(address)
        if pieces is None:
            pieces = []
            self.pending[address] = (serial, pieces)
        idle.invalidate(address)  # its bytes change: a digest hashed of it before is not taken
        offset = dst.data_ptr() - address
        pieces.append(Piece(offset, dst.nbytes, dst.shape, dst.dtype, src, self._sources[source_storage]))
        return True


@dataclass(frozen=True)
class Handed:
    """Pieces pending at ``address`` (the allocation served under ``serial``)
    handed from one mode to a later one, with the weights they come from
    (storage address -> name)."""

    address: int
    serial: int
    pieces: list[Piece]
    sources: dict[int, str]


def hand_on(tensor: torch.Tensor, into: list[Handed]) -> None:
    """The pieces pending under ``tensor``'s memory, if any, are not written
    when this thread's mode ends (without an error): they are appended to
    ``into``, for a later mode to adopt (``DeferredCopies(adopt=...)``). A
    touch meanwhile writes them as usual (then nothing is handed on)."""
    mode = getattr(_LOCAL, "mode", None)
    if mode is None or mode._discard:
        return
    quiet, mode._quiet = mode._quiet, True  # asking for the storage hands nothing out
    try:
        address = storage_address(tensor)
    finally:
        mode._quiet = quiet
    entry = mode.pending.get(address) if address is not None else None
    if entry is not None:
        mode._hand_on[address] = (into, entry[0])


def pending_pieces(tensor: torch.Tensor) -> tuple[Piece, ...]:
    """The copies still pending under ``tensor``'s memory, in the order
    recorded (empty: none; its bytes are in memory). Whatever is computed
    from them holds while the same pieces, and only they, are still pending
    (compared by identity): a write for real, through any alias, writes
    them first and drops them; another deferred copy adds one."""
    mode = getattr(_LOCAL, "mode", None)
    if mode is None:
        return ()
    quiet, mode._quiet = mode._quiet, True
    try:
        address = storage_address(tensor)
        return tuple(mode._alive(address) or ()) if address is not None else ()
    finally:
        mode._quiet = quiet


def _tiles(pieces: list[Piece], start: int, nbytes: int) -> bool:
    """Whether ``pieces`` cover ``[start, start + nbytes)`` exactly once."""
    at = start
    for piece in sorted(pieces, key=lambda p: p.offset):
        if piece.offset != at:
            return False
        at += piece.nbytes
    return at == start + nbytes


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an operation's arguments: in tuples, lists and dicts,
    at any depth (what torch's pytree finds there, at a fraction of its cost
    per operation)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def pieces_of(weight: torch.Tensor) -> list[RowPiece] | None:
    """``weight`` (2-D, contiguous) as the pieces of the weights its rows
    were recorded from, when they tile it exactly by whole rows, each a
    matrix of rows read in place; else ``None`` (its bytes are then written
    for real by the first operation that reads it). Outside a
    :class:`DeferredCopies`, ``None``."""
    mode = getattr(_LOCAL, "mode", None)
    if mode is None or weight.dim() != 2 or weight.shape[1] == 0:
        return None
    quiet, mode._quiet = mode._quiet, True
    try:
        if not weight.is_contiguous():
            return None
        address = storage_address(weight)
        pieces = mode._alive(address) if address is not None else None
        if not pieces:
            return None
        rows, cols = weight.shape
        row_bytes = cols * weight.element_size()
        start = weight.data_ptr() - address  # type: ignore[operator]
        at = start
        out = []
        if pieces[0].source is None and pieces[0].offset == 0:
            pieces = pieces[1:]  # the zeros under the whole allocation, written first: covered if the rest tile it
        for piece in sorted(pieces, key=lambda p: p.offset):
            if piece.offset != at or piece.nbytes % row_bytes or piece.dtype != weight.dtype:
                return None
            piece.check()
            source, count = piece.source, piece.nbytes // row_bytes
            if source.dim() == 2 and source.shape[1] == cols and source.stride(1) == 1:
                stride = source.stride(0)
            elif source.is_contiguous():
                stride = cols
            else:
                return None
            span = (count - 1) * stride + cols
            flat = source.as_strided((span,), (1,), source.storage_offset()).view(torch.int16).numpy()
            out.append(RowPiece((at - start) // row_bytes, count, flat, stride, piece))
            at += piece.nbytes
        if at != start + rows * row_bytes:
            return None
        mode.in_place_bytes += rows * row_bytes
        TOTALS["in_place"] += rows * row_bytes
        return out
    finally:
        mode._quiet = quiet
