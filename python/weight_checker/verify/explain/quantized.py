"""Explanations at the quantized level: which output channels (rows of the
trainer's tensor) a quantized layer's differing keys hold, whether only the
scale or the weight bytes too, and zeros and another rank's shard through
FP8 quantization.

vLLM's layouts on the CPU (``docs/quantized.md``):

- FP8 per channel: ``weight`` float8 ``[K, N]`` (a transposed view) and
  ``weight_scale`` fp32 ``[N, 1]``: the scale's rows are the output channels;
- INT4 (AWQ, GPTQ, compressed-tensors W4A16), repacked by vLLM's CPU kernel:
  the packed weight int32 ``[N / 16, K * 2]``, each row 16 output channels;
  the scales ``[K / group, N]``, whose columns are the output channels; AWQ's
  zero points int32 ``[K / group, N / 8]``, eight output channels an int32.

The channels are found from block digests only (the engine's against the
expected tensors'), never guessed from a layout the shapes do not show.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from weight_checker.errors import WeightCheckerError
from weight_checker.hashing.blocks import MAX_BLOCKS, block_digests
from weight_checker.keys import split_rank
from weight_checker.verify.explain.fetchers import BlockFetcher, fetch_all
from weight_checker.verify.explain.model import ExpectedTensors, Explanation, KeyExplanation

#: The packed INT4 weight's and its scale's names: vLLM's AWQ / GPTQ
#: parameters, then compressed-tensors'.
PACKED_WEIGHTS = ("qweight", "weight_packed")
INT4_SCALES = ("scales", "weight_scale")
INT4_ZEROS = ("qzeros", "weight_zero_point")

#: Output channels in one row of vLLM's CPU INT4 layout
#: (``CPUWNA16LinearKernel._process_gptq_weights_w4a16``).
CHANNELS_A_ROW = 16


def quantized_pairs(
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


def quantized_zeros(
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
    except Exception as err:  # vLLM's own, too: the causes found so far stand
        out.notes.append(f"zeros through quantization: not told ({_one_line(err)})")
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
            e.note = f"output channels {row_spans(rows)} of {of} were zero before quantization" + (
                "; stored [K, N]: they are its columns" if k == base and (e.dtype or "").startswith("float8") else ""
            )


def quantized_shard_of(out: Explanation, current: Mapping[str, str], tensors: ExpectedTensors | None) -> None:
    """A row-parallel online FP8 layer that one rank loaded from another's
    shard: every rank quantizes by the amax all-reduced over what the ranks
    hold, so that rank's bytes are no rank's expected ones, and the other
    ranks' change too. Its sign: two ranks of the layer hold the same FP8
    bytes (one loaded the other's columns). Each way round, the stage is
    recomputed through vLLM with that layer's loader narrowed at the other
    rank, and a cause is named only where every rank's weight and scale
    digests then equal the engine's: ``shard-of:tp{s}`` on the rank that
    loaded tp{s}'s shard, ``reduced-with:tp{r}`` on the others."""
    recompute = getattr(tensors, "digests_with_shard_of", None)
    if recompute is None:
        return
    asked = set()  # (rank but tp, name) of each FP8 weight left unknown
    for key, e in out.keys.items():
        # An FP8 weight with its scale (the dtype is known once blocks were compared).
        fp8 = (e.dtype or "").startswith("float8") or (e.dtype is None and key + "_scale" in current)
        if e.cause == "unknown" and key.endswith(".weight") and fp8:
            asked.add(_beside_tp(key))
    # Every rank's weight key of those layers, shown or not (the explanation's
    # limit may have left a rank's keys out): (rank but tp, name) -> tp -> key.
    layers: dict[tuple[str, str], dict[int, str]] = {}
    for key in current:
        fields = split_rank(key)[0].split(":")
        if key.endswith(".weight") and len(fields) >= 4 and fields[3].startswith("tp") and _beside_tp(key) in asked:
            layers.setdefault(_beside_tp(key), {})[int(fields[3].removeprefix("tp"))] = key
    # Per layer, the first two ranks holding the same bytes; tried both ways
    # round, every layer at once (a layer's quantization reads only its own
    # weight and amaxes): a rank above loading a rank below's first.
    pairs = []
    for keys in layers.values():
        same = next(
            ((a, b) for a in keys for b in keys if a < b and current.get(keys[a]) == current.get(keys[b])), None
        )
        if same is not None:
            pairs.append((keys, *same))
    for upward in (False, True):
        ways = [(keys, a, b) if upward else (keys, b, a) for keys, a, b in pairs]
        if not ways:
            return
        try:
            found = recompute({keys[r]: s for keys, r, s in ways})
        except Exception as err:  # vLLM's own, too: the causes found so far stand
            out.notes.append(f"another rank's shard through quantization: not told ({_one_line(err)})")
            return
        pairs = [
            (keys, a, b)
            for (keys, a, b), (_, r, s) in zip(pairs, ways, strict=True)
            if not _name_shard_of(out, keys, r, s, found, current)
        ]


def _beside_tp(key: str) -> tuple[str, str]:
    """A key's rank without its tp field, and its name."""
    prefix, name = split_rank(key)
    fields = prefix.split(":")
    return ":".join(fields[:3] + fields[4:]), name


def _name_shard_of(
    out: Explanation, keys: Mapping[int, str], r: int, s: int, found: Mapping[str, str], current: Mapping[str, str]
) -> bool:
    """Names a layer's keys (tp -> weight key) as rank ``r`` holding tp
    ``s``'s shard, where ``found`` (the recompute) gives every rank's weight
    and scale digest the engine holds; else ``False``, nothing named."""
    some = next(iter(keys.values()))
    place, name = _beside_tp(some)
    # Every rank's weight and scale of the layer, the ones that matched too.
    layer = [k for k in found if _beside_tp(k) in ((place, name), (place, name + "_scale"))]
    if not layer or not all(found[k] == current.get(k) for k in layer):
        return False
    for t, key in keys.items():
        cause = f"shard-of:tp{s}" if t == r else f"reduced-with:tp{r}"
        note = (
            f"loaded tp{s}'s columns of this row-parallel layer"
            if t == r
            else f"its scales are the amax all-reduced with tp{r}, which loaded tp{s}'s columns"
        )
        for k in (key, key + "_scale"):
            held = out.keys.get(k)
            if held is not None and held.cause == "unknown":
                held.cause = cause
                held.note = f"{note}; recomputed through vLLM, the digests equal" + (
                    f" ({held.note})" if held.note else ""
                )
    return True


def _one_line(err: BaseException) -> str:
    """An error in one line: ours as it says it, another with its type."""
    said = " ".join(str(err).split())
    return said if isinstance(err, WeightCheckerError) else f"{type(err).__name__}: {said}"


def row_spans(rows: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` as ``"3-5, 9"``."""
    spans: list[list[int]] = []
    for r in rows:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)


def int4_channels(
    out: Explanation, mismatches: Mapping[str, str], fetch: BlockFetcher | None, tensors: ExpectedTensors | None
) -> None:
    """The output channels an INT4 layer's differing keys hold, in vLLM's
    CPU layout (the packed weight's rows of 16 channels, the scales' and
    zero points' columns), each from the engine's block digests against the
    expected tensor's: a block is one row of the packed weight, or a run of
    elements of the others (one element while the blocks stay within the
    route's limit). The channels are the rank's own (for a row-parallel
    layer, every rank holds all of them: the trainer's rows). Told only for
    a layer whose packed weight and scale both differ, in that layout, and
    for a key the block comparison found no other difference in (a dtype or
    a shape: its note stays)."""
    if fetch is None or tensors is None:
        return
    layers: dict[str, dict[str, KeyExplanation]] = {}
    for key, e in out.keys.items():
        base, _, leaf = key.rpartition(".")
        if leaf in PACKED_WEIGHTS + INT4_SCALES + INT4_ZEROS and key in mismatches and e.note is None:
            layers.setdefault(base, {})[leaf] = e
    layers = {b: p for b, p in layers.items() if _has(p, PACKED_WEIGHTS) and _has(p, INT4_SCALES)}
    if not layers:
        return
    keys = [e.key for parts in layers.values() for e in parts.values()]
    try:
        held = {k: v.get(None) for k, v in tensors.tensors(keys, []).items()}
    except WeightCheckerError as err:
        out.notes.append(f"output channels of the INT4 layers: not told ({err})")
        return
    for parts in layers.values():
        packed = next(parts[p] for p in PACKED_WEIGHTS if p in parts)
        scale = next(parts[s] for s in INT4_SCALES if s in parts)
        w, s = held.get(packed.key), held.get(scale.key)
        if w is None or s is None or w.dim() != 2 or s.dim() != 2 or w.shape[0] * CHANNELS_A_ROW != s.shape[1]:
            continue
        n = int(s.shape[1])
        found = {packed.key: _differing_channels(fetch, packed.key, w, CHANNELS_A_ROW, by_row=True)}
        found[scale.key] = _differing_channels(fetch, scale.key, s, 1)
        zero = next((parts[z] for z in INT4_ZEROS if z in parts), None)
        z = held.get(zero.key) if zero is not None else None
        if zero is not None and z is not None and z.dim() == 2 and z.shape[1] * 8 == n:
            found[zero.key] = _differing_channels(fetch, zero.key, z, 8)
        for key, told in found.items():
            if told is None:
                continue
            channels, run = told
            what = {
                packed.key: f"{CHANNELS_A_ROW} output channels a row (vLLM's CPU INT4 layout)",
                scale.key: "its columns",
            }.get(key, "eight output channels an int32, in columns")
            if run > 1:
                what += f"; hashed {run} elements a block, so these hold the differing ones"
            out.keys[key].note = f"output channels {row_spans(channels)} of {n} on this rank ({what})"


def _has(parts: Mapping[str, Any], leaves: Sequence[str]) -> bool:
    return any(leaf in parts for leaf in leaves)


def _differing_channels(
    fetch: BlockFetcher, key: str, expected: Any, channels_each: int, *, by_row: bool = False
) -> tuple[list[int], int] | None:
    """The output channels where the engine's ``key`` differs from
    ``expected`` (2-D), and the elements a block held: ``by_row``, blocks of
    one row, each ``channels_each`` channels; otherwise each column is
    ``channels_each`` channels and a block is a run of elements, as short as
    :data:`~weight_checker.hashing.blocks.MAX_BLOCKS` allows (a run crossing
    a row covers the columns it touches). ``None`` where the engine's block
    digests could not be had or are not of a tensor like ``expected``."""
    rows, cols = int(expected.shape[0]), int(expected.shape[1])
    elements = cols if by_row else max(1, math.ceil(rows * cols / MAX_BLOCKS))
    size = elements * expected.element_size()
    answers, _ = fetch_all(fetch, [key], size)
    answer = answers.get(key) or {}
    engine = answer.get("digests")
    mine = block_digests([expected], [size], [key])[0]
    like = (
        answer.get("nbytes") in (None, expected.numel() * expected.element_size())
        and answer.get("shape") in (None, list(expected.shape))
        and answer.get("dtype") in (None, str(expected.dtype).removeprefix("torch."))
    )
    if not engine or not like or len(engine) != len(mine):
        return None
    differing: set[int] = set()
    for j, (a, b) in enumerate(zip(engine, mine, strict=True)):
        if a == b:
            continue
        if by_row:
            differing.update(range(j * channels_each, (j + 1) * channels_each))
            continue
        first, last = j * elements, min((j + 1) * elements, rows * cols) - 1
        columns = range(cols) if last - first + 1 >= cols else {i % cols for i in range(first, last + 1)}
        for c in columns:
            differing.update(range(c * channels_each, (c + 1) * channels_each))
    return sorted(differing), (1 if by_row else elements)
