"""The likely causes: candidates whose digests equal the engine's, whole (versions, shards) or block by block."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from weight_checker.errors import WeightCheckerError
from weight_checker.expected.transforms import DEFERRED, TRANSFORMS, LazyPieces
from weight_checker.hashing.block_states import states_of
from weight_checker.hashing.blocks import flat_bytes
from weight_checker.keys import split_rank
from weight_checker.verify.explain.blocks import Differing, candidate_digests, merge_ranges, zero_digests
from weight_checker.verify.explain.chained import candidate_states, state_matcher, tensor_matcher
from weight_checker.verify.explain.model import Explanation, Version

#: Runs of differing blocks of a key a candidate is tried on before its
#: later runs (all of them, once one of these matched).
PROBE_RUNS = 4


class Shards:
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


def whole_cause(
    digest: str, key: str, expected: Mapping[str, str], history: Sequence[Version], shards: Shards
) -> str | None:
    """The cause whose whole digest equals the engine's ``digest`` of ``key``
    (a previous version's, another rank's shard), else ``None``."""
    for version in history:
        if version.digests.get(key) == digest:
            return f"version:{version.label}"
    for tp, other in shards.of(key):
        if expected[other] == digest:
            return f"shard-of:{tp}"
    return None


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
    ask: Callable[[list[str], list[str]], Mapping[str, Mapping[str | None, Any]]],
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
        more = ask(wanted, names)
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


def _try_states(try_candidate: Callable[..., object], name: str, states: Mapping[str, Any], out: Explanation) -> None:
    """``try_candidate(name, states=states)``, an engine that refuses named in the notes."""
    try:
        try_candidate(name, states=states)
    except WeightCheckerError as err:
        out.notes.append(f"{name}: not tried from its recorded states: the engine refused ({err})")


def match_candidates(differing: Differing, history: Sequence[Version], shards_of: Shards, out: Explanation) -> None:
    """Names, block by block, the first candidate whose block digest equals
    the engine's; candidates are computed only while blocks remain (the
    transformed ones are in ``differing.given`` where the source gave them
    with the expected tensors)."""
    unexplained, blocks, engine = differing.unexplained, differing.blocks, differing.engine
    given, source = differing.given, differing.source
    found: dict[str, dict[int, str]] = {k: {} for k in unexplained}
    # Keys a candidate computed from the weights a block at a time (after the
    # recompute checked them) matched: their weights are checked again at the end.
    read_late: set[str] = set()

    def remaining() -> dict[str, list[int]]:
        return {k: [i for i in idx if i not in found[k]] for k, idx in unexplained.items() if len(found[k]) < len(idx)}

    chained = differing.chained

    def match_tensors(
        flats: Mapping[str, Any], base: Mapping[str, Any] | None, failed: set[str]
    ) -> Callable[[Sequence[tuple[str, int]]], list[bool]]:
        if chained is not None:  # each block continued from the expected state before it, as the engine did
            return tensor_matcher(differing, flats, base, failed)
        return lambda at: [
            d == engine[key]["digests"][i] for d, (key, i) in zip(candidate_digests(flats, blocks, at), at, strict=True)
        ]

    def try_candidate(
        name: str,
        tensor_of: Callable[[str], Any] | None = None,
        states: Mapping[str, Any] | None = None,
        base: Mapping[str, Any] | None = None,
    ) -> set[str]:
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
            if states is not None:  # known by its recorded states: the engine continues them
                if key not in states:
                    continue
            else:
                assert tensor_of is not None
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
        if not runs:
            return set()
        failed: set[str] = set()  # keys whose unchecked expected bytes did not check: not tried
        match = state_matcher(differing.fetch, states) if states is not None else match_tensors(flats, base, failed)
        try:  # a candidate computed a block at a time reads its weights now: they may have changed
            rest: list[tuple[str, int]] = []

            def probe(runs: list[tuple[str, list[int]]]) -> set[str]:
                hit: set[str] = set()
                if not runs:
                    return hit
                for (key, run), same in zip(runs, match([(key, run[0]) for key, run in runs]), strict=True):
                    if same:
                        found[key][run[0]] = name
                        rest.extend((key, i) for i in run[1:])
                        hit.add(key)
                return hit

            hit = probe(runs)
            probe([(key, run) for key in sorted(hit) for run in later[key]])
            for (key, i), same in zip(rest, match(rest) if rest else [], strict=True):
                if same:
                    found[key][i] = name
        except WeightCheckerError as err:
            for hits in found.values():  # nothing of this candidate is kept
                for i in [i for i, c in hits.items() if c == name]:
                    del hits[i]
            if states is not None:
                raise  # the engine refused: said as such by the caller
            out.notes.append(f"{name}: not tried: the weights changed while explaining ({err})")
            return set()
        for key in sorted(failed):  # nothing of this candidate is kept there: the caller asks again, checked
            for i in [i for i, c in found[key].items() if c == name]:
                del found[key][i]
        # Matched from the weights read late, or from expected tensors never hashed whole: checked at the end.
        late = [k for k, f in flats.items() if base is not None or isinstance(f, LazyPieces)]
        read_late.update(k for k in late if name in found[k].values())
        return failed

    # All zeros: one digest per block size, no tensor (chained: the engine said which of its blocks are zero).
    for key, idx in remaining().items():
        if chained is not None:
            found[key].update({i: "zeros" for i in idx if engine[key]["zeros"][i]})
            continue
        sizes = {b - a for a, b in (blocks[key].ranges[i] for i in idx)}
        zero = zero_digests(sizes)
        for i in idx:
            a, b = blocks[key].ranges[i]
            if engine[key]["digests"][i] == zero[b - a]:
                found[key][i] = "zeros"
    for version in history:
        with_states: Mapping[str, Any] = {}
        if chained is not None and remaining():  # its recorded states, where it has them: nothing recomputed
            recorded = states_of(version.digests)
            with_states = candidate_states(sorted(remaining()), blocks, recorded.get)
            if with_states:
                _try_states(try_candidate, f"version:{version.label}", with_states, out)
        untried = [k for k in remaining() if k not in with_states]
        if not untried or version.tensors is None:
            continue
        try:
            theirs = version.tensors.tensors(untried, ())
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
        if chained is not None:  # the other rank's recorded states: nothing recomputed
            other_states = {k: chained.get(o) for k, o in wanted.items()}
            with_states = candidate_states(sorted(wanted), blocks, other_states.get)
            if with_states:
                _try_states(try_candidate, f"shard-of:{tp}", with_states, out)
            wanted = {k: o for k, o in wanted.items() if k in remaining() and k not in with_states}
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
        # Chained, the expected tensors need no hash of their own: each block
        # a candidate is tried on is checked against the recorded states.
        unchecked = getattr(source, "unchecked", None) if chained is not None else None
        ask = unchecked if callable(unchecked) else source.tensors
        resolve = (lambda keys, names: unchecked(keys, names, defer=False)) if callable(unchecked) else source.tensors
        if given is not None:
            transformed = {k: dict(v) for k, v in given.items()}
        else:
            try:  # computed only now, for the keys still unexplained: one call (each checks its tensors once)
                transformed = {k: dict(v) for k, v in ask(sorted(remaining()), TRANSFORMS).items()}
            except WeightCheckerError as err:
                out.notes.append(f"the transformed candidates were not computed ({err})")
        for at, name in enumerate(TRANSFORMS):
            if not remaining():
                break
            _resolve_deferred(transformed, sorted(remaining()), TRANSFORMS[at:], resolve, out)
            base = {k: v.get(None) for k, v in transformed.items()} if callable(unchecked) else None
            failed = try_candidate(name, _pick(transformed, name), base=base)
            if failed:  # the unchecked load fell short of these keys (a MoE's experts left zero): asked again, checked
                try:
                    again = {k: dict(v) for k, v in source.tensors(sorted(failed), [name]).items()}
                except WeightCheckerError as err:
                    out.notes.append(f"{name}: not tried on {', '.join(sorted(failed))} ({err})")
                else:
                    try_candidate(name, _pick(again, name))
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
        e.block_causes = {c: merge_ranges(r) for c, r in by_cause.items()}
        named = [c for c in e.block_causes if c != "unknown"]
        if len(e.block_causes) == 1:
            e.cause = next(iter(e.block_causes))
            e.whole = e.cause != "unknown" and len(idx) == len(blocks[key].ranges)
        elif named:
            e.cause = "mixed"
