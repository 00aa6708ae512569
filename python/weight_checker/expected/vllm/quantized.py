"""Expected digests of quantized vLLM engines, through vLLM's own code.

A quantized engine does not hold the bytes it loads: after loading, each
layer's quantization method rewrites them (``process_weights_after_loading``):
online FP8 computes a scale per output channel and casts the weight, a
compressed-tensors FP8 checkpoint's shards are fused and transposed, and the
CPU INT4 kernel repacks GPTQ and AWQ weights into its own blocked layout.
Each rank here is built, loaded and then processed by vLLM itself, exactly
as the engine on this host does it, and hashed over the worker's own walk.

One step of that processing talks to the other ranks: a row-parallel layer's
per-channel amax is all-reduced over the TP group (each shard holds part of
every row), so every shard's scales are the whole weight's. Ranks are built
here one at a time, so the reduction is reproduced: every rank is loaded and
processed, except the layers whose amax is reduced, for which only the amax
each rank contributes is recorded (the calls come in the same order on every
rank, :mod:`.online_process`); then those layers are processed with the
reduced amax in place of the collective, and each rank is hashed. Where the
ranks would not fit in memory together, or a reduced amax came from a layer
that was not held back, each rank is loaded twice instead, one at a time: a
pass to record, one to apply.

What cannot be reproduced is refused by name: a format this project does not
know, a kernel that keeps a layer's weights outside its parameters (vLLM's
CPU W8A8 int8 path packs them into a oneDNN handle: nothing to hash, on the
engine or here), and a processing step vLLM itself cannot run on this host
(its own error, e.g. a kernel that requires AMX).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.vllm.amax_reduce import AmaxReduce
from weight_checker.expected.vllm.online_process import ZERO_ROWS

#: The online shorthand whose post-load processing runs here.
ONLINE = ("fp8_per_channel",)
#: Checkpoint formats, as their ``quantization_config.quant_method`` names them.
CHECKPOINT_FORMATS = ("compressed-tensors", "gptq", "awq")
#: Quantization methods as the engine names them (``model_config.quantization``):
#: vLLM serves GPTQ and AWQ checkpoints on the CPU as ``auto_gptq`` /
#: ``auto_awq`` (``gptq_marlin`` / ``awq_marlin`` are GPU kernels: refused).
KNOWN = (*ONLINE, "compressed-tensors", "gptq", "auto_gptq", "awq", "auto_awq")


def check_known(method: Any, where: str) -> str:
    """``method`` if this project reproduces it, else the one-line refusal."""
    if method in KNOWN:
        return str(method)
    known = ", ".join(KNOWN)
    raise ExpectedDigestsError(
        f"{where}: quantization {method!r} is not a format this project reproduces (known: {known}); "
        "its digests are not guessed"
    )


def process(model: Any, model_config: Any) -> None:
    """vLLM's own post-load processing of a rank's model, as its model loader
    runs it on the CPU; vLLM's error, when it cannot, in one line."""
    import torch
    from vllm.model_executor.model_loader.reload import finalize_layerwise_processing
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    # As vLLM's model loader (base_loader.load_model): online quantization
    # quantizes each layer as its weights complete, and finishes the layers
    # whose weights came in an order it did not count (a bias before its
    # weight: every Qwen2 checkpoint), before the processing proper.
    online = any(getattr(getattr(m, "quant_method", None), "uses_meta_device", False) for m in model.modules())
    with vllms_processing_error(""), torch.no_grad():
        if online:
            finalize_layerwise_processing(model, model_config)
        process_weights_after_loading(model, model_config, torch.device("cpu"))


@contextlib.contextmanager
def vllms_processing_error(where: str) -> Iterator[None]:
    """An error of vLLM's post-load processing inside, in one line
    (``where``: the rank, or empty)."""
    try:
        yield
    except ExpectedDigestsError:
        raise
    except Exception as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ExpectedDigestsError(
            f"{where}vLLM's post-load processing of this quantized model fails on this host "
            f"({type(e).__name__}: {reason}): its digests cannot be computed here"
        ) from e


