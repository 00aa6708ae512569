"""Where every byte of a vLLM engine's parameters comes from, from shapes alone.

A sharded trainer (FSDP2) holds no whole tensor, yet each engine key's
bytes are a sequence of pieces of its tensors: a block of rows of
``q_proj``, then of ``k_proj``; a column slice of every row of ``o_proj``;
zeros for padded vocabulary rows. This module asks vLLM's own loaders which
pieces, without a byte of the weights: the same rank models and loaders as
:func:`~weight_checker.expected_digests` (every decision vLLM's), fed with
tensors whose memory is reserved but never touched (an anonymous
``MAP_NORESERVE`` mapping), while :class:`~.deferred.DeferredWrites`
records each plain copy instead of making it. A key whose bytes are not
such a sequence (computed, cast or replayed by the loader) is named, never
guessed: the caller gathers that tensor, or refuses.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from weight_checker.errors import ExpectedDigestsError

#: Why a key has no runs.
NOT_PIECES = "not a sequence of pieces of the weights: the engine's loader computes or casts it"


@dataclass(frozen=True)
class Run:
    """``count`` runs of ``length`` elements of the C-order flattening of
    weight ``source``, the first at element ``start``, each ``step`` after
    the one before; ``source`` ``None``: ``length`` zero bytes."""

    source: str | None
    start: int
    length: int
    count: int = 1
    step: int = 0

    def spans(self) -> Iterable[tuple[int, int]]:
        """``(start, length)`` of each run, in order."""
        for i in range(self.count):
            yield self.start + i * self.step, self.length


@dataclass(frozen=True)
class KeyLayout:
    """One engine key: its runs in byte order and its element type, or
    ``runs`` ``None`` and ``why`` where its bytes are not pieces of the weights."""

    dtype: Any
    runs: tuple[Run, ...] | None
    why: str = ""


def _reserve(nbytes: int) -> Any:
    """``nbytes`` of address space that never becomes memory unless written
    (nothing here writes it; a read maps the zero page)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    return mmap.mmap(-1, max(nbytes, 1), flags=flags)


def _phantom(region: Any, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """A tensor of ``shape`` over ``region`` at ``offset``, with a storage of
    its own (the loader's bookkeeping tells weights apart by storage)."""
    import torch

    numel = torch.Size(shape).numel()
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(shape)


def engine_layout(
    model: Any,
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    expected: Any,
    cast_to: Any = None,
    **expected_args: Any,
) -> dict[str, KeyLayout]:
    """``{key: KeyLayout}`` for every key :func:`~weight_checker.expected_digests`
    gives for ``model`` (``tp``, ``pp``, ``dp``, ``dtype`` and engine
    arguments as there), loaded from weights of the names, shapes and
    dtypes of ``tensors`` (tensors of any kind: meta, ``DTensor``s, whose
    global shape counts); ``cast_to``: the dtype the trainer sends them in,
    where not their own (fp32 masters sent as bf16). ``expected``:
    ``weight_checker.expected_digests``, which runs the load (passed in:
    it calls into this module for sharded weights)."""
    return layout_and_shell(expected, model, tensors, cast_to=cast_to, **expected_args)[0]


def layout_and_shell(
    expected: Any,
    model: Any,
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    cast_to: Any = None,
    **expected_args: Any,
) -> tuple[dict[str, KeyLayout], Any]:
    """:func:`engine_layout`, and the ``ExpectedDigests`` of that call with
    no digest in it yet (its keys, layout and warnings; nothing to
    recompute from): the result a sharded call fills in."""
    import torch

    from weight_checker.expected.vllm.deferred import PLACEHOLDER, capturing_pieces

    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    specs = []
    for name, t in items:
        shape, dtype = tuple(t.shape), cast_to or t.dtype
        if not isinstance(dtype, torch.dtype):
            raise ExpectedDigestsError(f"weight '{name}': {dtype!r} is not a torch dtype")
        specs.append((name, shape, dtype))
    align = 64
    offsets: dict[str, int] = {}
    at = 0
    for name, shape, dtype in specs:
        offsets[name] = at
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        at += -(-nbytes // align) * align
    region = _reserve(at)
    pairs = [(name, _phantom(region, offsets[name], shape, dtype)) for name, shape, dtype in specs]
    base = min((t.data_ptr() - offsets[n] for n, t in pairs if t.numel()), default=0)
    try:
        with capturing_pieces() as captured:
            digests = expected(model, pairs, **expected_args)
        # Where each weight's bytes start (an empty one has none: it would
        # share its offset with the next and take its bytes' name).
        owner = sorted((offsets[name], name) for name, t in pairs if t.numel())
        out: dict[str, KeyLayout] = {}
        for key, value in digests.items():
            runs: list[Run] | None = None
            if value.startswith(PLACEHOLDER):
                pieces = captured[int(value[len(PLACEHOLDER) :])]
                each = [_runs(p, base, owner) for p in pieces]
                if all(r is not None for r in each):
                    runs = [run for r in each for run in r or ()]
                    out[key] = KeyLayout(pieces[0].dtype, tuple(runs))
                    continue
            out[key] = KeyLayout(None, None, NOT_PIECES)
        digests._recompute = None  # its weights are address space, never bytes to recompute from
        digests.block_states.clear()  # states of that address space: nothing to explain with
        for key in digests:
            digests[key] = ""
        return out, digests
    finally:
        del pairs
        try:
            region.close()
        except BufferError:
            pass  # a view still exported: the mapping goes with the last one


def _runs(piece: Any, base: int, owner: list[tuple[int, str]]) -> list[Run] | None:
    """A recorded piece as runs of its weight's elements; ``None`` where
    its view does not read whole rows of contiguous elements."""
    import bisect

    if piece.source is None:
        return [Run(None, 0, piece.nbytes)]
    src = piece.source
    offset = src.data_ptr() - base
    start_byte, name = owner[bisect.bisect_right(owner, (offset, "\uffff")) - 1]
    start = (offset - start_byte) // src.element_size()
    if src.is_contiguous():
        return [Run(name, start, src.numel())]
    if src.dim() < 2 or src.stride(-1) != 1:
        return None
    return list(_rows(name, start, list(src.shape), list(src.stride())))


def _rows(name: str, start: int, shape: list[int], stride: list[int]) -> Iterable[Run]:
    """Rows of ``shape[-1]`` contiguous elements: one :class:`Run` where the
    leading dimensions step evenly, else one per index of the first."""
    if len(shape) == 2:
        yield Run(name, start, shape[1], shape[0], stride[0])
        return
    if stride[0] == stride[1] * shape[1]:
        yield from _rows(name, start, [shape[0] * shape[1], *shape[2:]], [stride[1], *stride[2:]])
        return
    for i in range(shape[0]):
        yield from _rows(name, start + i * stride[0], shape[1:], stride[1:])
