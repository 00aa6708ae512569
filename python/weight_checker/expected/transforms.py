"""The candidate causes: transforms of the weights (round trips, truncation, transposes) and how each is applied.

Each transform (:data:`TRANSFORMS`) is what a sync bug may have done to the
trainer's weights before the engine loaded them: a round trip through another
dtype, a truncation, a transpose. :func:`applies` says whether one changes a
tensor like a given one, :func:`transformed` applies it to a tensor. An
elementwise one (a round trip, a truncation) of a parameter tiled by pieces of
the weights is applied to the pieces, at once (:func:`elementwise_into`) or a
block at a time (:class:`LazyPieces`); the others need the transformed weights
loaded again (:func:`reload_needed`), or are left to a later call
(:data:`DEFERRED`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from weight_checker.expected.vllm.locate import Located

__all__ = [
    "DEFERRED",
    "TRANSFORMS",
    "UNCHANGED",
    "LazyPieces",
    "applies",
    "elementwise_into",
    "lazy_elementwise",
    "reload_needed",
    "same_bytes",
    "transformed",
]

#: The candidate causes, by the names a report gives them.
TRANSFORMS = ("dtype-roundtrip:float16", "dtype-roundtrip:bfloat16", "truncate:bfloat16", "transposed")


def transformed(transform: str, tensor: Any) -> Any:
    """``tensor`` as the transform makes it, or ``None`` where it does not apply."""
    # torch: imported when first used, so `import weight_checker` runs without it.
    import torch

    if transform.startswith("dtype-roundtrip:"):
        through = getattr(torch, transform.split(":", 1)[1])
        return _round_trip(tensor, through) if _changes(transform, tensor) else None
    if transform == "truncate:bfloat16":
        if tensor.dtype != torch.float32:
            return None
        return (tensor.view(torch.int32) & -65536).view(torch.float32)
    if transform == "transposed":
        if not _square(tensor):
            return None
        # A tensor of its own even where the weight is stored column-major (then
        # .t().contiguous() would be the weight itself, which the trainer may write).
        return tensor.t().clone(memory_format=torch.contiguous_format)
    raise AssertionError(transform)


#: Elements converted at a time through float32 (scratch that stays in cache).
_CHUNK = 1 << 20


def _round_trip(tensor: Any, through: Any) -> Any:
    """``tensor.to(through).to(tensor.dtype)``, the same values (see :func:`_round_trip_into`)."""
    # torch: imported when first used, so `import weight_checker` runs without it.
    import torch

    if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32) or tensor.device.type != "cpu":
        return tensor.to(through).to(tensor.dtype)
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    _round_trip_into(out, tensor, through)
    return out


def _round_trip_into(out: Any, src: Any, through: Any) -> None:
    """``out[...] = src.to(through).to(src.dtype)`` for a bfloat16, float16
    or float32 ``src`` (any strides): torch converts a half type to another
    through float32 (exact from each of the three, rounded to nearest even
    into the other), done here some rows at a time in float32 scratch that
    stays in cache (about twice as fast as the direct conversions into fresh
    memory)."""
    # torch: imported when first used, so `import weight_checker` runs without it.
    import torch

    if src.dim() == 0:
        out.copy_(src.to(through).to(src.dtype))
        return
    rows = src.shape[0]
    per_row = max(1, src.numel() // max(1, rows))
    step = max(1, _CHUNK // per_row)
    wide = torch.empty(min(rows, step) * per_row, dtype=torch.float32)
    narrow = torch.empty(wide.numel(), dtype=through)
    with torch.no_grad():
        for start in range(0, rows, step):
            part = src[start : start + step]
            w, n = wide[: part.numel()].view(part.shape), narrow[: part.numel()].view(part.shape)
            w.copy_(part)
            nan = w.isnan()
            n.copy_(w)
            w.copy_(n)
            out[start : start + step].copy_(w)
            if nan.any():  # NaN's bits as .to() gives them (through float32 scratch they come out others)
                out[start : start + step].copy_(part.to(through).to(src.dtype))


def elementwise_into(transform: str, where: Located, dtypes: Mapping[str, Any]) -> Any:
    """An elementwise transform of a parameter tiled by pieces of the weights
    in their own dtype, applied to the pieces (the loader only selects and
    places elements, whatever their values: transforming the weights first
    gives the same bytes); :data:`UNCHANGED` where it changes none of them;
    ``None`` where a piece is not plainly a weight's elements in its own
    dtype (then the weights are transformed and loaded again)."""
    # torch: imported when first used, so `import weight_checker` runs without it.
    import torch

    verdict = _elementwise_verdict(transform, where, dtypes)
    if verdict is not True:
        return verdict
    assert where.pieces is not None
    out = torch.empty(where.shape, dtype=where.dtype)
    flat = out.view(-1).view(torch.uint8)
    with torch.no_grad():
        for piece in where.pieces:
            region = flat[piece.offset - where.start : piece.offset - where.start + piece.nbytes]
            region = region.view(piece.dtype).view(piece.shape)
            src = piece.source
            if src is None:
                region.zero_()
                continue
            piece.check()
            if not _changes(transform, src):
                region.copy_(src)
                continue
            if transform == "truncate:bfloat16":
                torch.bitwise_and(src.view(torch.int32), -65536, out=region.view(torch.int32))
            else:
                through = getattr(torch, transform.split(":", 1)[1])
                if src.dtype in (torch.bfloat16, torch.float16, torch.float32):
                    _round_trip_into(region, src, through)
                else:
                    region.copy_(src.to(through).to(src.dtype))
    return out


class LazyPieces:
    """An elementwise transform of a parameter tiled by pieces (what
    :func:`elementwise_into` would write), computed a block of bytes at a
    time: a candidate the explanation tries on one block of a run costs that
    block, not the tensor. ``nbytes``, ``shape``, ``dtype`` as the
    parameter's; :meth:`block` gives bytes ``[start, end)``."""

    def __init__(self, transform: str | None, where: Located):
        assert where.pieces is not None
        self.transform, self.where = transform, where
        self.shape, self.dtype = where.shape, where.dtype
        self.nbytes = math.prod(where.shape) * where.param.element_size()

    def block(self, start: int, end: int) -> Any:
        # torch: imported when first used, so `import weight_checker` runs without it.
        import torch

        parts = []
        for piece in self.where.pieces or ():
            at = piece.offset - self.where.start
            lo, hi = max(start, at), min(end, at + piece.nbytes)
            if lo >= hi:
                continue
            if piece.source is None:
                parts.append(torch.zeros(hi - lo, dtype=torch.uint8))
                continue
            piece.check()
            parts.append(_piece_bytes(self.transform, piece.source, lo - at, hi - at))
        if not parts:
            return torch.empty(0, dtype=torch.uint8)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _piece_bytes(transform: str | None, src: Any, start: int, end: int) -> Any:
    """Bytes ``[start, end)`` of ``src`` transformed (C order; ``None``: as it
    is): only the rows that hold them are read and transformed."""
    # torch: imported when first used, so `import weight_checker` runs without it.
    import torch

    size = src.element_size()
    first, last = start // size, -(-end // size)
    if src.dim() == 0:
        elements = src.reshape(1)
        skip = 0
    elif src.is_contiguous():
        elements = src.reshape(-1)[first:last]
        skip = first
    else:
        per_row = max(1, src.numel() // max(1, src.shape[0]))
        r0, r1 = first // per_row, -(-last // per_row)
        elements = src[r0:r1].contiguous().reshape(-1)[first - r0 * per_row : last - r0 * per_row]
        skip = first
    if transform is None or not _changes(transform, src):
        out = elements.contiguous()
    elif transform == "truncate:bfloat16":
        out = elements.contiguous().view(torch.int32).bitwise_and(-65536).view(torch.float32)
    else:
        out = _round_trip(elements, getattr(torch, transform.split(":", 1)[1]))
    raw = out.contiguous().view(torch.uint8)
    return raw[start - skip * size : end - skip * size]


def lazy_elementwise(transform: str, where: Located, dtypes: Mapping[str, Any]) -> Any:
    """:func:`elementwise_into`'s answer without computing it: ``None`` and
    :data:`UNCHANGED` as it says them, else a :class:`LazyPieces`."""
    verdict = _elementwise_verdict(transform, where, dtypes)
    return LazyPieces(transform, where) if verdict is True else verdict


def _elementwise_verdict(transform: str, where: Located, dtypes: Mapping[str, Any]) -> Any:
    """``None`` where a piece is not plainly a weight's elements in its own
    dtype, :data:`UNCHANGED` where the transform changes no piece, else ``True``."""
    assert where.pieces is not None
    for piece in where.pieces:
        if piece.source is not None and (piece.name not in dtypes or dtypes[piece.name] != piece.dtype):
            return None
    if not any(p.source is not None and _changes(transform, p.source) for p in where.pieces):
        return UNCHANGED
    return True


def _changes(transform: str, tensor: Any) -> bool:
    """Whether an elementwise transform applies to ``tensor``: a round trip
    through another floating dtype than its own, a truncation of float32."""
    # torch: imported when first used, so `import weight_checker` runs without it.
    import torch

    if transform == "truncate:bfloat16":
        return bool(tensor.dtype == torch.float32)
    through = getattr(torch, transform.split(":", 1)[1])
    return bool(tensor.is_floating_point() and tensor.dtype != through)


#: What :func:`elementwise_into` gives for a parameter the transform leaves as it was.
UNCHANGED = object()


class _Deferred:
    def __repr__(self) -> str:
        return "DEFERRED"


#: A transform's entry :func:`~weight_checker.expected.recompute.expected_tensors` leaves to a later call
#: (``defer=True``): computing it means loading the transformed weights again.
DEFERRED: Any = _Deferred()


def _square(t: Any) -> bool:
    return bool(t.dim() == 2 and t.shape[0] == t.shape[1])


def applies(transform: str, t: Any) -> bool:
    """Whether ``transform`` (one of :data:`TRANSFORMS`) changes a tensor like
    ``t`` at all: a square matrix transposed, or :func:`_changes`."""
    if transform == "transposed":
        return _square(t)
    if transform.startswith("dtype-roundtrip:") or transform == "truncate:bfloat16":
        return _changes(transform, t)
    raise ValueError(f"unknown transform {transform!r}")


def reload_needed(
    transform: str, located: Mapping[str, Located], names: Iterable[str], pairs: list[tuple[str, Any]]
) -> list[str]:
    """Those of ``names`` whose bytes the transform may change, computed
    only by loading the transformed weights again: a parameter tiled by
    pieces of the weights, where one of those weights changes (a square one,
    for ``transposed``); any other, where any weight of the call changes."""
    weights = dict(pairs)
    out = []
    for name in names:
        pieces = located[name].pieces
        feeding = {p.name for p in pieces or () if p.source is not None}
        if pieces is not None and feeding <= weights.keys():
            if any(applies(transform, weights[n]) for n in feeding):
                out.append(name)
        elif any(applies(transform, t) for t in weights.values()):
            out.append(name)
    return out


def same_bytes(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same bytes (of the same shape and dtype)."""
    # torch: imported when first used, so `import weight_checker` runs without it.
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.numel():
        return True
    x, y = a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    try:  # compared 8 bytes at a time: torch compares bytes one by one, five times slower
        x, y = x.view(torch.int64), y.view(torch.int64)
    except RuntimeError:
        pass
    return bool(torch.equal(x, y))
