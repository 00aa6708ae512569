"""The tensors behind expected digests, recomputed for the keys a failed check names, with their candidate causes.

    expected = weight_checker.expected_digests("ckpt/", state_dict, tp=2)
    ...  # a check fails on dp0:pp0:pcp0:tp1:model.layers.3.self_attn.qkv_proj.weight
    tensors = expected_tensors(expected, [key], ["dtype-roundtrip:float16", "transposed"])
    tensors[key][None]                        # the bytes expected[key] is the SHA-256 of
    tensors[key]["dtype-roundtrip:float16"]   # had the weights gone through float16 first

The candidate causes are the tensors the same rank would hold had the
trainer's weights been transformed first (:mod:`.transforms`).
:func:`~weight_checker.expected.digests.expected_digests` keeps what a
recompute needs (:mod:`.recipe`): the engine's configuration and where the
weights came from, never the weights themselves.

Exact or refused: every recomputed tensor is hashed and must equal the
digest; otherwise the key is named (the weights changed since). Only the
ranks the keys are on are loaded, and of the weights only those that feed the
keys where that can be told (:mod:`.vllm.locate`: vLLM's own name mapping,
``q_proj`` into ``qkv_proj``, each expert into the stacked experts), through
vLLM's loader under the deferred writes of :mod:`.vllm.deferred`: a parameter the
loader copies whole from the weights is hashed where they lie, on another
core, while it is copied out. Should that filter miss what writes a key, the
rank is loaded from all the weights instead. A rank model and the parameter
arena of the latest :func:`expected_digests` call are reused when the
configuration is the same, and left as the next call expects them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.manifest import ExpectedDigests
from weight_checker.expected.rank import Rank, on_rank
from weight_checker.expected.recipe import CHANGED, Recipe, WeightsReadAgain, pairs_for, read_again, remember
from weight_checker.expected.transforms import (
    DEFERRED,
    TRANSFORMS,
    UNCHANGED,
    LazyPieces,
    applies,
    elementwise_into,
    lazy_elementwise,
    reload_needed,
    same_bytes,
    transformed,
)

# locate's functions are called through the module, so that a test's patch of one reaches this module's calls.
from weight_checker.expected.vllm import locate
from weight_checker.expected.vllm.rank_model import (
    CACHE,
    LOCK,
    TARGET_ARENA,
    Arena,
    build_model,
    import_vllm,
    in_a_clean_thread,
    rank_config,
)

# Recipe, remember, TRANSFORMS, DEFERRED, LazyPieces and applies live in .recipe and .transforms; kept importable
# from here, where callers have always found them.
__all__ = [
    "DEFERRED",
    "TRANSFORMS",
    "LazyPieces",
    "Recipe",
    "applies",
    "can_recompute",
    "expected_tensors",
    "remember",
]

_KEY = re.compile(r"dp(\d+):pp(\d+):pcp(\d+):tp(\d+):(.+)\Z", re.DOTALL)


# --- the keys asked for --------------------------------------------------------------------------


class _Wanted:
    """The keys of one rank model, by parameter name (a dense model's DP
    replicas share their dp0 rank's model)."""

    def __init__(self, dp_rank: int | None, pp_rank: int, tp_rank: int):
        self.dp_rank, self.pp_rank, self.tp_rank = dp_rank, pp_rank, tp_rank
        self.names: dict[str, list[str]] = {}


def _wanted(expected: ExpectedDigests, recipe: Recipe, keys: Sequence[str]) -> list[_Wanted]:
    settings = recipe.settings
    ranks: dict[tuple[int | None, int, int], _Wanted] = {}
    for key in keys:
        if not isinstance(key, str):
            raise ExpectedDigestsError(f"keys must be strings, got {type(key).__name__}")
        m = _KEY.match(key)
        if m is None:
            raise ExpectedDigestsError(f"{key!r}: not a key dp{{d}}:pp{{p}}:pcp{{c}}:tp{{t}}:{{name}}")
        dp_rank, pp_rank, pcp, tp_rank = (int(g) for g in m.groups()[:4])
        name = m.group(5)
        scope = next((s for s in ("lora:", "draft:", "buffer:") if name.startswith(s)), None)
        if scope is not None:
            raise ExpectedDigestsError(
                f"{key}: the expected tensors of {scope[:-1]} keys are not supported yet (target keys only)"
            )
        if key not in expected:
            why = " (a parameter the weights never wrote)" if key in expected.unwritten else ""
            raise ExpectedDigestsError(f"{key}: not one of these expected digests' keys{why}")
        if pcp != 0 or dp_rank >= settings["dp"] or pp_rank >= settings["pp"] or tp_rank >= settings["tp"]:
            raise ExpectedDigestsError(f"{key}: not a rank of this layout")
        rank = (dp_rank if settings["moe_dp"] else None, pp_rank, tp_rank)
        ranks.setdefault(rank, _Wanted(*rank)).names.setdefault(name, []).append(key)
    return list(ranks.values())


# --- one rank's tensors, and their candidates --------------------------------------------------------


def _rank_tensors(
    recipe: Recipe,
    config: Any,
    cached: Any,
    wanted: _Wanted,
    weights: WeightsReadAgain,
    transforms: Sequence[str],
    expected: ExpectedDigests,
    copy: bool = True,
    lazy: bool = False,
    defer: bool = False,
    check: bool = True,
) -> dict[str, dict[str | None, Any]]:
    s = recipe.settings
    rank = Rank(wanted.pp_rank, wanted.tp_rank, wanted.dp_rank)
    model_config = config.model_config
    keys_of = wanted.names
    every_key = [k for ks in keys_of.values() for k in ks]
    with on_rank(config, config, model_config, rank, s["tp"], s["pp"], s["dp"], cached, lora=s["lora"]):
        model = cached if cached is not None else in_a_clean_thread(build_model, config, model_config, {})
        arena = TARGET_ARENA if cached is not None else Arena()
        by_name = dict(model.named_parameters())
        stripped = {n.replace(".base_layer", ""): p for n, p in by_name.items()}
        params = {}
        for name, keys in keys_of.items():
            p = by_name.get(name, stripped.get(name.replace(".base_layer", "")))
            if p is None:
                raise ExpectedDigestsError(f"{keys[0]}: {rank.name} has no such parameter (not a plain parameter?)")
            params[name] = p
        levels: list[set[str] | None] = [*locate.feeding(model, params, weights.names), None]
        for level, names in enumerate(levels):
            last = level == len(levels) - 1
            pairs = pairs_for(weights, names, every_key)
            try:
                located = locate.load_located(model, model_config, arena, pairs, params, zero=False)
                if located is None:
                    located = locate.load_located(model, model_config, arena, pairs, params, zero=True)
            except ExpectedDigestsError:
                if last:
                    raise
                continue  # a loader that wants more than these weights: try more
            assert located is not None
            for where in located.values():  # several strided pieces: hashed from the parameter
                if where.pieces and not where.hashable_in_place() and len(where.pieces) > 1:
                    locate.replay_into(where)
            if not check:  # the caller checks what it reads (by the recorded chain states)
                copies = {name: _untransformed(where, copy, lazy) for name, where in located.items()}
                break
            hashing = locate.Beside(lambda located=located: locate.digests_of(located))
            try:
                copies = {name: _untransformed(where, copy, lazy) for name, where in located.items()}
            finally:
                digests = hashing.result()
            wrong = [(k, name) for name, keys in keys_of.items() for k in keys if digests[name] != expected[k]]
            if not wrong:
                break
            if last:
                key, name = wrong[0]
                raise ExpectedDigestsError(
                    f"{', '.join(k for k, _ in wrong)}: {CHANGED}: the weights now give "
                    f"{digests[name][:16]}... for {key}, not {expected[key][:16]}..."
                )
        out: dict[str, dict[str | None, Any]] = {k: {None: copies[name]} for name, ks in keys_of.items() for k in ks}
        dtypes = {n: t.dtype for n, t in pairs}
        assert located is not None
        for transform in transforms:
            found: dict[str, Any] = {}
            if transform != "transposed":  # elementwise: applied to the pieces of a tiled parameter
                elementwise = lazy_elementwise if lazy else elementwise_into
                for name, where in located.items():
                    if where.pieces is not None and (got := elementwise(transform, where, dtypes)) is not None:
                        found[name] = got
            rest = {name: p for name, p in params.items() if name not in found}
            if defer and rest:  # what needs the transformed weights loaded again: left to a later call
                found.update(dict.fromkeys(reload_needed(transform, located, rest, pairs), DEFERRED))
                rest = {}
            # Unchecked and read a block at a time (an explanation from chain states): a transposed
            # weight is its view, and the parameters it feeds are read from it block by block, no copy.
            as_view = transform == "transposed" and lazy and not copy and not check
            made = (
                [(n, _transposed_view(t) if as_view else transformed(transform, t)) for n, t in pairs] if rest else []
            )
            if any(t is not None for _, t in made):
                owned = {at for _, t in made if t is not None and (at := locate.storage_of(t)) is not None}
                # Storages of the weights the transform left as they were.
                kept = {
                    at for (_, t), (_, u) in zip(pairs, made, strict=True) if u is None and (at := locate.storage_of(t))
                } - owned
                changed = [(n, t if u is None else u) for (n, t), (_, u) in zip(pairs, made, strict=True)]
                again = locate.load_located(model, model_config, arena, changed, rest, zero=False)
                if again is None:
                    again = locate.load_located(model, model_config, arena, changed, rest, zero=True)
                assert again is not None
                for name, where in again.items():
                    if where.pieces is not None and all(
                        p.source is None or locate.storage_of(p.source) in kept for p in where.pieces
                    ):
                        continue  # every piece from a weight left as it was: as it was (no copy to compare)
                    if as_view and where.pieces is not None:
                        found[name] = LazyPieces(None, where)
                        continue
                    if where.pieces and not where.hashable_in_place() and len(where.pieces) > 1:
                        locate.replay_into(where)
                    found[name] = where.copy(owned, view=not copy)
                del changed, again
            del made
            for name, tensor in found.items():
                if tensor is DEFERRED:
                    for k in keys_of[name]:
                        out[k][transform] = DEFERRED
                    continue
                if tensor is UNCHANGED or (
                    not isinstance(tensor, LazyPieces) and same_bytes(tensor, _dense(copies[name]))
                ):
                    continue  # the transform leaves this parameter as it was: it explains nothing
                for k in keys_of[name]:
                    out[k][transform] = tensor
        pairs_for(weights, levels[level], every_key)  # nothing written while this ran
    return out


def _transposed_view(t: Any) -> Any:
    """A square weight transposed, as a view (``None`` for any other weight)."""
    return t.t() if applies("transposed", t) else None


def _untransformed(where: locate.Located, copy: bool, lazy: bool) -> Any:
    """The parameter's bytes as :func:`expected_tensors` gives them: a copy,
    a view (``copy=False``, one piece of a weight) or, with ``lazy`` and no
    copy, pieces of several weights as a :class:`LazyPieces` read when asked."""
    if lazy and not copy and where.pieces is not None and len(where.pieces) != 1:
        return LazyPieces(None, where)
    return where.copy(set(), view=not copy)


def _dense(t: Any) -> Any:
    """A tensor of ``t``'s bytes (a :class:`LazyPieces` read whole)."""
    if not isinstance(t, LazyPieces):
        return t
    return t.block(0, t.nbytes).view(t.dtype).view(t.shape)


# --- the entry point -------------------------------------------------------------------------------


def _configured(recipe: Recipe) -> tuple[Any, bool]:
    """vLLM's configuration of the recipe's engine: the cached one (and its
    rank models) when it is the same, else one made for this recompute alone
    (the cache is left to the next expected_digests call)."""
    if recipe.cache_key is not None and CACHE.key == recipe.cache_key and CACHE.config is not None:
        return CACHE.config, True
    return in_a_clean_thread(_private_config, recipe), False


def _private_config(recipe: Recipe) -> Any:
    s = recipe.settings
    import_vllm(lora=s["lora"], draft=s["draft"])
    return rank_config(recipe.model, s["tp"], s["pp"], s["dp"], s["dtype"], s["engine_args"])


def can_recompute(expected: Any) -> bool:
    """Whether :func:`expected_tensors` may recompute ``expected``'s tensors:
    digests computed by ``expected_digests`` in this process from weights
    that can be read again (a checkpoint, a dict or a list of pairs). The
    weights may still have been freed or changed since: then it refuses,
    naming the keys."""
    recipe = getattr(expected, "_recompute", None)
    return isinstance(recipe, Recipe) and recipe.refusal is None


def expected_tensors(
    expected: ExpectedDigests,
    keys: Sequence[str],
    transforms: Sequence[str] = (),
    *,
    copy: bool = True,
    lazy: bool = False,
    defer: bool = False,
    check: bool = True,
) -> dict[str, dict[str | None, Any]]:
    """For each key, ``{None: the tensor that rank must hold}`` (a CPU
    tensor of its own, whose SHA-256 is ``expected[key]``), and for each of
    ``transforms`` that changes it, the tensor the rank would hold had the
    weights been transformed before loading:

    - ``"dtype-roundtrip:float16"``, ``"dtype-roundtrip:bfloat16"``: each
      floating-point weight cast to that dtype and back to its own;
    - ``"truncate:bfloat16"``: each float32 weight cut to bfloat16 by
      dropping its low 16 bits instead of rounding;
    - ``"transposed"``: each square matrix transposed.

    A transform is absent from a key's dict where it changes no weight that
    feeds the key, or leaves the key's bytes as they were. ``expected``: what
    :func:`~weight_checker.expected_digests` returned in this process (a
    manifest read back has nothing to recompute from). Each call loads the
    weights that feed the keys once and hashes every untransformed tensor:
    ask for all the transforms wanted in one call.

    ``copy=False``: a tensor whose bytes are one contiguous piece of a weight
    (a parameter the loader copies whole, or a row-range shard of one) is
    that weight's view instead of a copy (a fresh copy costs more than its
    digest here): valid while the weights stay unchanged, so hash it at once.

    ``lazy=True``: an elementwise transform (a round trip, a truncation) of
    a parameter tiled by pieces of the weights is a :class:`LazyPieces`
    (``.block(start, end)``: those bytes, computed when asked) instead of a
    tensor, given wherever it changes a weight that feeds the key (its bytes
    are not compared with the untransformed ones): what an explanation that
    tries a candidate on a few blocks wants. With ``copy=False`` too, an
    untransformed tensor made of several pieces of the weights (a fused
    ``qkv_proj``) is a :class:`LazyPieces` as well, read when asked.

    ``defer=True``: a transform that needs the transformed weights loaded
    again through vLLM's loader (a transposed square weight; an elementwise
    one whose parameter is not plainly tiled by the weights' elements) is
    not computed: its entry is :data:`DEFERRED`, for a later call to give
    where it is still wanted. What an explanation asks with the expected
    tensors, when no cause is known yet.

    ``check=False``: the tensors are not hashed against their digests, nor
    is the rank loaded again from all the weights where those that feed
    the keys fall short (nothing here tells it: a MoE's experts may be left
    zero). The caller checks the bytes it reads, as an explanation does
    block by block against the chain states the digests recorded
    (:mod:`weight_checker.hashing.block_states`), asks again with the check
    for a key whose bytes fail it, and confirms a candidate computed from
    them with a checked call before it names it.

    Raises :class:`ExpectedDigestsError`: for keys of the ``lora``, ``draft``
    and ``buffers`` scopes (not supported yet), keys not in ``expected``,
    weights that cannot be read again as they were (a one-shot iterator, a
    callable, a lazy mapping) or that were freed, and, naming the keys, where
    the weights no longer give the expected digests (changed since: a
    trainer that updates in place).
    """
    unknown = [t for t in transforms if t not in TRANSFORMS]
    if unknown:
        raise ExpectedDigestsError(f"unknown transform(s) {', '.join(map(repr, unknown))}: known are {TRANSFORMS}")
    transforms = list(dict.fromkeys(transforms))
    recipe = getattr(expected, "_recompute", None)
    if not isinstance(recipe, Recipe):
        raise ExpectedDigestsError(
            "these expected digests were not computed by expected_digests in this process (a manifest read "
            "back?): there is nothing to recompute their tensors from"
        )
    if recipe.refusal is not None:
        named = f"{', '.join(keys)}: " if keys else ""
        raise ExpectedDigestsError(f"{named}cannot recompute the expected tensors: {recipe.refusal}")
    wanted = _wanted(expected, recipe, keys)
    if not wanted:
        return {}
    out: dict[str, dict[str | None, Any]] = {}
    with LOCK:
        weights = read_again(recipe, keys)
        try:
            config, cached = _configured(recipe)
            if cached and any(_rank_name(r) not in CACHE.models for r in wanted):
                config, cached = in_a_clean_thread(_private_config, recipe), False
            for rank in wanted:
                model = CACHE.models[_rank_name(rank)][0] if cached else None
                out.update(
                    _rank_tensors(recipe, config, model, rank, weights, transforms, expected, copy, lazy, defer, check)
                )
        finally:
            weights.close()
    return out


def _rank_name(rank: _Wanted) -> str:
    return Rank(rank.pp_rank, rank.tp_rank, rank.dp_rank).name