def refuse_unseen(model: Any, rank_name: str) -> None:
    """A layer whose weights the processing moved outside its parameters
    holds nothing a digest covers: refused, naming the layer and the kernel."""
    from weight_checker.hashing.unseen import unseen

    hidden = unseen(model)
    if hidden:
        name, why = next(iter(hidden.items()))
        more = f" (and {len(hidden) - 1} more)" if len(hidden) > 1 else ""
        raise ExpectedDigestsError(
            f"{rank_name}: {name}: {why}{more}: an engine that holds weights outside its parameters cannot be "
            "checked, so no digests are expected of it"
        )


def quantized_ranks(
    config: Any,
    source: Any,
    tp: int,
    pp: int,
    dp: int,
    allow_unwritten: bool,
    out: Any,
    progress: Any = None,
) -> list[Any]:
    """Every rank of a quantized engine built, loaded, processed by vLLM and
    hashed (see the module docstring for the TP reduction): the ranks with their
    digests, for the caller to lay out under their DP replicas. The memory
    pool keeps, for the next call, only what this one used."""
    import time

    from weight_checker.expected.rank import Rank
    from weight_checker.expected.vllm import warm_memory
    from weight_checker.hashing import idle

    with warm_memory.POOL.trimming(), warm_memory.young_garbage():
        reduce = AmaxReduce(tp)
        out._quantized = (config, tp, pp, dp, reduce)  # what the explanation's rebuild needs (no weights)
        ranks = [Rank(p, t) for p in range(pp) for t in range(tp)]
        online = getattr(config.model_config, "quantization", None) in ONLINE
        one_pass = online and tp > 1
        if one_pass:
            # Each processed layer hashed in idle time while the next ones, and
            # the next rank, load (:mod:`weight_checker.hashing.idle`; at TP=1,
            # measured here, a rank's load leaves too little idle to gain).
            with idle.session():
                if _online_ranks(config, source, ranks, tp, pp, dp, allow_unwritten, out, reduce, progress):
                    return ranks
        # Two passes where one would hold too much memory (or for a format
        # whose layers are not held back): the first records what each rank
        # contributes to the reduction (online FP8's skips the casts; a
        # checkpoint format's is hashed: it is the only pass where no rank
        # reduced an amax, and none of this host's formats reduces one).
        first: dict[str, dict[str, str]] = {}
        if tp > 1:
            for rank in ranks:
                if progress is not None:
                    progress(f"{rank.name} (amax)")
                started = time.perf_counter()
                with reduce.recording(rank.pp_rank, rank.tp_rank):
                    model = load_and_process(config, source, rank, tp, pp, dp, allow_unwritten, amax_only=online)
                hashed_at = time.perf_counter()
                out.seconds["load"] += hashed_at - started
                if not online:
                    refuse_unseen(model, rank.name)
                    first[rank.name] = rank_digests(model, rank.prefix)
                    out.seconds["hash"] += time.perf_counter() - hashed_at
                drop_tensors(model)
                del model
                gc.collect(0)  # the rank's cycles (all still young: young_garbage), before the next rank
            reduce.reduce()
            if not reduce.needed and len(first) == len(ranks):
                for rank in ranks:
                    rank.put(first[rank.name])
                return ranks
        for rank in ranks:
            if progress is not None:
                progress(rank.name)
            started = time.perf_counter()
            with reduce.for_rank(rank.pp_rank, rank.tp_rank):
                model = load_and_process(config, source, rank, tp, pp, dp, allow_unwritten)
            hashed_at = time.perf_counter()
            out.seconds["load"] += hashed_at - started
            refuse_unseen(model, rank.name)
            rank.put(rank_digests(model, rank.prefix))
            out.seconds["hash"] += time.perf_counter() - hashed_at
            drop_tensors(model)
            del model
            gc.collect(0)
        return ranks


