"""The tensors behind a quantized engine's expected digests, rebuilt for an
explanation (:mod:`weight_checker.verify.explain`): the expected tensors of
some keys, and the digests the ranks would hold had the trainer sent some
output channels as zeros. Each rank holding the keys is built, loaded and
processed by vLLM again from the same weights (:mod:`.quantized`), with the
amax reduction reproduced, and only when a check failed."""

from __future__ import annotations

from typing import Any

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.vllm import online_process
from weight_checker.expected.vllm.amax_reduce import AmaxReduce
from weight_checker.expected.vllm.quantized import (
    ONLINE,
    drop_tensors,
    load_and_process,
    rank_digests,
)


def quantized_digests_class() -> type:
    """:class:`QuantizedExpectedDigests`, made on first use (it subclasses
    the manifest's class, which this module must not import at its top)."""
    global _CLASS
    if _CLASS is None:
        from weight_checker.expected.manifest import ExpectedDigests

        class QuantizedExpectedDigests(ExpectedDigests):  # type: ignore[misc,valid-type]
            """Expected digests of a quantized engine; :meth:`tensors` gives
            the tensors behind them again (the explanation's source): the
            ranks holding the keys rebuilt from the same weights, loaded and
            processed by vLLM with the reduced amaxes kept from the first
            computation, each checked against its digest."""

            def tensors(self, keys: Any, transforms: Any) -> dict[str, dict[str | None, Any]]:
                if transforms:  # no transform of a quantized tensor is a cause: nothing to rebuild for
                    return {key: {} for key in keys}
                # The explanation asks for a layer's keys more than once (blocks, then
                # its output channels): the last rebuild's tensors are kept for that.
                last = getattr(self, "_last_tensors", {})
                if not all(key in last for key in keys):
                    last = _tensors_again(self, list(keys))
                    object.__setattr__(self, "_last_tensors", last)
                return {key: last[key] for key in keys}

            def digests_with_channels_zeroed(self, zeros: dict[str, list[int]]) -> dict[str, str]:
                """The digests had the trainer sent these output channels as
                zeros (weight key -> the rank's rows of the layer's weight):
                every key of the ranks holding them, recomputed through vLLM."""
                return _zeroed_again(self, zeros)

            def digests_with_shard_of(self, shards: dict[str, int]) -> dict[str, str]:
                """The digests had each weight key's layer loaded on its rank
                from the shard of another tp rank (weight key -> that rank):
                every key of its stage's ranks, recomputed through vLLM."""
                return _shard_of_again(self, shards)

        _CLASS = QuantizedExpectedDigests
    return _CLASS


_CLASS: type | None = None


def _rebuildable(expected: Any, keys: list[str]) -> tuple[Any, Any]:
    """What a rebuild of ``expected`` needs (the ranks' config and reduction,
    the weights' recipe), or the refusal naming ``keys``."""
    state = getattr(expected, "_quantized", None)
    recipe = getattr(expected, "_recompute", None)
    if state is None or recipe is None or recipe.refusal:
        why = getattr(recipe, "refusal", None) or "digests read from a manifest"
        raise ExpectedDigestsError(f"{', '.join(keys)}: cannot recompute the expected tensors: {why}")
    return state, recipe


def _tensors_again(expected: Any, keys: list[str]) -> dict[str, dict[str | None, Any]]:
    from weight_checker.expected.rank import Rank
    from weight_checker.expected.recipe import pairs_for, read_again
    from weight_checker.expected.vllm.rank_model import LOCK
    from weight_checker.expected.weights import Pass, WeightsSource
    from weight_checker.hashing.digests import checksum_sized
    from weight_checker.keys import split_rank

    state, recipe = _rebuildable(expected, keys)
    config, tp, pp, dp, reduce = state
    wanted: dict[tuple[int, int], list[str]] = {}
    for key in keys:
        if key not in expected:
            raise ExpectedDigestsError(f"{key}: not a key of these expected digests")
        fields = split_rank(key)[0].split(":")
        wanted.setdefault((int(fields[1].removeprefix("pp")), int(fields[3].removeprefix("tp"))), []).append(key)
    weights = read_again(recipe, keys)
    out: dict[str, dict[str | None, Any]] = {}
    try:
        pairs = pairs_for(weights, None, keys)
        source = WeightsSource(lambda: Pass(pairs, stable=True))
        with LOCK:
            for (pp_rank, tp_rank), rank_keys in sorted(wanted.items()):
                rank = Rank(pp_rank, tp_rank)
                with reduce.for_rank(pp_rank, tp_rank):
                    model = load_and_process(config, source, rank, tp, pp, dp, True)
                held = dict(model.named_parameters())
                for key in rank_keys:
                    t = held[split_rank(key)[1]].detach().clone()
                    digests, _ = checksum_sized([("t", t)], "")
                    if digests["t"] != expected[key]:
                        raise ExpectedDigestsError(
                            f"{key}: the expected tensors changed since the digests were computed"
                        )
                    out[key] = {None: t}
                drop_tensors(model)  # its memory back to the pool for the next rank (see drop_tensors)
                del model, held
    finally:
        weights.close()
        _trim_pool()
    return out


