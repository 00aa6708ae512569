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

A block whose bytes are all zero is not hashed: its digest is the digest of
that many zero bytes, computed once per length (:func:`digest_pieces`). A
scan for a non-zero byte stops at the first one (real weights: the first
bytes of a block), and runs at memory speed where the block is zero, against
SHA-256's 2-4 GB/s a core; on a device it runs there and a zero block never
crosses to the host. So "zero bytes delivered", a common sync bug, is
explained at the cost of reading the tensor, not of hashing it.
"""

from __future__ import annotations

import functools
import hashlib
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
    if len(block_bytes) != len(tensors):
        raise InputError(f"{len(tensors)} tensors but {len(block_bytes)} block sizes")
    names = list(names) if names is not None else [f"tensor {i}" for i in range(len(tensors))]
    pieces: list[Any] = []
    labels: list[str] = []
    counts: list[int] = []
    for name, tensor, size in zip(names, tensors, block_bytes, strict=True):
        flat = flat_bytes(tensor)
        ranges = block_ranges(int(flat.numel()), size)
        pieces += [(flat, r) for r in ranges]
        labels += [f"{name} [{start}:{end}]" for start, end in ranges]
        counts.append(len(ranges))
    digests = digest_pieces(pieces, labels)
    out: list[list[str]] = []
    at = 0
    for n in counts:
        out.append(digests[at : at + n])
        at += n
    return out


def worker_blocks(named: Sequence[tuple[str, Any]], block_bytes: int, rank: str) -> dict[str, Any]:
    """One worker's answer to a ``block_digests`` request, whatever the
    engine: ``{"rank": rank, "blocks": {key: {"digests", "block_bytes",
    "nbytes", "shape", "dtype"}}, "errors": {key: why}}`` for the ``(key,
    tensor)`` pairs it holds. A block size above a tensor's size, or one that
    cuts it into more than :data:`MAX_BLOCKS` blocks, is an error for that
    key, and then nothing is hashed."""
    answer: dict[str, Any] = {"rank": rank, "blocks": {}, "errors": {}}
    for key, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if block_bytes > nbytes:
            answer["errors"][key] = f"block_bytes {block_bytes} is above the tensor's {nbytes} bytes"
        elif -(-nbytes // block_bytes) > MAX_BLOCKS:
            answer["errors"][key] = (
                f"block_bytes {block_bytes} cuts the tensor's {nbytes} bytes into {-(-nbytes // block_bytes)} "
                f"blocks: at most {MAX_BLOCKS}"
            )
    if answer["errors"] or not named:
        return answer
    digests = block_digests([t for _, t in named], [int(block_bytes)] * len(named), [k for k, _ in named])
    for (key, tensor), blocks in zip(named, digests, strict=True):
        answer["blocks"][key] = {
            "digests": blocks,
            "block_bytes": int(block_bytes),
            "nbytes": tensor.numel() * tensor.element_size(),
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
        }
    return answer


#: Bytes read from the start of each block to rule it out as all zero: a
#: real weight's block has a non-zero byte within its first few elements.
ZERO_PROBE_BYTES = 64


#: Device blocks whose first bytes are zero, read whole before their
#: answers come back to the host together (one sync for that many).
ZERO_SCAN_BLOCKS = 1024


def zero_blocks(flat: Any, ranges: Sequence[tuple[int, int]]) -> list[bool]:
    """Whether each block ``flat[start:end]`` of a flat ``uint8`` tensor is
    all zero. The first :data:`ZERO_PROBE_BYTES` of the blocks of one size
    are read in one operation (on the tensor's device); only blocks that
    start with zeros are read whole: in host memory one at a time (no
    gathered copy), on a device each by its own reduction, their answers
    read back together (one host sync per :data:`ZERO_SCAN_BLOCKS`)."""
    import torch

    flags = [False] * len(ranges)
    numel = int(flat.numel())
    # Each range as slicing reads it (one past the end is cut there); an empty one is not
    # called zero (it is hashed: sha256(b"")).
    ranges = [(a, max(a, b)) for a, b, _ in (slice(start, end).indices(numel) for start, end in ranges)]
    size = max((end - start for start, end in ranges), default=0)
    if size <= 0:
        return flags
    # Blocks cut at multiples of their size (block_ranges' full blocks) are rows of one grid.
    rows = [i for i, (start, end) in enumerate(ranges) if end - start == size and start % size == 0]
    in_grid = set(rows)
    maybe = [i for i in range(len(ranges)) if i not in in_grid]
    if rows:
        grid = flat[: (int(flat.numel()) // size) * size].view(-1, size)[:, : min(ZERO_PROBE_BYTES, size)]
        which = torch.tensor([ranges[i][0] // size for i in rows], device=flat.device)
        heads = grid.index_select(0, which).any(dim=1).tolist()
        zero_headed = [i for i, nonzero in zip(rows, heads, strict=True) if not nonzero]
        if _one_at_a_time(flat):
            maybe += zero_headed
        else:  # each block reduced on its own (no copy), the answers read back together
            for at in range(0, len(zero_headed), ZERO_SCAN_BLOCKS):
                part = zero_headed[at : at + ZERO_SCAN_BLOCKS]
                nonzero = torch.stack([flat[ranges[i][0] : ranges[i][1]].any() for i in part]).tolist()
                for i, found in zip(part, nonzero, strict=True):
                    flags[i] = not found
    for i in maybe:
        start, end = ranges[i]
        if end <= start:
            continue
        head = flat[start : min(end, start + ZERO_PROBE_BYTES)]
        flags[i] = not bool(head.any()) and not bool(flat[start:end].any())
    return flags


@functools.lru_cache(maxsize=64)
def zero_digest(n: int) -> str:
    """SHA-256 (hex) of ``n`` zero bytes: once per length (the blocks of a
    tensor share one or two)."""
    return hashlib.sha256(bytes(n)).hexdigest()


def _one_at_a_time(flat: Any) -> bool:
    """Whether zero-headed blocks are read one at a time (host memory: no
    copy, and reading is as fast as it gets) or gathered (a device)."""
    return bool(flat.device.type == "cpu")


def digest_pieces(pieces: Sequence[tuple[Any, tuple[int, int]]], labels: Sequence[str] | None = None) -> list[str]:
    """SHA-256 (hex) of ``flat[start:end]`` for each ``(flat, (start, end))``
    (``flat`` a flat ``uint8`` tensor, or an object with a ``block(start,
    end)`` method giving those bytes), in one parallel core call. Blocks
    that are all zero are not hashed (see the module's notes)."""
    from weight_checker.hashing.digests import digest_tensors

    if not pieces:
        return []
    zero = [False] * len(pieces)
    # Blocks of one tensor are scanned together (their first bytes in one read).
    groups: dict[int, list[int]] = {}
    for i, (flat, _) in enumerate(pieces):
        groups.setdefault(id(flat), []).append(i)
    for idx in groups.values():
        flat = pieces[idx[0]][0]
        if hasattr(flat, "block"):  # a transform computed a block at a time: nothing to scan
            continue
        for i, flag in zip(idx, zero_blocks(flat, [pieces[i][1] for i in idx]), strict=True):
            zero[i] = flag
    out: list[str] = [""] * len(pieces)
    # A zero block's length as slicing gives it (a range past the end is cut there).
    length = [len(range(int(flat.numel()))[a:b]) if z else 0 for z, (flat, (a, b)) in zip(zero, pieces, strict=True)]
    hashed = [i for i, z in enumerate(zero) if not z]
    for i, z in enumerate(zero):
        if z:
            out[i] = zero_digest(length[i])
    if hashed:
        names = [labels[i] if labels is not None else f"block {pieces[i][1][0]}:{pieces[i][1][1]}" for i in hashed]
        slices = [
            flat.block(a, b) if hasattr(flat, "block") else flat[a:b] for flat, (a, b) in (pieces[i] for i in hashed)
        ]
        for i, digest in zip(hashed, digest_tensors(names, slices)[0], strict=True):
            out[i] = digest
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
