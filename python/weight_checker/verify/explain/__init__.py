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
   blocks still unexplained, and is only computed while some are.

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

import hashlib
import struct
import time
from collections.abc import Callable, Mapping, Sequence

from weight_checker.errors import WeightCheckerError
from weight_checker.verify.explain.blocks import GROUP_BYTES, NOT_HASHED, compare_blocks
from weight_checker.verify.explain.candidates import PROBE_RUNS, Shards, match_candidates, whole_cause
from weight_checker.verify.explain.fetchers import (
    NO_BLOCK_ROUTE,
    BlockFetcher,
    fetch_all,
    fetcher_for,
    http_fetcher,
    llm_fetcher,
)
from weight_checker.verify.explain.model import ExpectedTensors, Explanation, KeyExplanation, Table, Version
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
    if pending:
        differing = compare_blocks(pending, fetch, tensors, out)
        if differing is not None:
            match_candidates(differing, history, shards, out)
    _quantized_pairs(out, mismatches, current, expected)
    _quantized_zeros(out, current, fetch, tensors)
    out.seconds["total"] = time.perf_counter() - started
    return out


def _quantized_pairs(
    out: Explanation, mismatches: Mapping[str, str], current: Mapping[str, str], expected: Mapping[str, str]
) -> None:
    """A quantized layer's weight and its per-output-channel scale
    (``X.weight`` and ``X.weight_scale`` of shape ``[N, 1]``), explained
    together: the scale's differing rows are the output channels (rows of
    the trainer's tensor) that changed; whether the weight's bytes differ
    too, or only the scale; and, for a weight stored transposed (``[K, N]``,
    vLLM's FP8 layout), that its output channels are its columns."""
    for key, scale in out.keys.items():
        if not key.endswith(".weight_scale") or scale.shape is None or scale.shape[1:] not in ([], [1]):
            continue
        channels = (scale.where or "").replace("rows ", "output channels ", 1) or None
        base = key.removesuffix("_scale")
        weight = out.keys.get(base)
        if base not in mismatches and base in current and base in expected:
            scale.note = f"{channels or 'its scales'}: only the scale differs (the weight bytes are as expected)"
            continue
        if base not in mismatches:  # no weight key to compare (held outside the parameters?)
            scale.note = channels
            continue
        scale.note = f"{channels or 'its scales'}; the weight bytes differ too"
        if weight is None or not (weight.dtype or "").startswith("float8"):  # vLLM keeps FP8 weights as [K, N]
            continue
        if weight.shape and len(weight.shape) == 2 and weight.shape[1] == scale.shape[0]:
            weight.note = f"stored [K, N]: its output channels are its columns; {channels or 'see its scale'}"


#: The scale vLLM's online FP8 gives an output channel whose amax is 0 (a
#: zero row): its floor, ``1 / (448 * 512)`` in fp32.
FP8_SCALE_FLOOR = struct.pack("<f", 1.0 / (448.0 * 512.0))


def _quantized_zeros(
    out: Explanation, current: Mapping[str, str], fetch: BlockFetcher | None, tensors: ExpectedTensors | None
) -> None:
    """Zeros through quantization: an online FP8 layer whose trainer rows
    were zero holds its floor scale in those output channels. The engine's
    scale is hashed row by row (four bytes a row), the rows at the floor
    are zeroed in the expected weights, the rank is recomputed through vLLM,
    and ``zeros`` is named only where both the weight's and the scale's
    digests then equal the engine's."""
    zeroed_digests = getattr(tensors, "digests_with_channels_zeroed", None)
    if zeroed_digests is None or fetch is None:
        return
    floor = hashlib.sha256(FP8_SCALE_FLOOR).hexdigest()
    scales = [
        key
        for key, scale in out.keys.items()
        if key.endswith(".weight_scale")
        and scale.cause == "unknown"
        and scale.dtype == "float32"
        and scale.shape is not None
        and len(scale.shape) == 2
        and scale.shape[1] == 1
        and key.removesuffix("_scale") in current
    ]
    if not scales:
        return
    answers, _ = fetch_all(fetch, scales, 4)  # four bytes a row; a refusal: no rows, nothing named
    zeros: dict[str, list[int]] = {}
    for key in scales:
        rows = [i for i, d in enumerate((answers.get(key) or {}).get("digests") or []) if d == floor]
        if rows:
            zeros[key.removesuffix("_scale")] = rows
    if not zeros:
        return
    try:
        found = zeroed_digests(zeros)
    except WeightCheckerError as err:
        out.notes.append(f"zeros through quantization: not told ({err})")
        return
    for base, rows in zeros.items():
        key = base + "_scale"
        if found.get(key) != current.get(key) or found.get(base) != current.get(base):
            continue
        of = out.keys[key].shape[0]  # type: ignore[index]
        for k in (key, base):
            e = out.keys.get(k)
            if e is None:
                continue
            e.cause = "zeros"
            e.note = f"output channels {_row_spans(rows)} of {of} were zero before quantization" + (
                "; stored [K, N]: they are its columns" if k == base and (e.dtype or "").startswith("float8") else ""
            )


def _row_spans(rows: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` as ``"3-5, 9"``."""
    spans: list[list[int]] = []
    for r in rows:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)


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
