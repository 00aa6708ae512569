"""Why a check failed: where in each tensor, and the likely cause.

For each mismatched key (the first :data:`DEFAULT_LIMIT`), the engine's
digest and, where it is needed, its block digests
(:mod:`weight_checker.hashing.blocks`) are compared with candidates computed
from the expected tensors, cheapest first:

1. whole digests, free: the digest a previous version expected for that key
   (``version:{label}``) or the one another tensor-parallel rank must hold
   (``shard-of:tp{j}``);
2. block digests, for the rest: the engine hashes the named tensors in
   blocks of whole rows, the expected tensor is hashed the same way, and the
   blocks that differ are the byte ranges (and rows) that differ; each such
   block is then compared with the same block of each candidate: all zeros
   (``zeros``), a previous version's tensor, another rank's shard, the
   expected source round-tripped through another dtype
   (``dtype-roundtrip:float16``, ``dtype-roundtrip:bfloat16``), an fp32
   source truncated to bf16 instead of rounded (``truncate:bfloat16``), the
   source transposed (``transposed``). A candidate is hashed only on the
   blocks still unexplained, and is only computed while some are.

A cause is named only where a candidate's digest equals the engine's: never
a guess. A key whose differing blocks match no candidate is ``unknown``; one
whose blocks match different candidates is ``mixed`` (each block range says
which). A correct update asks for nothing: this runs only on a mismatch.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from weight_checker.errors import WeightCheckerError
from weight_checker.expected.recompute import DEFERRED, TRANSFORMS, LazyPieces
from weight_checker.hashing.blocks import (
    MAX_KEYS,
    block_bytes_for,
    block_ranges,
    digest_pieces,
    flat_bytes,
    rows_text,
    zero_blocks,
    zero_digest,
)
from weight_checker.keys import split_rank

#: Runs of differing blocks of a key a candidate is tried on before its
#: later runs (all of them, once one of these matched).
PROBE_RUNS = 4

#: Keys explained by default (the first, in key order): each is hashed again
#: on the engine and on this side.
DEFAULT_LIMIT = 64


#: The classes whose keys both sides hold (a missing or unexpected key has
#: nothing to compare block by block).
EXPLAINED_CLASSES = ("changed", "stale", "wrong-shard", "untouched-since-reset")


#: ``{key: {None: expected tensor, transform: candidate}}``.
Table = Mapping[str, Mapping[str | None, Any]]


class ExpectedTensors(Protocol):
    """Where the expected tensors of some keys come from: for each key,
    ``{None: the tensor the rank must hold, transform: the tensor it would
    hold had the source been transformed first}`` (a transform that does
    not apply is absent). Raises :class:`WeightCheckerError` for keys it
    cannot give (why goes to the explanation's notes).

    Optional: ``with_candidates(keys)``, the expected tensors and the
    candidates it gives at no extra cost in one table (an entry
    :data:`~weight_checker.expected.recompute.DEFERRED` is asked of
    :meth:`tensors` when it is tried); ``refused``, key -> why a key's
    tensor could not be given."""

    def tensors(self, keys: Sequence[str], transforms: Sequence[str]) -> Mapping[str, Mapping[str | None, Any]]: ...


def _with_candidates(source: ExpectedTensors, keys: Sequence[str]) -> tuple[Table, bool]:
    """The expected tensors of ``keys`` and, where the source gives them at no
    extra cost (a ``with_candidates(keys)`` method: the recompute, which
    loads and checks the weights once for both), the transformed candidates
    too. ``(table, whether the candidates are in it)``."""
    both = getattr(source, "with_candidates", None)
    if callable(both):
        try:
            return both(keys), True
        except WeightCheckerError:
            refused = getattr(source, "refused", None) or {}
            if all(k in refused for k in keys):
                raise  # every expected tensor refused: asking for them alone would refuse them again
            # Else a candidate it could not give: it must not cost the expected tensors, asked alone below.
    return source.tensors(keys, ()), False


class TensorMap:
    """Expected tensors the caller holds, ``{key: tensor}`` as each rank
    holds it (an in-process engine's layout). Transforms are computed on
    those tensors, which is exact where the source had the engine's dtype
    and layout (a dtype round trip of a bf16 source, a square matrix
    transposed at TP=1)."""

    def __init__(self, tensors: Mapping[str, Any]):
        self._tensors = dict(tensors)

    def tensors(self, keys: Sequence[str], transforms: Sequence[str]) -> dict[str, dict[str | None, Any]]:
        out: dict[str, dict[str | None, Any]] = {}
        for key in keys:
            if key in self._tensors:
                t = self._tensors[key].detach()
                out[key] = {None: t, **{name: LazyTransform(t, name) for name in transforms if applies(t, name)}}
        return out


def applies(t: Any, name: str) -> bool:
    """Whether transform ``name`` changes a tensor like ``t`` at all (the recompute's rule)."""
    from weight_checker.expected.recompute import applies as changes

    return changes(name, t)


class LazyTransform:
    """``transform(t, name)``, computed a block at a time: a candidate is
    tried on the first block of each run first, so a transform that does not
    match costs a block, not the tensor."""

    def __init__(self, t: Any, name: str):
        self.t, self.name = t, name
        self.nbytes = int(t.numel()) * t.element_size()

    def block(self, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of the transformed tensor's C-order bytes."""
        import torch

        size = self.t.element_size()
        if self.name == "transposed":  # rows of t.T are columns of t
            row = self.t.shape[1] * size
            first, last = start // row, -(-end // row)
            rows = self.t[:, first:last].t().contiguous().reshape(-1).view(torch.uint8)
            return rows[start - first * row : end - first * row]
        first, last = start // size, -(-end // size)
        part = transform(self.t.reshape(-1)[first:last], self.name).contiguous().view(torch.uint8)
        return part[start - first * size : end - first * size]


def transform(t: Any, name: str) -> Any:
    """``t`` transformed by ``name`` (one of :data:`TRANSFORMS`), or ``None``
    where it does not apply: the recompute's own transform, applied to a
    tensor the caller gave."""
    from weight_checker.expected.recompute import _transformed

    return _transformed(name, t)


@dataclass
class KeyExplanation:
    """What was found for one mismatched key."""

    key: str
    #: The key's mismatch class (``changed``, ``stale``...).
    cls: str
    #: ``zeros``, ``dtype-roundtrip:float16``, ``version:step-11``,
    #: ``shard-of:tp0``, ``transposed``, ``mixed`` or ``unknown``.
    cause: str = "unknown"
    #: True where the whole tensor matched the cause (its whole digest, or
    #: every block differs and every block matched it).
    whole: bool = False
    shape: list[int] | None = None
    dtype: str | None = None
    nbytes: int | None = None
    block_bytes: int | None = None
    blocks: int | None = None
    #: Byte ranges ``[start, end)`` whose blocks differ, adjacent ones merged.
    ranges: list[tuple[int, int]] = field(default_factory=list)
    #: ``"rows 2048-4095 of 4096"``: the rows those ranges cover.
    where: str | None = None
    #: cause -> the byte ranges whose blocks match it (``unknown``: none did).
    block_causes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    #: Why something could not be told (no expected tensor...).
    note: str | None = None

    def line(self) -> str:
        """One line: the key, its class and cause, where in the tensor."""
        parts = [self.key, self.cls, self.cause]
        if self.whole:
            parts.append("(the whole tensor)")
        elif self.ranges:
            of = f" of {self.nbytes}" if self.nbytes is not None else ""
            spans = ", ".join(f"{a}-{b}" for a, b in self.ranges[:4]) + (" ..." if len(self.ranges) > 4 else "")
            parts.append(f"{self.where or ''} (bytes {spans}{of})".strip())
            if self.cause == "mixed":
                parts.append("; ".join(f"{c}: {_spans(r)}" for c, r in self.block_causes.items()))
        if self.note:
            parts.append(f"[{self.note}]")
        return "  ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "class": self.cls,
            "cause": self.cause,
            "whole": self.whole,
            "shape": self.shape,
            "dtype": self.dtype,
            "nbytes": self.nbytes,
            "block_bytes": self.block_bytes,
            "blocks": self.blocks,
            "ranges": [list(r) for r in self.ranges],
            "where": self.where,
            "block_causes": {c: [list(r) for r in rs] for c, rs in self.block_causes.items()},
            "note": self.note,
        }


def _spans(ranges: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"bytes {a}-{b}" for a, b in ranges[:3]) + (" ..." if len(ranges) > 3 else "")


@dataclass
class Explanation:
    """The explanations of a failed check's first mismatched keys."""

    keys: dict[str, KeyExplanation] = field(default_factory=dict)
    #: Mismatched keys left unexplained by the limit.
    left_out: int = 0
    #: Why some keys could not be explained further (one line each).
    notes: list[str] = field(default_factory=list)
    #: Seconds spent: the engine's block digests, this side's, in all.
    seconds: dict[str, float] = field(default_factory=dict)

    def causes(self) -> dict[str, str]:
        """key -> cause."""
        return {k: e.cause for k, e in self.keys.items()}

    def lines(self) -> list[str]:
        out = [e.line() for e in self.keys.values()]
        if self.left_out:
            out.append(f"({self.left_out} more mismatched keys not explained: raise the limit to see them)")
        return out + self.notes

    def details(self) -> dict[str, dict[str, Any]]:
        """key -> the report's per-key details (class, cause, where, ranges...)."""
        return {
            k: {
                "class": e.cls,
                "cause": e.cause,
                "where": e.where if not e.whole else "the whole tensor",
                "nbytes": e.nbytes,
                "ranges": [list(r) for r in e.ranges],
                "block_bytes": e.block_bytes,
                "blocks": e.blocks,
                "block_causes": {c: [list(r) for r in rs] for c, rs in e.block_causes.items()},
            }
            for k, e in self.keys.items()
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "keys": [e.to_json() for e in self.keys.values()],
            "left_out": self.left_out,
            "notes": self.notes,
            "seconds": self.seconds,
        }


#: ``fetch(keys, block_bytes)`` -> ``{key: {"digests", "nbytes", "shape",
#: "dtype", "block_bytes"}}``: the engine's block digests of those keys.
BlockFetcher = Callable[[list[str], int], Mapping[str, Mapping[str, Any]]]


@dataclass
class Version:
    """A previous version: its label (``step-11``), the digests it expected
    and, where they can still be had, its tensors."""

    label: str
    digests: Mapping[str, str]
    tensors: ExpectedTensors | None = None


class _Shards:
    """The same tensor's keys on the other tensor-parallel ranks, from one
    pass over the expected keys (for the parameters of ``keys`` only)."""

    def __init__(self, keys: Sequence[str], expected: Mapping[str, str]):
        wanted = {split_rank(k)[1] for k in keys}
        self._by: dict[tuple[tuple[str, ...], tuple[str, ...], str], list[tuple[str, str]]] = {}
        for other in expected:
            rank, name = split_rank(other)
            if name not in wanted:
                continue
            fields = rank.split(":")
            if len(fields) >= 4 and fields[3].startswith("tp"):
                place = (tuple(fields[:3]), tuple(fields[4:]), name)
                self._by.setdefault(place, []).append((fields[3], other))

    def of(self, key: str) -> list[tuple[str, str]]:
        """``[(tpJ, key of rank tpJ)]`` for ``key``'s tensor, ``key`` left out."""
        rank, name = split_rank(key)
        fields = rank.split(":")
        if len(fields) < 4 or not fields[3].startswith("tp"):
            return []
        return sorted(p for p in self._by.get((tuple(fields[:3]), tuple(fields[4:]), name), []) if p[1] != key)


def explain(
    mismatches: Mapping[str, str],
    current: Mapping[str, str],
    expected: Mapping[str, str],
    fetch: BlockFetcher | None,
    tensors: ExpectedTensors | None,
    *,
    history: Sequence[Version] = (),
    limit: int = DEFAULT_LIMIT,
) -> Explanation:
    """The explanation of ``mismatches`` (key -> class) between an engine's
    digests ``current`` and ``expected``, with the engine's block digests
    from ``fetch`` and the expected tensors from ``tensors`` (either may be
    ``None``: then only whole digests are compared). ``history``: previous
    versions, newest first."""
    import time

    started = time.perf_counter()
    out = Explanation()
    candidates = sorted(k for k, c in mismatches.items() if c in EXPLAINED_CLASSES and k in current and k in expected)
    chosen, out.left_out = candidates[:limit], max(0, len(candidates) - limit)
    shards = _Shards(chosen, expected)
    pending: list[KeyExplanation] = []
    for key in chosen:
        e = KeyExplanation(key, mismatches[key])
        out.keys[key] = e
        cause = _whole_cause(current[key], key, expected, history, shards)
        if cause is not None:
            e.cause, e.whole = cause, True
        else:
            pending.append(e)
    if pending:
        _explain_blocks(pending, current, fetch, tensors, history, expected, shards, out)
    out.seconds["total"] = time.perf_counter() - started
    return out


def _whole_cause(
    digest: str, key: str, expected: Mapping[str, str], history: Sequence[Version], shards: _Shards
) -> str | None:
    for version in history:
        if version.digests.get(key) == digest:
            return f"version:{version.label}"
    for tp, other in shards.of(key):
        if expected[other] == digest:
            return f"shard-of:{tp}"
    return None


class _Blocks:
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


#: Bytes of expected tensors hashed in one call while the engine's answer
#: is awaited: small enough that an answer that comes early saves the rest.
GROUP_BYTES = 128 << 20

#: An expected block not hashed because the engine holds zeros there and
#: this side does not: it differs, and no digest equals this.
NOT_HASHED = "(not hashed: non-zero here, zeros on the engine)"


def _groups(items: list[tuple[str, _Blocks]]) -> list[list[tuple[str, _Blocks]]]:
    """Consecutive keys in groups of about :data:`GROUP_BYTES`."""
    out: list[list[tuple[str, _Blocks]]] = []
    size = 0
    for item in items:
        if not out or size + item[1].nbytes > GROUP_BYTES:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item[1].nbytes
    return out


def _hash_expected(group: list[tuple[str, _Blocks]], engine: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
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
        zero = _zero_digests({end - start for start, end in b.ranges}) if theirs else {}
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


def _comparable(answer: Mapping[str, Any], b: _Blocks) -> bool:
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


def _zero_digests(sizes: set[int]) -> dict[int, str]:
    return {n: zero_digest(n) for n in sizes}


def _explain_blocks(
    pending: list[KeyExplanation],
    current: Mapping[str, str],
    fetch: BlockFetcher | None,
    tensors: ExpectedTensors | None,
    history: Sequence[Version],
    expected_digests: Mapping[str, str],
    shards: _Shards,
    out: Explanation,
) -> None:
    import time

    if tensors is None or fetch is None:
        why = "no expected tensors to compare with" if tensors is None else "the engine gives no block digests"
        for e in pending:
            e.note = why
        out.notes.append(f"where in each tensor: not told ({why})")
        return
    keys = [e.key for e in pending]
    started = time.perf_counter()
    try:
        got, candidates_given = _with_candidates(tensors, keys)
    except WeightCheckerError as err:
        for e in pending:
            e.note = _no_tensor(tensors, e.key)
        out.notes.append(f"where in each tensor: not told ({err})")
        return
    by_size: dict[int, list[KeyExplanation]] = {}
    blocks: dict[str, _Blocks] = {}
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
        blocks[e.key] = _Blocks(t, size)
        e.nbytes, e.blocks = blocks[e.key].nbytes, len(blocks[e.key].ranges)
        by_size.setdefault(size, []).append(e)
    # The engine hashes its blocks while this side hashes the expected ones,
    # a group of keys at a time: once the engine has answered, a block it
    # holds as zeros is scanned here, not hashed (see _hash_expected).
    engine: dict[str, Mapping[str, Any]] = {}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    refused_keys: set[str] = set()
    try:
        asked = {size: pool.submit(_fetch_all, fetch, [e.key for e in group], size) for size, group in by_size.items()}

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
        e.ranges = _merge([b.ranges[i] for i in differ])
        e.where = rows_text(e.ranges, e.shape or [], b.nbytes // max(1, _numel(e.shape)))
        if not differ:
            e.note = "every block equals the expected one: the tensor changed since its digest was taken"
            continue
        unexplained[key] = differ
    _match_candidates(unexplained, blocks, engine, got if candidates_given else None, history, shards, tensors, out)


def _no_tensor(source: ExpectedTensors, key: str) -> str:
    """A key's note where its expected tensor was not given, with why where the source says."""
    why = (getattr(source, "refused", None) or {}).get(key)
    return f"no expected tensor ({why})" if why else "no expected tensor"


def _numel(shape: Sequence[int] | None) -> int:
    n = 1
    for d in shape or []:
        n *= d
    return n


def _merge(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _fetch_all(
    fetch: BlockFetcher, keys: list[str], block_bytes: int
) -> tuple[dict[str, Mapping[str, Any]], dict[str, str]]:
    """The engine's block digests of ``keys``, asked :data:`MAX_KEYS` at a
    time (what the route takes); a request refused is asked again key by
    key, so that one key (a tensor smaller than expected) hides no other.
    ``(answers, key -> why refused)``."""
    answers: dict[str, Mapping[str, Any]] = {}
    refused: dict[str, str] = {}
    for at in range(0, len(keys), MAX_KEYS):
        chunk = keys[at : at + MAX_KEYS]
        try:
            answers.update(fetch(chunk, block_bytes))
            continue
        except WeightCheckerError as err:
            if len(chunk) == 1:
                refused[chunk[0]] = str(err)
                continue
        for key in chunk:
            try:
                answers.update(fetch([key], block_bytes))
            except WeightCheckerError as err:
                refused[key] = str(err)
    return answers, refused


def _runs(indices: Sequence[int]) -> list[list[int]]:
    """``[[3, 4, 5], [9]]``: sorted indices cut where they are not consecutive."""
    out: list[list[int]] = []
    for i in sorted(indices):
        if out and out[-1][-1] == i - 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _pick(table: Mapping[str, Mapping[str | None, Any]], which: str | None) -> Callable[[str], Any]:
    """``key -> table[key][which]`` (``None`` where absent or not computed)."""

    def pick(key: str) -> Any:
        t = (table.get(key) or {}).get(which)
        return None if t is DEFERRED else t

    return pick


def _resolve_deferred(
    table: dict[str, dict[str | None, Any]],
    keys: list[str],
    transforms: Sequence[str],
    source: ExpectedTensors,
    out: Explanation,
) -> None:
    """Where the first of ``transforms`` was left to a later call for one of
    ``keys`` (it needs the transformed weights loaded again), one call now
    gives it and every later transform left so, for those keys."""
    first = transforms[0]
    wanted = [k for k in keys if (table.get(k) or {}).get(first) is DEFERRED]
    if not wanted:
        return
    names = [t for t in transforms if any(table[k].get(t) is DEFERRED for k in wanted)]
    try:
        more = source.tensors(wanted, names)
    except WeightCheckerError as err:
        more = {}
        out.notes.append(f"{', '.join(names)}: not computed ({err})")
    for k in wanted:
        for t in names:
            if table[k].get(t) is DEFERRED:
                got = (more.get(k) or {}).get(t)
                if got is None:
                    del table[k][t]
                else:
                    table[k][t] = got


def _match_candidates(
    unexplained: dict[str, list[int]],
    blocks: dict[str, _Blocks],
    engine: Mapping[str, Mapping[str, Any]],
    given: Mapping[str, Mapping[str | None, Any]] | None,
    history: Sequence[Version],
    shards_of: _Shards,
    source: ExpectedTensors,
    out: Explanation,
) -> None:
    """Names, block by block, the first candidate whose block digest equals
    the engine's; candidates are computed only while blocks remain (the
    transformed ones are in ``given`` where the source gave them with the
    expected tensors)."""
    found: dict[str, dict[int, str]] = {k: {} for k in unexplained}
    # Keys a candidate computed from the weights a block at a time (after the
    # recompute checked them) matched: their weights are checked again at the end.
    read_late: set[str] = set()

    def remaining() -> dict[str, list[int]]:
        return {k: [i for i in idx if i not in found[k]] for k, idx in unexplained.items() if len(found[k]) < len(idx)}

    def try_candidate(name: str, tensor_of: Callable[[str], Any]) -> None:
        # The first unexplained block of each run of them is hashed; the rest
        # of a run only where that one matched (a dropped bucket, a stale
        # half: a cause holds for a run). A run a candidate matches only past
        # its first block stays unexplained there: less said, never wrong.
        # A key's later runs are tried only where one of its first
        # PROBE_RUNS matched: changes scattered over a tensor (no cause)
        # cost a few blocks per candidate, not half the tensor.
        flats: dict[str, Any] = {}
        later: dict[str, list[list[int]]] = {}
        runs: list[tuple[str, list[int]]] = []
        for key, idx in remaining().items():
            t = tensor_of(key)
            if t is None:
                continue
            lazy = hasattr(t, "block")  # computed a block at a time (LazyTransform, the recompute's LazyPieces)
            flat = t if lazy else flat_bytes(t)
            if (int(flat.nbytes) if lazy else int(flat.numel())) != blocks[key].nbytes:
                continue
            flats[key] = flat
            cut = _runs(idx)
            runs += [(key, run) for run in cut[:PROBE_RUNS]]
            later[key] = cut[PROBE_RUNS:]
        try:  # a candidate computed a block at a time reads its weights now: they may have changed
            rest: list[tuple[str, int]] = []

            def probe(runs: list[tuple[str, list[int]]]) -> set[str]:
                hit: set[str] = set()
                for (key, run), digest in zip(
                    runs, _hash_blocks([(flats[key], blocks[key].ranges[run[0]]) for key, run in runs]), strict=True
                ):
                    if digest == engine[key]["digests"][run[0]]:
                        found[key][run[0]] = name
                        rest.extend((key, i) for i in run[1:])
                        hit.add(key)
                return hit

            hit = probe(runs)
            probe([(key, run) for key in sorted(hit) for run in later[key]])
            for (key, i), digest in zip(
                rest, _hash_blocks([(flats[k], blocks[k].ranges[i]) for k, i in rest]), strict=True
            ):
                if digest == engine[key]["digests"][i]:
                    found[key][i] = name
        except WeightCheckerError as err:
            for hits in found.values():  # nothing of this candidate is kept
                for i in [i for i, c in hits.items() if c == name]:
                    del hits[i]
            out.notes.append(f"{name}: not tried: the weights changed while explaining ({err})")
            return
        read_late.update(k for k, f in flats.items() if isinstance(f, LazyPieces) and name in found[k].values())

    # All zeros: one digest per block size, no tensor.
    for key, idx in remaining().items():
        sizes = {b - a for a, b in (blocks[key].ranges[i] for i in idx)}
        zero = _zero_digests(sizes)
        for i in idx:
            a, b = blocks[key].ranges[i]
            if engine[key]["digests"][i] == zero[b - a]:
                found[key][i] = "zeros"
    for version in history:
        if not remaining() or version.tensors is None:
            continue
        try:
            theirs = version.tensors.tensors(list(remaining()), ())
        except WeightCheckerError as err:
            out.notes.append(f"version {version.label}: its tensors are not available ({err})")
            continue
        try_candidate(f"version:{version.label}", _pick(theirs, None))
    shards: dict[str, list[tuple[str, str]]] = {k: shards_of.of(k) for k in unexplained}
    for tp in sorted({tp for pairs in shards.values() for tp, _ in pairs}):
        if not remaining():
            break
        wanted = {k: other for k in remaining() for t, other in shards[k] if t == tp}
        if not wanted:
            continue
        try:
            others = {k: v.get(None) for k, v in source.tensors(sorted(set(wanted.values())), ()).items()}
        except WeightCheckerError as err:
            out.notes.append(f"{tp}'s shards are not available ({err})")
            continue
        try_candidate(f"shard-of:{tp}", _pick({k: {None: others.get(o)} for k, o in wanted.items()}, None))
    if remaining():
        transformed: dict[str, dict[str | None, Any]] = {}
        if given is not None:
            transformed = {k: dict(v) for k, v in given.items()}
        else:
            try:  # computed only now, for the keys still unexplained: one call (each checks its tensors once)
                transformed = {k: dict(v) for k, v in source.tensors(sorted(remaining()), TRANSFORMS).items()}
            except WeightCheckerError as err:
                out.notes.append(f"the transformed candidates were not computed ({err})")
        for at, name in enumerate(TRANSFORMS):
            if not remaining():
                break
            _resolve_deferred(transformed, sorted(remaining()), TRANSFORMS[at:], source, out)
            try_candidate(name, _pick(transformed, name))
        del transformed
    if read_late and callable(getattr(source, "confirm", None)):
        try:  # the weights still give the expected digests: the bytes read in between were theirs
            source.confirm(sorted(read_late))  # type: ignore[attr-defined]
        except WeightCheckerError as err:
            for key in read_late:
                for i in [i for i, c in found[key].items() if c in TRANSFORMS]:
                    del found[key][i]
            out.notes.append(f"the transformed candidates are not named: the weights changed while explaining ({err})")
    for key, idx in unexplained.items():
        e = out.keys[key]
        by_cause: dict[str, list[tuple[int, int]]] = {}
        for i in idx:
            by_cause.setdefault(found[key].get(i, "unknown"), []).append(blocks[key].ranges[i])
        e.block_causes = {c: _merge(r) for c, r in by_cause.items()}
        named = [c for c in e.block_causes if c != "unknown"]
        if len(e.block_causes) == 1:
            e.cause = next(iter(e.block_causes))
            e.whole = e.cause != "unknown" and len(idx) == len(blocks[key].ranges)
        elif named:
            e.cause = "mixed"


def _merge_answers(answers: Any, source: str) -> dict[str, Mapping[str, Any]]:
    """One map of every worker's ``weight_checker_block_digests`` answer; an
    error a worker reports is raised, naming the key."""
    from weight_checker.errors import VerifyError

    if not isinstance(answers, list) or not all(isinstance(a, dict) for a in answers):
        raise VerifyError("block digests", source, f"unexpected answer {str(answers)[:200]}")
    out: dict[str, Mapping[str, Any]] = {}
    for answer in answers:
        errors = answer.get("errors") or {}
        if errors:
            key = min(errors)
            raise VerifyError("block digests", source, f"{key}: {errors[key]}")
        out.update(answer.get("blocks") or {})
    return out


def llm_fetcher(engine: Any) -> BlockFetcher:
    """Block digests from an in-process ``vllm.LLM`` (every worker, through
    ``collective_rpc``; this package's plugin gives the worker method)."""

    def fetch(keys: list[str], block_bytes: int) -> dict[str, Mapping[str, Any]]:
        from weight_checker.errors import VerifyError

        try:
            answers = engine.collective_rpc("weight_checker_block_digests", args=(keys, block_bytes))
        except Exception as e:  # an engine without the plugin's method, or a worker that failed
            raise VerifyError("block digests", "in-process engine", f"collective_rpc failed: {e}") from e
        return _merge_answers(answers, "in-process engine")

    return fetch


#: Why a server gives no block digests (vLLM's own route knows only its three actions).
NO_BLOCK_ROUTE = (
    "the server's /weight_checker gives no block digests (vLLM's built-in route): start it with "
    "VLLM_PLUGINS=weight_checker,weight_checker_route to see where in each tensor"
)


def http_fetcher(url: str, *, api_key: str | None = None, timeout: float = 600.0) -> BlockFetcher:
    """Block digests from a server through this package's route
    (``{"action": "block_digests", "keys": [...], "block_bytes": B}``)."""

    def fetch(keys: list[str], block_bytes: int) -> dict[str, Mapping[str, Any]]:
        from weight_checker.errors import HttpError, VerifyError
        from weight_checker.httpclient import api_key_from_env, post_json

        body = {"action": "block_digests", "keys": keys, "block_bytes": block_bytes}
        try:
            answer = post_json(url, "/weight_checker", body, timeout=timeout, api_key=api_key_from_env(api_key))
        except HttpError as e:
            own_route = "'action' must be one of" in e.message  # this package's route, too old for it
            vllms_route = "literal_error" in e.message or "Input should be 'checksum'" in e.message
            message = NO_BLOCK_ROUTE if (own_route or vllms_route) and e.status == 400 else e.message
            raise VerifyError("block digests", url, message) from e
        blocks = answer.get("block_digests") if isinstance(answer, dict) else None
        if not isinstance(blocks, dict):
            raise VerifyError("block digests", url, f"unexpected answer {str(answer)[:200]}")
        return blocks

    return fetch


class ExpectedSource:
    """The expected tensors of :func:`weight_checker.expected_digests`'
    result, recomputed for the named keys only
    (:func:`weight_checker.expected.recompute.expected_tensors`: every
    tensor it gives hashes to the expected digest, else it refuses)."""

    def __init__(self, expected: Any):
        self.expected = expected
        #: Why a key's expected tensor could not be given (the explanation's note for it).
        self.refused: dict[str, str] = {}

    def tensors(self, keys: Sequence[str], transforms: Sequence[str]) -> Mapping[str, Mapping[str | None, Any]]:
        # Asked for transforms, the explanation uses only the transformed
        # tensors (new tensors of their own, or computed a block at a time
        # where the transform is elementwise); the untransformed, checked
        # against its digest again, is not kept: where it is one piece of a
        # weight no copy of it is made (fused or strided ones are copied).
        return self._each(keys, transforms, copy=not transforms)

    def with_candidates(self, keys: Sequence[str]) -> Table:
        """The expected tensors (copies: hashed in blocks later, while the
        trainer may run) and the transformed candidates that need no second
        load of the weights (the elementwise ones of parameters tiled by the
        weights' elements, computed a block at a time when tried), from one
        load and one check of the weights, against a second load and check
        of every tensor when asked for later. A candidate that needs the
        transformed weights loaded again (a transposed square weight, an
        elementwise one through the loader's own conversion) is
        :data:`~weight_checker.expected.recompute.DEFERRED`: computed only
        if blocks are still unexplained when it is tried."""
        return self._each(keys, TRANSFORMS, copy=True, defer=True)

    def _each(self, keys: Sequence[str], transforms: Sequence[str], copy: bool, defer: bool = False) -> Table:
        from weight_checker.expected.recompute import expected_tensors

        for key in keys:
            self.refused.pop(key, None)
        try:
            return expected_tensors(self.expected, list(keys), transforms, copy=copy, lazy=True, defer=defer)
        except WeightCheckerError as e:
            if len(keys) == 1:
                self.refused[keys[0]] = str(e)
                raise
        # One key it cannot give must not hide the others'.
        out: dict[str, Mapping[str | None, Any]] = {}
        first: WeightCheckerError | None = None
        for key in keys:
            try:
                out.update(expected_tensors(self.expected, [key], transforms, copy=copy, lazy=True, defer=defer))
            except WeightCheckerError as e:
                self.refused[key] = str(e)
                first = first or e
        if not out and first is not None:
            raise first
        return out

    def confirm(self, keys: Sequence[str]) -> None:
        """Raises unless the weights still give the expected digests of
        ``keys`` (recomputed and hashed again, no copy kept)."""
        from weight_checker.expected.recompute import expected_tensors

        expected_tensors(self.expected, list(keys), copy=False)


def source_for(expected: Any) -> ExpectedTensors | None:
    """Where the expected tensors of ``expected`` come from: an
    :class:`ExpectedTensors` as given, expected digests that can recompute
    their tensors, else ``None`` (digests only: a manifest)."""
    if expected is None:
        return None
    if callable(getattr(expected, "tensors", None)):
        return expected  # type: ignore[no-any-return]
    try:
        from weight_checker.expected.recompute import can_recompute
    except ImportError:
        return None
    return ExpectedSource(expected) if can_recompute(expected) else None


def versions_from(history: Sequence[Any]) -> list[Version]:
    """Previous versions, newest first, from expected digests (labelled by
    their ``weight_version``, else ``previous-1``, ``previous-2``...) or
    ``(label, expected digests)`` pairs."""
    out = []
    for i, item in enumerate(history):
        label, digests = item if isinstance(item, tuple) else (None, item)
        label = label or getattr(digests, "weight_version", None) or f"previous-{i + 1}"
        out.append(Version(str(label), digests, source_for(digests)))
    return out


def fetcher_for(target: Any, engine: str) -> BlockFetcher | None:
    """How to ask ``engine`` of a verify target for block digests: this
    package's route over HTTP, the worker method over ``collective_rpc`` in
    process (an ``LLM``, or an ``AsyncLLM`` on its event loop) or on a Ray
    actor; ``None`` where neither can be reached."""
    from weight_checker.verify.targets.async_engines import AsyncLLMTarget
    from weight_checker.verify.targets.engines import RpcTarget
    from weight_checker.verify.targets.http import HttpTarget

    if isinstance(target, HttpTarget):
        return http_fetcher(engine, api_key=target.api_key, timeout=target.timeout)
    if isinstance(target, RpcTarget):
        handle = target.engines[engine]

        def fetch(keys: list[str], block_bytes: int) -> dict[str, Mapping[str, Any]]:
            answers = handle.rpc("weight_checker_block_digests", (keys, block_bytes), "block digests")
            return _merge_answers(answers, engine)

        return fetch
    if isinstance(target, AsyncLLMTarget):

        def fetch_async(keys: list[str], block_bytes: int) -> dict[str, Mapping[str, Any]]:
            answers = target.rpc(engine, "weight_checker_block_digests", (keys, block_bytes), "block digests")
            return _merge_answers(answers, engine)

        return fetch_async
    return None


def explain_engines(
    per_engine: Mapping[str, Mapping[str, str]],
    mismatches: Mapping[str, Mapping[str, str]],
    reference: Mapping[str, str],
    fetchers: Mapping[str, BlockFetcher | None],
    tensors: ExpectedTensors | None,
    *,
    history: Sequence[Version] = (),
    limit: int = DEFAULT_LIMIT,
    show: Callable[[str, str], str] = lambda engine, key: key,
) -> Explanation:
    """:func:`explain` engine by engine (``mismatches``: engine -> key ->
    class), one explanation keyed as ``show(engine, key)`` shows them, the
    limit shared."""
    out = Explanation()
    left = limit
    for engine, held in per_engine.items():
        mine = mismatches.get(engine) or {}
        if not mine:
            continue
        found = explain(mine, held, reference, fetchers.get(engine), tensors, history=history, limit=max(left, 0))
        left -= len(found.keys)
        out.left_out += found.left_out
        for key, e in found.keys.items():
            e.key = show(engine, key)
            out.keys[e.key] = e
        out.notes += [n for n in found.notes if n not in out.notes]
        for name, seconds in found.seconds.items():
            out.seconds[name] = out.seconds.get(name, 0.0) + seconds
    return out
