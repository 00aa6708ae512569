"""The digests every rank of an engine must hold, computed from the weights
themselves: vLLM's own model class and ``load_weights`` for each rank's
layout, run on the CPU in this process, then hashed exactly like
:func:`weight_checker.checksum`.

    expected = weight_checker.expected_digests("ckpt/", tp=2)             # a checkpoint
    expected = weight_checker.expected_digests("ckpt/", trainer_state.items(), tp=2)   # a trainer's tensors
    result = weight_checker.verify(url, transfer=push, expected=expected)

No engine, no GPU, no process group: for rank (pp, tp) of a layout, vLLM's
parallel-state groups are set to that rank's coordinates (nothing is ever
communicated while a model is built and loaded), the model is built on the
CPU with vLLM's ``initialize_model`` and fed the ``(name, tensor)`` pairs the
trainer would hand to ``load_weights``: vLLM itself fuses ``qkv_proj`` and
``gate_up_proj``, shards columns and rows, pads the vocabulary per shard,
ties ``lm_head``, replicates KV heads and casts dtypes. One rank is held at a
time. The GPU layout is what is hashed: the CPU backend's repacking
(``process_weights_after_loading``) is never run; layers whose post-load
processing would change bytes on a GPU (quantized ones) are refused by name.
DP replicas hold their dp0 digests under their own ``dp`` prefix.

A checkpoint is read through a private memory map: every rank's loader
narrows a zero-copy view, so a rank touches only the pages of its shard
(plus the rows of row-parallel tensors), and t ranks never mean t reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.manifest import ExpectedDigests
from weight_checker.expected.rank import Rank, on_rank
from weight_checker.expected.recipe import remember
from weight_checker.expected.vllm.rank_model import (
    CACHE,
    DRAFT_ARENA,
    LOCK,
    TARGET_ARENA,
    build_and_load,
    cache_key,
    import_vllm,
    in_a_clean_thread,
    rank_config,
    refuse_quantized_config,
    unwritten_of,
)
from weight_checker.expected.weights import weights_source
from weight_checker.keys import rank_prefix

if TYPE_CHECKING:  # .deferred needs torch, which `import weight_checker` must not
    from weight_checker.expected.vllm.deferred import PendingDigests

__all__ = ["ExpectedDigests", "expected_digests"]


def _unwritten(
    model: Any, loaded: set[str] | None, what: str, rank: Rank, out: ExpectedDigests, allow: bool
) -> list[str]:
    """The parameters the weights never wrote: an error unless ``allow``."""
    if loaded is None and not any("load_weights does not return" in w for w in out.warnings):
        out.warnings.append(
            f"{type(model).__name__}.load_weights does not return the names it loaded: parameters the weights "
            "never wrote cannot be detected (they hash as zeros)"
        )
    unwritten = unwritten_of(model, loaded)
    if unwritten and not allow:
        shown = ", ".join(unwritten[:5]) + (" ..." if len(unwritten) > 5 else "")
        raise ExpectedDigestsError(
            f"the weights never wrote {len(unwritten)} {what} parameter(s) of {rank.name}: {shown}"
        )
    return unwritten


def expected_digests(
    model: Any = None,
    weights: Any = None,
    *,
    tp: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
    dtype: str | None = None,
    allow_unwritten: bool = False,
    progress: Callable[[str], None] | None = None,
    enable_lora: bool = False,
    loras: Mapping[str, Any] | None = None,
    draft: str | Path | None = None,
    draft_weights: Any = None,
    num_speculative_tokens: int | None = None,
    weight_version: str | None = None,
    like: str | None = None,
    buffers: bool = False,
    engine: str | None = None,
    group: Any = None,
    **engine_args: Any,
) -> ExpectedDigests:
    """``{key: hex}`` for every key an engine started with this model and
    layout reports after loading ``weights``: ``dp{d}:pp{p}:pcp0:tp{t}:{name}``,
    and, where asked, its LoRA adapters and draft model.

    ``model``: a checkpoint directory (its config and, unless ``weights`` is
    given, its weights), a ``vllm.EngineArgs``, or a mapping of the engine
    arguments the server was started with (``{"model": dir, "dtype": ...}``;
    ``engine_args`` add to them, e.g. ``max_lora_rank=8, max_loras=2``).
    ``weights``: a checkpoint (path), or the trainer's ``(hf_name, tensor)``
    pairs as a mapping, a list, ``.items()`` or a callable returning a fresh
    iterable (every rank reads them all). ``tp``, ``pp``, ``dp``: the layout
    (default 1 each).

    ``like``: the URL of a running vLLM (dev-mode) or SGLang server whose engine these
    digests are for: its model (when ``model`` is ``None``), dtype, layout,
    expert parallelism, model config overrides, LoRA settings and draft model
    are read from its ``/server_info`` (:mod:`.server_config`, which lists
    them, and what it refuses); an argument given here that contradicts it is
    an error.

    ``enable_lora`` (implied by ``loras``): the engine runs with LoRA, so its
    target keys carry vLLM's ``.base_layer.`` names; its settings are vLLM's
    engine arguments: ``max_lora_rank``, ``max_loras``, ``lora_dtype``
    (``"float16"``...), ``lora_target_modules`` (e.g. ``["o_proj"]``: only
    those layers are wrapped), ``fully_sharded_loras``. ``loras``: adapter name
    -> PEFT directory or the trainer's ``(tensors, adapter_config)``; each
    adapter's slot contents on every rank, keys ``lora:{name}:{module}.lora_a``
    / ``.lora_b``. ``draft``: the draft model's directory (draft-model
    speculative decoding; ``num_speculative_tokens``, default 2), its weights
    from ``draft_weights`` (as ``weights``) or its checkpoint; keys
    ``draft:{name}``. ``weight_version``: the version the engine must claim
    with the weights (checked by ``verify``). ``buffers``: the target's
    persistent buffers too, keys ``buffer:{name}`` (the ``buffers`` scope).
    ``engine``: ``"vllm"`` (the default) or ``"sglang"``: the engine family
    whose model classes and loader make the tensors (read from the server
    with ``like``; :mod:`.sglang.digests` says what SGLang's covers).

    Sharded weights (FSDP2 ``DTensor``s, ``LocalShard``s) make it a
    collective call over ``group``, with no gather (:mod:`.collective`).

    Raises :class:`ExpectedDigestsError` naming the tensor, the adapter or the
    reason, and, unless ``allow_unwritten``, when the weights leave a
    parameter unwritten. Calls from several threads run one at a time (they
    share the parameter arenas and the model cache).
    """
    given = {
        "tp": tp, "pp": pp, "dp": dp, "dtype": dtype, "enable_lora": enable_lora or bool(loras) or None,
        "draft": draft, "num_speculative_tokens": num_speculative_tokens, "engine": engine, **engine_args,
    }  # fmt: skip
    if like is not None:
        from weight_checker.expected.server_config import reconcile, server_engine

        server = server_engine(like)
        given = reconcile(server, given)
        model = server.model if model is None else model
    elif model is None:
        raise ExpectedDigestsError("no model given (a checkpoint directory, engine arguments, or like=URL)")
    args = {k: v for k, v in given.items() if v is not None}
    if "lora_dtype" in args or "lora_target_modules" in args:
        from weight_checker.expected.vllm.lora import lora_engine_arguments

        args = lora_engine_arguments(args)
    layout = {name: args.pop(name, 1) for name in ("tp", "pp", "dp")}
    for label, n in layout.items():  # one check, whichever engine's model classes run
        if not isinstance(n, int) or n < 1:
            raise ExpectedDigestsError(f"{label} must be a positive integer, got {n!r}")
    family = args.pop("engine", None) or "vllm"
    if family not in ("vllm", "sglang"):
        raise ExpectedDigestsError(f"engine must be 'vllm' or 'sglang', got {family!r}")
    from weight_checker.expected.collective import sharded_call, sharded_weights

    weights, sharded = sharded_weights(weights)
    if sharded:  # collective over the trainer's group (expected/collective.py)
        extra = {"loras": loras, "draft": draft, "buffers": buffers, "like": like, "weight_version": weight_version}
        return sharded_call(expected_digests, model, weights, family, layout, args, group, allow_unwritten, extra)  # type: ignore[no-any-return]
    if family == "sglang":
        from weight_checker.expected.sglang.digests import sglang_expected_digests

        if loras or draft_weights is not None or buffers:
            raise ExpectedDigestsError("not covered for an SGLang engine: LoRA adapters, a draft model, buffers")
        with LOCK:
            out: ExpectedDigests = sglang_expected_digests(
                model, weights, tp=layout["tp"], pp=layout["pp"], dp=layout["dp"], dtype=args.pop("dtype", None),
                allow_unwritten=allow_unwritten, progress=progress, weight_version=weight_version, arguments=args,
            )  # fmt: skip
        if like is not None:
            out.layout["server"] = like
        return out
    with LOCK:
        out = _expected_digests(
            model, weights, tp=layout["tp"], pp=layout["pp"], dp=layout["dp"], dtype=args.pop("dtype", None),
            allow_unwritten=allow_unwritten, progress=progress, enable_lora=bool(args.pop("enable_lora", False)),
            loras=loras, draft=args.pop("draft", None), draft_weights=draft_weights,
            num_speculative_tokens=args.pop("num_speculative_tokens", 2), weight_version=weight_version,
            buffers=buffers, **args,
        )  # fmt: skip
    if like is not None:
        from weight_checker.expected.server_config import check_quantization

        check_quantization(server, out.layout.get("quantization"))
        out.layout["server"] = like
    return out


def _expected_digests(
    model: Any,
    weights: Any,
    *,
    tp: int,
    pp: int,
    dp: int,
    dtype: str | None,
    allow_unwritten: bool,
    progress: Callable[[str], None] | None,
    enable_lora: bool,
    loras: Mapping[str, Any] | None,
    draft: str | Path | None,
    draft_weights: Any,
    num_speculative_tokens: int,
    weight_version: str | None,
    buffers: bool = False,
    **engine_args: Any,
) -> ExpectedDigests:
    checkpoint = Path(model) if isinstance(model, (str, Path)) else None
    if checkpoint is not None:
        from weight_checker.expected.vllm.quantized import CHECKPOINT_FORMATS

        refuse_quantized_config(checkpoint, allow=CHECKPOINT_FORMATS)
    source = weights_source(weights, checkpoint, tp * pp)
    enable_lora = enable_lora or bool(loras)
    if enable_lora:
        engine_args = {**engine_args, "enable_lora": True}
    if draft is not None:
        from weight_checker.expected.vllm.draft import speculative_config

        refuse_quantized_config(Path(draft))
        engine_args = {**engine_args, "speculative_config": speculative_config(draft, num_speculative_tokens)}
    draft_source = weights_source(draft_weights, Path(draft), tp * pp) if draft is not None else None

    key = cache_key(model, {"tp": tp, "pp": pp, "dp": dp, "dtype": dtype, **engine_args})
    config = in_a_clean_thread(_prepare, model, key, tp, pp, dp, dtype, engine_args, enable_lora, draft is not None)
    import vllm

    model_config = config.model_config
    # A MoE model's DP ranks shard its experts between them; a dense model's are replicas.
    moe_dp = config.parallel_config.data_parallel_size > 1
    if model_config.quantization is not None:
        return _quantized(config, source, tp, pp, dp, allow_unwritten, progress, weight_version, extras={
            "LoRA": enable_lora, "a draft model": draft is not None, "buffers": buffers,
        }, model=model, weights=weights, checkpoint=checkpoint)  # fmt: skip
    from weight_checker.expected.vllm.lora import check_adapters

    adapters = check_adapters(loras, config.lora_config.max_loras) if enable_lora else []
    out = ExpectedDigests(vllm_version=vllm.__version__, weight_version=weight_version)
    out.layout = {
        "tp": tp, "pp": pp, "dp": dp, "dtype": str(model_config.dtype).removeprefix("torch."),
        "architecture": model_config.architecture,
    }  # fmt: skip
    if enable_lora:
        lora_config = config.lora_config
        out.layout["lora"] = {
            "max_lora_rank": lora_config.max_lora_rank,
            "max_loras": lora_config.max_loras,
            "lora_dtype": str(lora_config.lora_dtype).removeprefix("torch."),
        }
        if lora_config.fully_sharded_loras:
            out.layout["lora"]["fully_sharded_loras"] = True
        if lora_config.target_modules is not None:
            out.layout["lora"]["target_modules"] = sorted(lora_config.target_modules)
    if draft is not None:
        out.layout["draft"] = str(draft)
    if buffers:
        out.layout["buffers"] = True
    # torch: deferred.py imports it; loaded only when expected digests are computed
    from weight_checker.expected.vllm.deferred import PendingDigests
    from weight_checker.hashing.block_states import recording

    later = PendingDigests()
    # Weights from a callable may be made anew for each load (a reused
    # staging buffer): hashed as soon as each model is loaded.
    eager = source.fresh_per_rank or (draft_source is not None and draft_source.fresh_per_rank)
    ranks = []
    with recording() as states:  # each key's chain at its block boundaries, for explanations
        for dp_rank in range(dp) if moe_dp else [None]:
            for pp_rank in range(pp):
                for tp_rank in range(tp):
                    rank = Rank(pp_rank, tp_rank, dp_rank)
                    if progress is not None:
                        progress(rank.name)
                    _target_rank(
                        config, source, rank, tp, pp, dp, adapters, enable_lora, allow_unwritten, out, later, buffers
                    )
                    if eager:
                        later.finish()
                    if draft_source is not None:
                        _draft_rank(config, draft_source, rank, tp, pp, dp, allow_unwritten, out, later)
                        if eager:
                            later.finish()
                    ranks.append(rank)
        done = later.finish()  # every rank's parameters hashed where the weights lie, in one run
    out.seconds["hash"] += later.seconds
    for rank in ranks:
        rank.put(done)
        for d in [rank.dp_rank] if moe_dp else range(dp):
            replica = rank_prefix(d, rank.pp_rank, 0, rank.tp_rank)
            out.update({replica + k[len(rank.prefix) :]: v for k, v in rank.digests.items()})
            out.block_states.update({replica + k[len(rank.prefix) :]: states[k] for k in rank.digests if k in states})
            out.unwritten += [replica + k[len(rank.prefix) :] for k in rank.unwritten]
    # What expected_tensors needs to recompute these tensors: weak references to the weights, never the weights.
    out._recompute = remember(
        model, weights, checkpoint, key, source, tp=tp, pp=pp, dp=dp, dtype=dtype, engine_args=dict(engine_args),
        lora=enable_lora, draft=draft is not None, moe_dp=moe_dp,
    )  # fmt: skip
    for weights_of_a_call in (source, draft_source):
        if weights_of_a_call is not None:
            weights_of_a_call.forget_others()
    # vLLM's configuration, cached for the next call, keeps this frame alive
    # (it records where it was made): it must not keep the weights (a
    # checkpoint's mapping, the trainer's tensors) alive with it.
    del source, draft_source, weights, draft_weights
    return out


def _quantized(
    config: Any,
    source: Any,
    tp: int,
    pp: int,
    dp: int,
    allow_unwritten: bool,
    progress: Callable[[str], None] | None,
    weight_version: str | None,
    extras: Mapping[str, bool],
    *,
    model: Any,
    weights: Any,
    checkpoint: Path | None,
) -> ExpectedDigests:
    """A quantized engine's expected digests: every rank processed after
    loading by vLLM itself (:mod:`.vllm.quantized`), DP replicas as dp0."""
    import vllm

    from weight_checker.expected.vllm.quantized import check_known, quantized_ranks
    from weight_checker.expected.vllm.quantized_tensors import quantized_digests_class

    model_config = config.model_config
    method = check_known(model_config.quantization, "the engine")
    asked = [what for what, on in extras.items() if on]
    if asked or model_config.is_moe:
        what = ", ".join(asked) if asked else "a MoE model's experts"
        raise ExpectedDigestsError(f"not covered for a quantized engine ({method}): {what}")
    out: ExpectedDigests = quantized_digests_class()(vllm_version=vllm.__version__, weight_version=weight_version)
    out.layout = {
        "tp": tp, "pp": pp, "dp": dp, "dtype": str(model_config.dtype).removeprefix("torch."),
        "architecture": model_config.architecture, "quantization": method, "device": "cpu",
    }  # fmt: skip
    out.warnings.append(
        f"quantized ({method}): these are a CPU engine's tensors, made by vLLM's processing on this host's CPU "
        "kernels; a GPU engine's kernels lay the same weights out otherwise (docs/quantized.md)"
    )
    for rank in quantized_ranks(config, source, tp, pp, dp, allow_unwritten, out, progress):
        for d in range(dp):
            replica = rank_prefix(d, rank.pp_rank, 0, rank.tp_rank)
            out.update({replica + k[len(rank.prefix) :]: v for k, v in rank.digests.items()})
    # What the explanation's rebuild reads again: weak references to the weights, never the weights.
    out._recompute = remember(model, weights, checkpoint, None, source, tp=tp, pp=pp, dp=dp)
    source.forget_others()
    return out


def _prepare(
    model: Any,
    key: str | None,
    tp: int,
    pp: int,
    dp: int,
    dtype: str | None,
    engine_args: Mapping[str, Any],
    lora: bool,
    draft: bool,
) -> Any:
    """vLLM's modules imported and the configuration made (cached): run in a
    clean thread, before any frame that holds the caller's weights runs vLLM's code."""
    import_vllm(lora=lora, draft=draft)
    return CACHE.config_for(key, lambda: rank_config(model, tp, pp, dp, dtype, engine_args))


def _target_rank(
    config: Any,
    source: Any,
    rank: Rank,
    tp: int,
    pp: int,
    dp: int,
    adapters: list[tuple[str, int, Any]],
    enable_lora: bool,
    allow_unwritten: bool,
    out: ExpectedDigests,
    later: PendingDigests,
    buffers: bool = False,
) -> None:
    # torch: default_dtype.py imports it; loaded only when a rank is built
    from weight_checker.expected.vllm.default_dtype import thread_default_dtype
    from weight_checker.expected.vllm.lora import add_adapters

    model_config = config.model_config
    cached, manager = CACHE.models.get(rank.name, (None, None))
    started = time.perf_counter()
    with on_rank(config, config, model_config, rank, tp, pp, dp, cached, lora=enable_lora):
        rank_model, loaded, deferred = build_and_load(config, model_config, source, TARGET_ARENA, cached)
        unwritten = _unwritten(rank_model, loaded, "target", rank, out, allow_unwritten)
        if enable_lora and manager is None:
            deferred.flush()  # wrapping the layers is not ours to watch: their bytes are in place first
            # Wrapped after loading, as the engine does: the same parameters under `.base_layer.` names.
            kept = {id(p) for n, p in rank_model.named_parameters() if n not in unwritten}
            rank_model, manager = in_a_clean_thread(_wrapped, rank_model, config)
            unwritten = [n for n, p in rank_model.named_parameters() if id(p) not in kept]
        elif enable_lora:  # a cached wrapped model, its base layers loaded again (as the engine reloads)
            manager.remove_all_adapters()
        if enable_lora:
            with thread_default_dtype(model_config.dtype):
                add_adapters(manager, adapters)
        CACHE.models[rank.name] = (rank_model, manager)
    loaded_at = time.perf_counter()
    rank.add("", deferred.checksum(rank_model, rank.prefix, later), unwritten)
    out.bytes_in_place += deferred.in_place_bytes
    if enable_lora:
        from weight_checker.hashing.digests import digest_tensors
        from weight_checker.integrations.vllm.scope_walk import lora_pairs

        pairs, _ = lora_pairs(manager, rank.prefix)
        keys = [k for k, _ in pairs]
        rank.add("", dict(zip(keys, digest_tensors(keys, [t for _, t in pairs])[0], strict=True)), [])
    if buffers:
        from weight_checker.hashing.digests import digest_tensors
        from weight_checker.hashing.walk import persistent_buffers

        pairs = [(f"{rank.prefix}buffer:{n}", t) for n, t in persistent_buffers(rank_model)]
        keys = [k for k, _ in pairs]
        rank.add("", dict(zip(keys, digest_tensors(keys, [t for _, t in pairs])[0], strict=True)), [])
    out.seconds["load"] += loaded_at - started
    out.seconds["hash"] += time.perf_counter() - loaded_at


def _wrapped(model: Any, config: Any) -> tuple[Any, Any]:
    """vLLM's LoRA wrapping of a rank's model (run in a clean thread, with the
    caller's vLLM config and rank groups, which are the process's)."""
    import torch

    # torch: default_dtype.py imports it; loaded only when a rank is built
    from weight_checker.expected.vllm.default_dtype import thread_default_dtype
    from weight_checker.expected.vllm.lora import wrap

    with torch.device("cpu"), thread_default_dtype(config.model_config.dtype):
        return wrap(model, config)


def _draft_rank(
    config: Any,
    source: Any,
    rank: Rank,
    tp: int,
    pp: int,
    dp: int,
    allow_unwritten: bool,
    out: ExpectedDigests,
    later: PendingDigests,
) -> None:
    from weight_checker.expected.vllm.draft import draft_configs

    draft_config, draft_model_config = draft_configs(config)
    cached, _ = CACHE.models.get("draft:" + rank.name, (None, None))
    started = time.perf_counter()
    with on_rank(config, draft_config, draft_model_config, rank, tp, pp, dp, cached):
        model, loaded, deferred = build_and_load(
            draft_config,
            draft_model_config,
            source,
            DRAFT_ARENA,
            cached,
            prefix="draft_model",
        )
        CACHE.models["draft:" + rank.name] = (model, None)
        unwritten = _unwritten(model, loaded, "draft", rank, out, allow_unwritten)
    loaded_at = time.perf_counter()
    rank.add("draft:", deferred.checksum(model, rank.prefix + "draft:", later), unwritten)
    out.bytes_in_place += deferred.in_place_bytes
    out.seconds["load"] += loaded_at - started
    out.seconds["hash"] += time.perf_counter() - loaded_at
