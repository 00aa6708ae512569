"""Block digests: where in a tensor two copies differ.

A tensor's bytes (C order, as its digest reads them) are cut into blocks of
``block_bytes`` (the last one shorter), and each block is hashed on its own
with SHA-256. Two copies whose whole digests differ are compared block by
block: the blocks that differ are the byte ranges that differ. Both sides
must cut at the same size: the client chooses it per tensor
(:func:`block_bytes_for`, whole rows where the tensor has rows) and asks the
engine for that size (``{"action": "block_digests"}``).

All blocks of all tensors asked for go to the Rust core in one call, as
separate messages: a single large tensor is hashed by every lane at once,
so its blocks cost no more than its digest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from weight_checker.errors import InputError

#: Blocks a tensor is cut into by default: enough to say which part of a
#: tensor differs (a quarter, a TP shard's rows, a dropped bucket), few
#: enough to send and show.
TARGET_BLOCKS = 64

#: Keys one block-digest request may name: the explanation covers the first
#: mismatches only; every block is hashed on the engine while it serves.
MAX_KEYS = 64

#: Blocks one tensor may be cut into by a request (the client asks for
#: about :data:`TARGET_BLOCKS`): a block size of a few bytes on a 1 GB tensor
#: would make the worker build a billion slices.
MAX_BLOCKS = 65536


def block_ranges(nbytes: int, block_bytes: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` byte ranges of the blocks of a tensor of ``nbytes``."""
    if block_bytes < 1:
        raise InputError(f"block_bytes must be at least 1, got {block_bytes}")
    return [(start, min(start + block_bytes, nbytes)) for start in range(0, nbytes, block_bytes)]


def row_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of one row (the last dimensions of a tensor of at least two),
    or of one element (vectors and scalars)."""
    if len(shape) < 2:
        return itemsize
    return itemsize * math.prod(shape[1:])


def block_bytes_for(shape: Sequence[int], itemsize: int, target: int = TARGET_BLOCKS) -> int:
    """A block size that cuts a tensor into about ``target`` blocks of whole
    rows (so that a range of blocks is a range of rows); 0 for a tensor
    without bytes."""
    nbytes = itemsize * math.prod(shape)
    if nbytes == 0:
        return 0
    row = row_bytes(shape, itemsize)
    rows = nbytes // row
    return row * max(1, math.ceil(rows / target))


def flat_bytes(tensor: Any) -> Any:
    """The tensor's bytes as a flat ``uint8`` tensor (a view where it is
    contiguous, else a contiguous copy): what its digest reads."""
    import torch

    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def block_digests(
    tensors: Sequence[Any], block_bytes: Sequence[int], names: Sequence[str] | None = None
) -> list[list[str]]:
    """SHA-256 (hex) of every block of each tensor, blocks of
    ``block_bytes[i]`` for tensor ``i``, all hashed in one parallel call
    (CPU tensors in place; device tensors staged)."""
    from weight_checker.hashing.digests import digest_tensors

    if len(block_bytes) != len(tensors):
        raise InputError(f"{len(tensors)} tensors but {len(block_bytes)} block sizes")
    names = list(names) if names is not None else [f"tensor {i}" for i in range(len(tensors))]
    pieces: list[Any] = []
    labels: list[str] = []
    counts: list[int] = []
    for name, tensor, size in zip(names, tensors, block_bytes, strict=True):
        flat = flat_bytes(tensor)
        ranges = block_ranges(int(flat.numel()), size)
        pieces += [flat[start:end] for start, end in ranges]
        labels += [f"{name} [{start}:{end}]" for start, end in ranges]
        counts.append(len(ranges))
    digests, _ = digest_tensors(labels, pieces) if pieces else ([], [])
    out: list[list[str]] = []
    at = 0
    for n in counts:
        out.append(digests[at : at + n])
        at += n
    return out


def rows_text(ranges: Sequence[tuple[int, int]], shape: Sequence[int], itemsize: int) -> str | None:
    """``"rows 2048-4095 of 4096"`` (several ranges joined by commas), or
    ``"elements ..."`` for vectors; ``None`` for a tensor without bytes."""
    if not ranges or math.prod(shape) == 0:
        return None
    row = row_bytes(shape, itemsize)
    total = (itemsize * math.prod(shape)) // row
    unit = "rows" if len(shape) >= 2 else "elements"
    parts = []
    for start, end in ranges:
        first, last = start // row, (end - 1) // row
        parts.append(f"{first}" if first == last else f"{first}-{last}")
    return f"{unit} {', '.join(parts)} of {total}"