def _online_ranks(
    config: Any,
    source: Any,
    ranks: list[Any],
    tp: int,
    pp: int,
    dp: int,
    allow_unwritten: bool,
    out: Any,
    reduce: AmaxReduce,
    progress: Any,
) -> bool:
    """Online FP8 at TP > 1 in one pass: every rank built and loaded once,
    its layers whose amax vLLM all-reduces held back (their amaxes
    recorded, :func:`.online_process.holding_back`); then, the amaxes
    reduced, each rank's held layers processed by vLLM, and every rank
    hashed. Every rank is alive at once, so the pass goes on only while all
    of them would fit in half the memory available (:func:`.warm_memory.spare_bytes`,
    judged after each rank), and only while every reduced amax came from a
    held layer; else ``False``, nothing kept, for the two passes."""
    import time

    from weight_checker.expected.rank import on_rank
    from weight_checker.expected.vllm import deferred_rows, fp8_kernels, online_process, warm_memory

    loaded: list[tuple[Any, Any, list[Any], list[Any]]] = []
    # A held layer's amax is read once (its shadow's), and its weight's
    # copies stay deferred until vLLM processes it (read where they lie).
    with fp8_kernels.remembering_amaxes():
        try:
            before = warm_memory.POOL.live_bytes()
            # What the pool kept from the last call is touched memory the kernel
            # does not count as available, yet this call reuses it.
            budget = warm_memory.spare_bytes() + warm_memory.POOL.kept_bytes
            largest = so_far = 0
            for rank in ranks:
                if progress is not None:
                    progress(f"{rank.name} (load)")
                started = time.perf_counter()
                held: list[Any] = []
                handed: list[Any] = []
                # A held layer's copies stay deferred past its rank's load only
                # where the weights outlive it (a callable's may be refilled or
                # freed for the next rank: then they are written as it ends).
                keep = None if source.fresh_per_rank else handed
                with reduce.recording(rank.pp_rank, rank.tp_rank), online_process.holding_back(held, keep):
                    # Fused casts: the layers whose amax is reduced are held back.
                    model = load_and_process(config, source, rank, tp, pp, dp, allow_unwritten, fuse=True)
                loaded.append((rank, model, held, handed))
                online_process.submit_final(model, skip=held)  # all but the held layers written now
                out.seconds["load"] += time.perf_counter() - started
                recorded = len(reduce.recorded.get((rank.pp_rank, rank.tp_rank), []))
                # Judged after every rank: what is alive, and the largest rank so
                # far for each rank still to load (a pipeline stage may hold more
                # layers, or the lm_head).
                live = warm_memory.POOL.live_bytes() - before
                largest, so_far = max(largest, live - so_far), live
                if recorded != len(held) or live + (len(ranks) - len(loaded)) * largest > budget:
                    # An amax reduced by a layer that was not held back (its order
                    # among the held ones is unknown), or the ranks would not fit:
                    # the two passes, which record and apply every call in order.
                    reduce.recorded.clear()
                    return False
            reduce.reduce()
            started = time.perf_counter()
            for rank, model, held, handed in loaded:
                if progress is not None:
                    progress(rank.name)
                with (
                    on_rank(config, config, config.model_config, rank, tp, pp, dp, None),
                    fp8_kernels.fast(),
                    warm_memory.serving(mode=False),  # the pool the mode below serves from
                    deferred_rows.DeferredCopies(serves=True, adopt=handed),
                    reduce.for_rank(rank.pp_rank, rank.tp_rank),
                ):
                    process_held(held, rank.name)
                refuse_unseen(model, rank.name)
                held.clear()
                handed.clear()
            hashed_at = time.perf_counter()
            out.seconds["load"] += hashed_at - started
            # Every rank's tensors in one call: a rank's alone are too few to keep
            # both cores' lanes busy (hashed rank by rank, two TP=2 ranks took twice
            # one TP=1 rank of the same bytes).
            digests = ranks_digests([(model, rank.prefix) for rank, model, _, _ in loaded])
            for (rank, _, _, _), rank_keys in zip(loaded, digests, strict=True):
                rank.put(rank_keys)
            out.seconds["hash"] += time.perf_counter() - hashed_at
            return True
        finally:
            # However the call ends: vLLM's layerwise loader keeps each layer
            # reachable after it (a weak table whose values reach their keys), so
            # a model not emptied here would hold its memory for good.
            for _, model, held, handed in loaded:
                held.clear()
                handed.clear()
                drop_tensors(model)
            loaded.clear()


def process_held(held: list[Any], rank_name: str) -> None:
    """:func:`.online_process.process_held`, vLLM's error in one line."""
    import torch

    from weight_checker.expected.vllm import online_process

    with vllms_processing_error(f"{rank_name}: "), torch.no_grad():
        online_process.process_held(held)