def _zeroed_again(expected: Any, zeros: dict[str, list[int]]) -> dict[str, str]:
    """:meth:`QuantizedExpectedDigests.digests_with_channels_zeroed`: the
    ranks holding the weight keys of ``zeros`` rebuilt from the same weights,
    each layer's rows zeroed before vLLM quantizes it (on the key's rank, and
    on every rank of its stage for a row-parallel layer, whose rows every
    rank holds a part of), the amax reduction reproduced, then hashed: every
    key of those ranks, under each asking key's prefix. All layers of a DP
    replica's stage in one rebuild: a layer's quantization reads only its own weight."""
    return _rebuilt_with(expected, sorted(zeros), "zero", lambda key, layer, tp: (layer, list(zeros[key]), tp))


def _shard_of_again(expected: Any, shards: dict[str, int]) -> dict[str, str]:
    """:meth:`QuantizedExpectedDigests.digests_with_shard_of`: as
    :func:`_zeroed_again`, each weight key's layer loaded on its rank from
    the shard of the tp rank ``shards`` names (every rank of the stage
    rebuilt: the amax that rank contributes to the reduction changes too)."""
    marks = lambda key, layer, tp: (layer, tp, shards[key])  # noqa: E731
    return _rebuilt_with(expected, sorted(shards), "shard_of", marks, every_rank=True)


def _rebuilt_with(expected: Any, keys: list[str], mark: str, marks_of: Any, every_rank: bool = False) -> dict[str, str]:
    """The rebuild of :func:`_zeroed_again` and :func:`_shard_of_again`:
    ``mark``, the argument of :func:`.quantized.load_and_process` that
    takes each stage's ``marks_of(key, layer, tp rank)``; ``every_rank``:
    the digests of every tp rank of the keys' stages, not only theirs."""
    from weight_checker.expected.rank import Rank
    from weight_checker.expected.recipe import pairs_for, read_again
    from weight_checker.expected.vllm.rank_model import LOCK
    from weight_checker.expected.weights import Pass, WeightsSource
    from weight_checker.keys import split_rank

    state, recipe = _rebuildable(expected, keys)
    config, tp, pp, dp, _ = state
    if getattr(config.model_config, "quantization", None) not in ONLINE:
        raise ExpectedDigestsError(f"{', '.join(keys)}: recomputed through vLLM for online FP8 only")
    # The marks of each place (a DP replica's stage: its rank without the tp
    # field), rebuilt with only its own: replicas may differ. Each place ->
    # its pp rank, the marks of its layers, tp -> the prefix asked.
    places: dict[str, tuple[int, list[Any], dict[int, str]]] = {}
    for key in keys:
        if key not in expected or not key.endswith(".weight"):
            raise ExpectedDigestsError(f"{key}: not a weight key of these expected digests")
        prefix, name = split_rank(key)
        fields = prefix.split(":")
        pp_rank, tp_rank = int(fields[1].removeprefix("pp")), int(fields[3].removeprefix("tp"))
        _, marks, asked = places.setdefault(":".join([*fields[:3], *fields[4:]]), (pp_rank, [], {}))
        for t in range(tp) if every_rank else (tp_rank,):
            asked[t] = ":".join([*fields[:3], f"tp{t}", *fields[4:]])
        marks.append(marks_of(key, name.removesuffix(".weight"), tp_rank))
    # Places with the same marks (every replica zeroed alike) share one rebuild.
    rebuilds: dict[tuple[int, str], tuple[list[Any], dict[int, list[str]]]] = {}
    for stage, stage_marks, stage_asked in places.values():
        _, under = rebuilds.setdefault((stage, repr(stage_marks)), (stage_marks, {}))
        for t, at in stage_asked.items():
            under.setdefault(t, []).append(at)
    online_process.install()
    weights = read_again(recipe, keys)
    out: dict[str, str] = {}
    try:
        pairs = pairs_for(weights, None, keys)
        source = WeightsSource(lambda: Pass(pairs, stable=True))
        with LOCK:
            for (stage, _), (stage_marks, under) in sorted(rebuilds.items()):
                reduce = AmaxReduce(tp)

                def build(rank: Any, amax_only: bool = False, marks: Any = stage_marks) -> Any:
                    return load_and_process(
                        config, source, rank, tp, pp, dp, True, amax_only=amax_only, **{mark: marks}
                    )

                if tp > 1:
                    for t in range(tp):
                        with reduce.recording(stage, t):
                            # What it contributes to the reduction; the model is dropped.
                            drop_tensors(build(Rank(stage, t), amax_only=True))
                    reduce.reduce()
                for t, prefixes in sorted(under.items()):
                    rank = Rank(stage, t)
                    with reduce.for_rank(stage, t):
                        model = build(rank)
                    digests = rank_digests(model, rank.prefix)
                    drop_tensors(model)
                    del model
                    for prefix in prefixes:  # under each asking key's own prefix (its DP replica's)
                        out |= {prefix + ":" + k.removeprefix(rank.prefix): v for k, v in digests.items()}
    finally:
        weights.close()
        _trim_pool()
    return out


def _trim_pool() -> None:
    """The pool keeps only what this rebuild used (torch: imported when a rank was built)."""
    from weight_checker.expected.vllm import warm_memory

    warm_memory.POOL.trim()
