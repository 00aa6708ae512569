"""Where in each tensor: this side's block digests of the expected tensors, compared with the engine's."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from weight_checker.errors import WeightCheckerError
from weight_checker.hashing.blocks import (
    block_bytes_for,
    block_ranges,
    digest_pieces,
    flat_bytes,
    rows_text,
    zero_blocks,
    zero_digest,
)
from weight_checker.verify.explain.fetchers import BlockFetcher, fetch_all
from weight_checker.verify.explain.model import ExpectedTensors, Explanation, KeyExplanation, Table
from weight_checker.verify.explain.sources import with_candidates


class Blocks:
    """One key's expected tensor cut in blocks, and the block digests of
    candidates, computed only for the blocks asked."""

    def __init__(self, tensor: Any, block_bytes: int):
        self.flat = flat_bytes(tensor)
        self.block_bytes = block_bytes
        self.nbytes = int(self.flat.numel())
        self.ranges = block_ranges(self.nbytes, block_bytes)


def _hash_blocks(pieces: list[tuple[Any, tuple[int, int]]]) -> list[str]:
    """SHA-256 of ``flat[start:end]`` for each ``(flat, (start, end))``, in one parallel call."""
    return digest_pieces(pieces)


def candidate_digests(
    flats: Mapping[str, Any], blocks: Mapping[str, Blocks], at: Sequence[tuple[str, int]]
) -> list[str]:
    """The digests of candidates' blocks: for each ``(key, i)`` of ``at``,
    block ``i`` of ``flats[key]`` as ``blocks[key]`` cuts it, in one
    parallel call (hashed as the expected blocks are)."""
    return _hash_blocks([(flats[key], blocks[key].ranges[i]) for key, i in at])


#: Bytes of expected tensors hashed in one call while the engine's answer
#: is awaited: small enough that an answer that comes early saves the rest.
GROUP_BYTES = 128 << 20

#: An expected block not hashed because the engine holds zeros there and
#: this side does not: it differs, and no digest equals this.
NOT_HASHED = "(not hashed: non-zero here, zeros on the engine)"


def _groups(items: list[tuple[str, Blocks]]) -> list[list[tuple[str, Blocks]]]:
    """Consecutive keys in groups of about :data:`GROUP_BYTES`."""
    out: list[list[tuple[str, Blocks]]] = []
    size = 0
    for item in items:
        if not out or size + item[1].nbytes > GROUP_BYTES:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item[1].nbytes
    return out


def _hash_expected(group: list[tuple[str, Blocks]], engine: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
    """The expected block digests of ``group``'s keys, in one parallel call.
    Where the engine has answered and holds zeros in a block, the expected
    block is scanned instead: zeros here too give the zeros' digest, else
    :data:`NOT_HASHED` (it differs, and the engine's digest says how)."""
    pieces: list[tuple[Any, tuple[int, int]]] = []
    slots: list[tuple[str, int]] = []
    out: dict[str, list[str]] = {}
    for key, b in group:
        out[key] = [""] * len(b.ranges)
        answer = engine.get(key)
        theirs = answer.get("digests") if answer is not None and _comparable(answer, b) else None
        zero = zero_digests({end - start for start, end in b.ranges}) if theirs else {}
        engine_zero = [i for i, (start, end) in enumerate(b.ranges) if theirs and theirs[i] == zero[end - start]]
        for i, here in zip(engine_zero, zero_blocks(b.flat, [b.ranges[i] for i in engine_zero]), strict=True):
            start, end = b.ranges[i]
            out[key][i] = zero[end - start] if here else NOT_HASHED
        skip = set(engine_zero)
        for i, r in enumerate(b.ranges):
            if i not in skip:
                pieces.append((b.flat, r))
                slots.append((key, i))
    for (key, i), digest in zip(slots, _hash_blocks(pieces), strict=True):
        out[key][i] = digest
    return out


def _comparable(answer: Mapping[str, Any], b: Blocks) -> bool:
    """Whether an engine's answer cuts a tensor of this size in these blocks."""
    digests = answer.get("digests")
    try:  # read as the comparison after the wait reads it
        return (
            isinstance(digests, list | tuple)
            and len(digests) == len(b.ranges)
            and int(answer.get("nbytes", -1)) == b.nbytes
            and int(answer.get("block_bytes", -1)) == b.block_bytes
        )
    except (TypeError, ValueError):
        return False


def zero_digests(sizes: set[int]) -> dict[int, str]:
    """Block size -> the digest of that many zero bytes."""
    return {n: zero_digest(n) for n in sizes}


class Differing(NamedTuple):
    """What :func:`compare_blocks` found, for the candidates to be tried on."""

    #: key -> the indices of its blocks that differ from the expected ones.
    unexplained: dict[str, list[int]]
    #: key -> its expected tensor cut in blocks.
    blocks: dict[str, Blocks]
    #: key -> the engine's answer (its block digests...).
    engine: dict[str, Mapping[str, Any]]
    #: The transformed candidates the source gave with the expected tensors, else ``None``.
    given: Table | None
    #: Where the expected tensors came from (asked for the candidates it has not given).
    source: ExpectedTensors
    #: Where the differing blocks were told by chain states (:mod:`.chained`):
    #: every recorded state by key; the engine's ``digests`` are then the
    #: states it continued, and ``zeros`` says which of its blocks are zero.
    chained: Mapping[str, Any] | None = None
    #: How the engine is asked (the chained candidates ask it again).
    fetch: Any = None


def compare_blocks(
    pending: list[KeyExplanation],
    fetch: BlockFetcher | None,
    tensors: ExpectedTensors | None,
    out: Explanation,
) -> Differing | None:
    """The blocks of ``pending``'s keys that differ between the engine (its
    block digests from ``fetch``) and the expected tensors (from
    ``tensors``), into each key's explanation; ``None`` where either is
    missing or the expected tensors could not be had."""
    if tensors is None or fetch is None:
        why = "no expected tensors to compare with" if tensors is None else "the engine gives no block digests"
        for e in pending:
            e.note = why
        out.notes.append(f"where in each tensor: not told ({why})")
        return None
    keys = [e.key for e in pending]
    started = time.perf_counter()
    try:
        got, candidates_given = with_candidates(tensors, keys)
    except WeightCheckerError as err:
        for e in pending:
            e.note = _no_tensor(tensors, e.key)
        out.notes.append(f"where in each tensor: not told ({err})")
        return None
    by_size: dict[int, list[KeyExplanation]] = {}
    blocks: dict[str, Blocks] = {}
    for e in pending:
        t = (got.get(e.key) or {}).get(None)
        if t is None:
            e.note = _no_tensor(tensors, e.key)
            continue
        size = block_bytes_for(list(t.shape), t.element_size())
        if size == 0:
            e.note = "an empty tensor"
            continue
        e.shape, e.dtype = list(t.shape), str(t.dtype).removeprefix("torch.")
        e.block_bytes = size
        blocks[e.key] = Blocks(t, size)
        e.nbytes, e.blocks = blocks[e.key].nbytes, len(blocks[e.key].ranges)
        by_size.setdefault(size, []).append(e)
    # The engine hashes its blocks while this side hashes the expected ones,
    # a group of keys at a time: once the engine has answered, a block it
    # holds as zeros is scanned here, not hashed (see _hash_expected).
    engine: dict[str, Mapping[str, Any]] = {}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    refused_keys: set[str] = set()
    try:
        asked = {size: pool.submit(fetch_all, fetch, [e.key for e in group], size) for size, group in by_size.items()}

        def harvest() -> None:
            for size in [size for size, future in asked.items() if future.done()]:
                answers, refused = asked.pop(size).result()
                engine.update(answers)
                refused_keys.update(refused)
                for e in by_size[size]:
                    if e.key in refused:
                        e.note = f"no block digests from the engine ({refused[e.key]})"
                for why in sorted(set(refused.values())):
                    if f"where in each tensor: not told ({why})" not in out.notes:
                        out.notes.append(f"where in each tensor: not told ({why})")

        mine: dict[str, list[str]] = {}
        for group in _groups(list(blocks.items())):
            harvest()
            # Refused, or answered in other blocks (judged below): nothing to compare, not hashed.
            wanted = [
                (k, b) for k, b in group if k not in refused_keys and (k not in engine or _comparable(engine[k], b))
            ]
            mine.update(_hash_expected(wanted, engine))
        out.seconds["expected_blocks"] = time.perf_counter() - started
        concurrent.futures.wait(list(asked.values()))
        harvest()
    finally:  # an engine request that failed: the others still queued are not sent
        pool.shutdown(wait=True, cancel_futures=True)
    out.seconds["blocks"] = time.perf_counter() - started
    unexplained: dict[str, list[int]] = {}
    for key, b in blocks.items():
        e = out.keys[key]
        theirs = engine.get(key)
        if theirs is None:
            continue
        if int(theirs.get("nbytes", -1)) != b.nbytes or list(theirs.get("shape") or []) != e.shape:
            e.note = f"the engine holds shape {theirs.get('shape')} ({theirs.get('nbytes')} bytes), expected {e.shape}"
            continue
        if int(theirs.get("block_bytes", -1)) != e.block_bytes or len(theirs.get("digests") or []) != len(b.ranges):
            e.note = f"the engine cut {theirs.get('nbytes')} bytes in blocks of {theirs.get('block_bytes')}, not ours"
            continue
        if key not in mine:  # an answer that does not compare: not hashed here
            e.note = f"the engine's answer does not compare with this tensor's blocks: {str(theirs)[:120]}"
            continue
        if theirs.get("dtype") not in (None, e.dtype):
            e.note = f"the engine holds {theirs.get('dtype')}, expected {e.dtype}"
        differ = [i for i, (a, x) in enumerate(zip(theirs["digests"], mine[key], strict=False)) if a != x]
        e.located_by = "block digests"
        e.ranges = merge_ranges([b.ranges[i] for i in differ])
        e.where = rows_text(e.ranges, e.shape or [], b.nbytes // max(1, _numel(e.shape)))
        if not differ:
            e.note = "every block equals the expected one: the tensor changed since its digest was taken"
            continue
        unexplained[key] = differ
    return Differing(unexplained, blocks, engine, got if candidates_given else None, tensors)


def _no_tensor(source: ExpectedTensors, key: str) -> str:
    """A key's note where its expected tensor was not given, with why where the source says."""
    why = (getattr(source, "refused", None) or {}).get(key)
    return f"no expected tensor ({why})" if why else "no expected tensor"


def _numel(shape: Sequence[int] | None) -> int:
    n = 1
    for d in shape or []:
        n *= d
    return n


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` in order, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