def drop_tensors(model: Any) -> None:
    """Lets go of a hashed rank's parameters and buffers now. A model's
    modules hold one another in cycles (a layer's weight loaders close over
    the layer), so ``del`` frees nothing until a full garbage collection:
    their memory could not go back to the pool for the next rank or call."""
    for module in model.modules():
        module._parameters.clear()
        module._buffers.clear()


def load_and_process(
    config: Any,
    source: Any,
    rank: Any,
    tp: int,
    pp: int,
    dp: int,
    allow_unwritten: bool,
    zero: list[tuple[str, list[int], int]] | None = None,
    amax_only: bool = False,
    fuse: bool | None = None,
    shard_of: list[tuple[str, int, int]] | None = None,
) -> Any:
    """One rank's model: built by vLLM on the CPU, loaded with one pass of
    the weights by its own ``load_weights``, then processed by vLLM.
    ``zero``: ``[(layer, rows, tp rank of the key)]``, those rows of each
    layer's weight zeroed before it is quantized (:func:`_zeroed_again`).
    ``shard_of``: ``[(layer, tp rank, the rank whose shard it loads)]``
    (:func:`_mark_shard_of`).
    ``fuse``: each weight cast in the read of its amax (:func:`.fp8_kernels.fast`);
    by default at TP=1, where no amax is reduced (a reduced one wastes the cast)."""

    from weight_checker.expected.rank import on_rank
    from weight_checker.expected.vllm import deferred_rows, fp8_kernels, warm_memory
    from weight_checker.expected.vllm.rank_model import in_a_clean_thread

    model_config = config.model_config
    # Online FP8 quantizes as the load completes each layer (and in process()):
    # its arithmetic by the core, the same bytes (fp8_kernels); ``amax_only``:
    # a pass whose model is dropped once its amaxes are recorded.
    # Its large allocations (parameters, materialized weights, FP8 outputs)
    # come from memory the previous call touched (warm_memory).
    # Online FP8 reads the weights' rows where they lie, never copied into
    # the bf16 weight vLLM materializes (deferred_rows, whose mode serves the
    # allocations too).
    online = getattr(model_config, "quantization", None) in ONLINE
    with (
        on_rank(config, config, model_config, rank, tp, pp, dp, None),
        fp8_kernels.fast(amax_only, fuse=tp == 1 if fuse is None else fuse),
        warm_memory.serving(mode=not online),
    ):
        model = in_a_clean_thread(_build_warm, config, model_config)
        try:
            if zero:
                _mark_zero_rows(model, rank, zero)
            if shard_of:
                _mark_shard_of(model, rank, shard_of)
            weights = source.read()
            deferred = deferred_rows.DeferredCopies(discard=amax_only, serves=True) if online else None
            with deferred if deferred is not None else contextlib.nullcontext():
                _load_and_process(model, model_config, weights, deferred, rank, allow_unwritten)
        except BaseException:
            drop_tensors(model)  # its memory back now: vLLM's loader keeps the layers reachable
            raise
    return model


def _load_and_process(
    model: Any, model_config: Any, weights: Any, deferred: Any, rank: Any, allow_unwritten: bool
) -> None:
    import torch

    from weight_checker.expected.vllm.rank_model import one_line, unwritten_of
    from weight_checker.expected.weights import Tracked

    note = deferred.note_source if deferred is not None and weights.stable else None
    try:
        with torch.no_grad():
            loaded = model.load_weights(iter(Tracked(weights.pairs, note)))
    except ExpectedDigestsError:
        raise
    except Exception as e:
        raise ExpectedDigestsError(f"the weights: vLLM's loader failed: {one_line(e)}") from e
    # A quantized layer's scales and zero points may be its method's to
    # write after the load (online FP8 creates weight_scale for the
    # processing to fill); its weights never are: a weight the load left
    # out is unwritten, as any other layer's parameter.
    from weight_checker.hashing.unseen import holds_weights

    owned = {
        f"{name}.{p}" if name else p
        for name, module in model.named_modules()
        if _quantized_layer(module)
        for p in getattr(module, "_parameters", {})
        if not holds_weights(p)
    }
    unwritten = [n for n in unwritten_of(model, loaded if isinstance(loaded, set) else None) if n not in owned]
    process(model, model_config)
    if unwritten and not allow_unwritten:
        shown = ", ".join(unwritten[:5]) + (" ..." if len(unwritten) > 5 else "")
        raise ExpectedDigestsError(
            f"the weights never wrote {len(unwritten)} target parameter(s) of {rank.name}: {shown}"
        )


