"""Why a check failed (where in each tensor, the likely cause): :func:`explain` and :func:`explain_engines`.

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
   blocks still unexplained, and is only computed while some are;
3. at the quantized level (:mod:`.quantized`): the output channels a
   quantized layer's keys hold, and, recomputed through vLLM, the online
   FP8 causes that whole digests cannot show: ``zeros``, and a row-parallel
   layer one rank loaded from another's shard (``shard-of:tp{s}`` on it,
   ``reduced-with:tp{r}`` on the ranks whose all-reduced scales it changed).

A cause is named only where a candidate's digest equals the engine's: never
a guess. A key whose differing blocks match no candidate is ``unknown``; one
whose blocks match different candidates is ``mixed`` (each block range says
which). A correct update asks for nothing: this runs only on a mismatch.

Where each part lives: the explanation's model (:mod:`.model`), this
side's block digests compared with the engine's (:mod:`.blocks`), the
candidate causes tried on them (:mod:`.candidates`), where the
expected tensors and the transformed candidates come from
(:mod:`.sources`), how each kind of engine is asked for its block
digests (:mod:`.fetchers`). What callers import is re-exported here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from weight_checker.hashing.block_states import states_of
from weight_checker.verify.explain.blocks import GROUP_BYTES, NOT_HASHED, compare_blocks
from weight_checker.verify.explain.candidates import PROBE_RUNS, Shards, match_candidates, whole_cause
from weight_checker.verify.explain.chained import compare_chained
from weight_checker.verify.explain.fetchers import (
    NO_BLOCK_ROUTE,
    BlockFetcher,
    chains,
    fetcher_for,
    http_fetcher,
    llm_fetcher,
)
from weight_checker.verify.explain.model import ExpectedTensors, Explanation, KeyExplanation, Table, Version
from weight_checker.verify.explain.quantized import int4_channels, quantized_pairs, quantized_shard_of, quantized_zeros
from weight_checker.verify.explain.sources import (
    ExpectedSource,
    LazyTransform,
    TensorMap,
    applies,
    source_for,
    transform,
    versions_from,
)

# What callers have always imported from here, wherever it now lives.
__all__ = [
    "DEFAULT_LIMIT",
    "EXPLAINED_CLASSES",
    "GROUP_BYTES",
    "NOT_HASHED",
    "NO_BLOCK_ROUTE",
    "PROBE_RUNS",
    "BlockFetcher",
    "ExpectedSource",
    "ExpectedTensors",
    "Explanation",
    "KeyExplanation",
    "LazyTransform",
    "Table",
    "TensorMap",
    "Version",
    "applies",
    "explain",
    "explain_engines",
    "fetcher_for",
    "http_fetcher",
    "llm_fetcher",
    "source_for",
    "transform",
    "versions_from",
]

#: Keys explained by default (the first, in key order): each is hashed again
#: on the engine and on this side.
DEFAULT_LIMIT = 64


#: The classes whose keys both sides hold (a missing or unexpected key has
#: nothing to compare block by block).
EXPLAINED_CLASSES = ("changed", "stale", "wrong-shard", "untouched-since-reset")


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
    started = time.perf_counter()
    out = Explanation()
    candidates = sorted(k for k, c in mismatches.items() if c in EXPLAINED_CLASSES and k in current and k in expected)
    chosen, out.left_out = candidates[:limit], max(0, len(candidates) - limit)
    shards = Shards(chosen, expected)
    pending: list[KeyExplanation] = []
    for key in chosen:
        e = KeyExplanation(key, mismatches[key])
        out.keys[key] = e
        cause = whole_cause(current[key], key, expected, history, shards)
        if cause is not None:
            e.cause, e.whole = cause, True
        else:
            pending.append(e)
    # Keys whose chain states the expected digests recorded: the engine
    # tells which blocks differ from them, no expected tensor is read.
    recorded = states_of(expected) if chains(fetch) else {}
    chained = [e for e in pending if e.key in recorded]
    rest = [e for e in pending if e.key not in recorded]
    if chained:
        assert fetch is not None
        found, refused = compare_chained(chained, fetch, recorded, tensors, out)
        if found is not None and found.unexplained:
            match_candidates(found, history, shards, out)
        rest += refused  # no states from the engine for these: their block digests, as before
    if rest:
        differing = compare_blocks(rest, fetch, tensors, out)
        if differing is not None:
            match_candidates(differing, history, shards, out)
    quantized_pairs(out, mismatches, current, expected)
    int4_channels(out, mismatches, fetch, tensors)
    quantized_zeros(out, current, fetch, tensors)
    quantized_shard_of(out, current, tensors)
    out.seconds["total"] = time.perf_counter() - started
    return out


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
