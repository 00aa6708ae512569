"""A tensor's C-order bytes as ``uint8`` tensors on its own device: whole,
in bounded pieces (non-contiguous ones made contiguous a block at a time),
or many of one dtype gathered back to back with one op."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


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