def _build_warm(config: Any, model_config: Any) -> Any:
    """vLLM's build of a quantized rank, its parameters from warm memory
    (in the clean thread that builds it: function modes are per thread)."""
    from weight_checker.expected.vllm import warm_memory
    from weight_checker.expected.vllm.rank_model import build_model

    with warm_memory.serving():
        return build_model(config, model_config, {}, quantized=True)


def _mark_zero_rows(model: Any, rank: Any, zero: list[tuple[str, list[int], int]]) -> None:
    """Marks each layer of ``zero`` in this rank's model to have its rows
    zeroed before quantization: on the key's own rank, and on every rank of
    a row-parallel layer (each holds a part of every row, and the amax of a
    row is reduced over all of them); a rank's own key wins."""
    layers = dict(model.named_modules())
    for layer_name, rows, key_tp in sorted(zero, key=lambda z: z[2] == rank.tp_rank):
        layer = layers.get(layer_name)
        if layer is None:
            raise ExpectedDigestsError(f"{rank.name}: no layer {layer_name!r} to zero channels of")
        row_parallel = getattr(layer, "input_size", None) != getattr(layer, "input_size_per_partition", None)
        if key_tp == rank.tp_rank or row_parallel:
            setattr(layer, ZERO_ROWS, list(rows))


def _mark_shard_of(model: Any, rank: Any, shard_of: list[tuple[str, int, int]]) -> None:
    """Makes each layer of ``shard_of`` on its rank load another rank's
    shard, as a loader that narrowed at the wrong rank would: vLLM's
    row-parallel loaders narrow at the layer's ``tp_rank`` (stamped on its
    parameters too), so that is set to the other rank's."""
    layers = dict(model.named_modules())
    for layer_name, key_tp, source_tp in shard_of:
        layer = layers.get(layer_name)
        if layer is None:
            raise ExpectedDigestsError(f"{rank.name}: no layer {layer_name!r} to load another shard into")
        if key_tp == rank.tp_rank:
            layer.tp_rank = source_tp
            stamp = getattr(layer, "update_param_tp_status", None)
            if stamp is not None:
                stamp()


def _quantized_layer(module: Any) -> bool:
    method = getattr(module, "quant_method", None)
    return method is not None and not type(method).__name__.startswith("Unquantized")


def ranks_digests(models: list[tuple[Any, str]]) -> list[dict[str, str]]:
    """:func:`rank_digests` of each ``(model, prefix)``, hashed in one call."""
    from weight_checker.hashing import idle
    from weight_checker.hashing.digests import checksum
    from weight_checker.hashing.walk import collect
    from weight_checker.integrations.vllm.scope_walk import vllm_checksum_targets

    all_names: list[str] = []
    all_tensors: list[Any] = []
    for model, prefix in models:
        targets = vllm_checksum_targets(model)
        names, tensors = collect(model if targets is None else targets)
        all_names += [prefix + n for n in names]
        all_tensors += tensors
    if len(set(all_names)) != len(all_names):
        checksum(list(zip(all_names, all_tensors, strict=True)))  # raises, naming the tensor given twice
    digests = dict(zip(all_names, idle.digests(all_names, all_tensors), strict=True))
    return [{k: d for k, d in digests.items() if k.startswith(prefix)} for _, prefix in models]


def rank_digests(model: Any, prefix: str) -> dict[str, str]:
    """The worker's walk of the processed model (what vLLM's checksum covers), hashed."""
    from weight_checker.hashing.digests import checksum
    from weight_checker.integrations.vllm.scope_walk import vllm_checksum_targets

    targets = vllm_checksum_targets(model)
    return checksum(model if targets is None else targets, prefix)
