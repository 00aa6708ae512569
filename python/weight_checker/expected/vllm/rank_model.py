"""One rank's model, built and loaded by vLLM's own code on the CPU: the
engine configuration, the parameter arena, and the refusals that keep the
result exact (quantized layers, post-load processing that changes bytes)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.vllm.load_tracker import LoadTracker
from weight_checker.expected.weights import CheckpointWeights, Pass, Tracked, WeightsSource

if TYPE_CHECKING:  # .deferred needs torch: imported when a rank is built, so `import weight_checker` does not
    from weight_checker.expected.vllm.deferred import DeferredWrites


def _engine_args(model: Any, tp: int, pp: int, dtype: str | None, engine_args: Mapping[str, Any]) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    if isinstance(model, EngineArgs):
        return model
    if isinstance(model, Mapping):
        engine_args = {**model, **engine_args}
    else:
        engine_args = {"model": str(model), **engine_args}
    defaults = {"skip_tokenizer_init": True, "enforce_eager": True, "max_model_len": 256}
    args = {**defaults, **engine_args, "tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    if dtype is not None:
        args["dtype"] = dtype
    # A server of another vLLM states settings this one may not have: one
    # left at its default changes nothing (any other is vLLM's error).
    if dataclasses.is_dataclass(EngineArgs):
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        args = {k: v for k, v in args.items() if k in known or not isinstance(v, _SCALAR) or v not in _UNSET}
    return EngineArgs(**args)


#: Values that leave an engine argument at vLLM's default (``False`` == 0 too).
_UNSET: tuple[Any, ...] = (None, False, "auto", "linear", {}, [])
_SCALAR = (type(None), bool, int, str, dict, list)


class Arena:
    """One rank's parameter memory, kept from call to call.

    A freshly built model's parameters are untouched allocations, so the
    loader's copy into them pays a page fault and the kernel's zeroing for
    every 4 KiB (here 0.38 s for 1.7 GB, against 0.10 s for the same copy
    into memory already touched). Each rank's parameters are rebound to views
    of this one buffer instead. Bytes that the weights do not write read as
    zeros, never as what an earlier rank or step left there: the caller zeroes
    the parameters the load will not write in full, or the whole buffer
    (:func:`build_and_load`). The buffer is the size of the largest rank
    seen; :func:`release_buffers` frees it.
    """

    ALIGN = 64

    def __init__(self) -> None:
        self.buffer: Any = None

    def bind(self, model: Any, zero: bool = True) -> list[Any]:
        """Rebinds ``model``'s parameters to views of the buffer, zeroed
        first unless ``zero`` is false (then the caller zeroes what the load
        will not write); returns the parameters bound."""
        import torch

        params = [p for _, p in model.named_parameters() if p.device.type == "cpu" and p.numel() > 0]
        sizes = [-(-p.nbytes // self.ALIGN) * self.ALIGN for p in params]
        total = sum(sizes)
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = None
            self.buffer = torch.empty(total, dtype=torch.uint8)
        if zero:
            self.buffer[:total].zero_()
        offset = 0
        for p, size in zip(params, sizes, strict=True):
            view = self.buffer[offset : offset + p.nbytes].view(p.dtype).view(p.shape)
            p.data = view
            offset += size
        return params


#: The target's ranks, and the draft's (hashed while the target's are kept).
TARGET_ARENA = Arena()
DRAFT_ARENA = Arena()


class ModelCache:
    """The engine configuration and the rank models of the latest call, kept
    for the next call with the same configuration (a trainer makes one call
    per step): on small models, building a model and configuring vLLM cost
    more than loading it. The models' parameters live in the arenas, so
    keeping them costs only the module objects; each call binds them to the
    zeroed arena again before loading, as a fresh model would be."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.config: Any = None
        #: rank -> (model, its worker LoRA manager or None).
        self.models: dict[str, tuple[Any, Any]] = {}

    def config_for(self, key: str | None, make: Callable[[], Any]) -> Any:
        """The configuration for ``key`` (``None``: not cached), made if new."""
        if key is None or key != self.key:
            self.key, self.config, self.models = key, make(), {}
        return self.config


CACHE = ModelCache()

#: One call at a time (``expected_digests``, ``expected_tensors``): the arenas and the model cache are the process's.
LOCK = threading.Lock()


def release_buffers() -> None:
    """Frees the parameter memory, the models, the checkpoint mappings and
    the quantized ranks' memory pool (``warm_memory.POOL``) that
    :func:`weight_checker.expected_digests` keeps between calls."""
    from weight_checker.expected.weights import MAPPINGS

    TARGET_ARENA.buffer = None
    DRAFT_ARENA.buffer = None
    MAPPINGS.clear()
    warm = sys.modules.get("weight_checker.expected.vllm.warm_memory")  # imported with torch, when a rank was built
    if warm is not None:
        warm.POOL.clear()
    sglangs = sys.modules.get("weight_checker.expected.sglang.digests")  # imported for an SGLang engine's digests
    if sglangs is not None:
        sglangs.SGLANG_ARENA.buffer = None
    CACHE.key, CACHE.config, CACHE.models = None, None, {}


def cache_key(model: Any, settings: Mapping[str, Any]) -> str | None:
    """What a cached configuration is valid for: the engine's arguments and
    the model directory's config file as it is now (``None``: not cacheable)."""
    if isinstance(model, Mapping):
        directory: Any = model.get("model")
    elif isinstance(model, (str, Path)):
        directory = model
    else:
        return None
    try:
        # Its content, not its time: a config copied with its time kept
        # (``cp -p``, rsync) or rewritten within a coarse clock tick is new.
        config = (Path(directory) / "config.json").read_bytes() if directory is not None else b""
        stamp: Any = hashlib.sha256(config).hexdigest()
    except OSError:
        stamp = 0  # not a local directory (a hub id): its arguments (revision included) are the key
    described = {"model": model if isinstance(model, Mapping) else str(model), "stamp": stamp, **settings}
    try:
        return json.dumps(described, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None


def refuse_quantized_config(checkpoint: Path, allow: tuple[str, ...] = ()) -> str | None:
    """A model directory's config, checked before vLLM reads it: its
    quantization method (``None``: not quantized) where it is one of
    ``allow``, else the refusal naming it."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except FileNotFoundError as e:
        raise ExpectedDigestsError(f"{checkpoint}: not a model directory (no config.json)") from e
    except (OSError, ValueError) as e:
        raise ExpectedDigestsError(f"{checkpoint / 'config.json'}: cannot read: {e}") from e
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if quant is None:
        return None
    method = quant.get("quant_method", "unknown method") if isinstance(quant, dict) else "unknown method"
    if method in allow:
        return str(method)
    if allow:
        raise ExpectedDigestsError(
            f"{checkpoint}: quantized model (quant_method {method!r}): not a format this project reproduces "
            f"(known: {', '.join(allow)}); its digests are not guessed"
        )
    raise ExpectedDigestsError(
        f"{checkpoint}: quantized model ({method}): its post-load processing changes bytes; not supported"
    )


_NO_OP_ON_GPU = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod")


def _refuse_byte_changing_post_load(model: Any) -> None:
    """Post-load processing that changes parameter bytes on a GPU cannot be
    reproduced here exactly: name the layers instead of approximating."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    changing = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase) and type(method).__name__ not in _NO_OP_ON_GPU:
            changing.append(f"{name or '<root>'} ({type(method).__name__})")
    if changing:
        shown = ", ".join(changing[:5]) + (f" and {len(changing) - 5} more" if len(changing) > 5 else "")
        raise ExpectedDigestsError(f"post-load processing changes the bytes of these layers: {shown}")
    if callable(getattr(type(model), "process_weights_after_loading", None)):
        raise ExpectedDigestsError(f"{type(model).__name__} post-processes its weights after loading")


def in_a_clean_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, run in a thread of its own: what vLLM imports or
    builds there runs in frames that hold nothing of the caller's.

    vLLM keeps some exceptions raised while its modules are imported (e.g.
    ``vllm.multimodal.media.audio``'s ``_torchcodec_import_exc``, a failed
    torchcodec import), and with them their traceback: every frame above the
    import, up to the caller's own, stays alive with its locals for the life
    of the process. Imported from a trainer's ``expected_digests(...)``, that
    kept the first call's weights (and the trainer's locals: a gathered copy
    of the model under ZeRO-3). A fresh thread's stack ends at the thread."""
    done: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            done.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # re-raised in the caller's thread
            done.append((False, e))

    thread = threading.Thread(target=run, name="weight-checker-vllm", daemon=True)
    thread.start()
    thread.join()
    ok, value = done.pop()
    if ok:
        return value
    raise value


#: The vLLM modules a call uses, imported first in a clean thread (see
#: :func:`in_a_clean_thread`): the target model's, and LoRA's and drafts' where asked.
VLLM_MODULES = (
    "vllm",
    "vllm.engine.arg_utils",
    "vllm.config",
    "vllm.distributed.parallel_state",
    "vllm.utils.torch_utils",
    "vllm.model_executor.model_loader.utils",
    "vllm.model_executor.model_loader.weight_utils",
    "vllm.model_executor.model_loader.weight_tying",
    "vllm.model_executor.layers.quantization.base_config",
)
LORA_MODULES = (
    "vllm.lora.worker_manager",
    "vllm.lora.model_manager",
    "vllm.lora.punica_wrapper.punica_cpu",
    "vllm.lora.request",
    "vllm.lora.lora_model",
    "vllm.lora.peft_helper",
)
DRAFT_MODULES = ("vllm.v1.spec_decode.draft_model",)


def import_vllm(lora: bool = False, draft: bool = False) -> None:
    """Imports what a call uses of vLLM (run it in a clean thread)."""
    import importlib

    for name in (*VLLM_MODULES, *(LORA_MODULES if lora else ()), *(DRAFT_MODULES if draft else ())):
        importlib.import_module(name)


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def engine_config(model: Any, tp: int, pp: int, dtype: str | None, engine_args: Mapping[str, Any]) -> Any:
    """vLLM's configuration of the engine these digests are for."""
    try:
        return _engine_args(model, tp, pp, dtype, engine_args).create_engine_config()
    except Exception as e:
        reason = one_line(e).split(" Supported architectures:")[0]
        raise ExpectedDigestsError(f"vLLM cannot configure this model: {reason}") from e


def rank_config(model: Any, tp: int, pp: int, dp: int, dtype: str | None, engine_args: Mapping[str, Any]) -> Any:
    """vLLM's configuration of each rank: a dense model's DP replicas are
    independent engines (DP size 1, as vLLM reconfigures them); a MoE model's
    ranks are configured with the engine's DP size."""
    config = engine_config(model, tp, pp, dtype, engine_args)
    if dp > 1 and config.model_config.is_moe:
        config = engine_config(model, tp, pp, dtype, {**engine_args, "data_parallel_size": dp})
    return config


def build_and_load(
    vllm_config: Any,
    model_config: Any,
    source: WeightsSource,
    arena: Arena,
    model: Any = None,
    **build: Any,
) -> tuple[Any, set[str] | None, DeferredWrites]:
    """One rank's model (the caller set vLLM's current config, dtype, device
    and rank groups), its parameters bound to ``arena`` and loaded with one
    pass of ``source``; with the names ``load_weights`` says it loaded
    (``None`` where it does not say), and the loader's plain copies of stable
    weights, deferred (:mod:`.deferred`: hash with its ``checksum``, or
    ``flush`` it before anything else reads the parameters). ``model``: one
    built before for the same configuration and rank (:class:`ModelCache`),
    loaded again. ``build``: more arguments of ``initialize_model``.

    Stable weights (:class:`~weight_checker.expected.weights.Pass`): only the parameters the load
    does not write in full are zeroed first (:mod:`.load_tracker`); should a
    tracked one be left incomplete, the rank is read again into a fully zeroed
    arena, so no byte of an earlier load is ever hashed. Other weights are
    read once: the arena is zeroed whole first, and every copy is made as the
    loader reads it."""
    # torch: deferred.py imports it; loaded only when a rank's weights are loaded
    from weight_checker.expected.vllm.deferred import DeferredWrites

    if model is None:
        model = in_a_clean_thread(build_model, vllm_config, model_config, build)
    _restore_buffers(model)
    weights = source.read()
    if not weights.stable:
        params = arena.bind(model, zero=True)
        deferred = DeferredWrites(arena.buffer, params)
        return model, load_weights_into(model, model_config, weights, None, deferred), deferred
    params = arena.bind(model, zero=False)
    tracker = LoadTracker(model)
    for p in params:
        if not tracker.tracked(p):
            p.data.zero_()
    deferred = DeferredWrites(arena.buffer, params)
    loaded = load_weights_into(model, model_config, weights, tracker, deferred)
    if tracker.incomplete([p for _, p in model.named_parameters()]):
        params = arena.bind(model, zero=True)
        deferred = DeferredWrites(arena.buffer, params)
        loaded = load_weights_into(model, model_config, source.read(), LoadTracker(model), deferred)
    return model, loaded, deferred


def build_model(vllm_config: Any, model_config: Any, build: dict[str, Any], quantized: bool = False) -> Any:
    """A rank's model, as vLLM builds it on the CPU (the caller set vLLM's
    current config, dtype and rank groups; run in a clean thread).
    ``quantized``: its post-load processing will be run (:mod:`.quantized`),
    so layers that change bytes after loading are expected, not refused."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model

    # torch: default_dtype.py imports it; loaded only when a rank is built
    from weight_checker.expected.vllm.default_dtype import thread_default_dtype

    try:
        # Both function modes, this thread's own.
        with torch.device("cpu"), thread_default_dtype(model_config.dtype):
            model = initialize_model(vllm_config=vllm_config, model_config=model_config, **build)
    except ExpectedDigestsError:
        raise
    except Exception as e:
        raise ExpectedDigestsError(f"vLLM cannot build {model_config.architecture}: {one_line(e)}") from e
    if not quantized:
        _refuse_byte_changing_post_load(model)
    _keep_buffers(model)
    _tie_as_the_engine_started(model, model_config)
    return model


#: A built model's persistent buffers as built: ``[(buffer, its value)]``.
_INITIAL_BUFFERS = "_weight_checker_initial_buffers"


def _keep_buffers(model: Any) -> None:
    from weight_checker.hashing.walk import persistent_buffers

    setattr(model, _INITIAL_BUFFERS, [(b, b.detach().clone()) for _, b in persistent_buffers(model)])


def _restore_buffers(model: Any) -> None:
    """The persistent buffers as the model was built, before each load: a
    cached model must not carry what an earlier call's weights wrote into
    them (a buffer the next weights do not write keeps its built value, as in
    an engine loaded with them)."""
    import torch

    with torch.no_grad():
        for buffer, value in getattr(model, _INITIAL_BUFFERS, ()):
            buffer.copy_(value)


def _tie_as_the_engine_started(model: Any, model_config: Any) -> None:
    """A config that says the word embeddings are tied, with a checkpoint that
    ships an ``lm_head`` too: vLLM builds the ``lm_head`` untied, and ties it
    again once the engine has loaded its checkpoint if the two are equal
    (``maybe_retie_word_embeddings``). A model built here must start as that
    engine did, whatever weights this call loads (the trainer's, with no
    ``lm_head``: a tied model has none): the two tensors of the engine's own
    checkpoint are loaded into it first, and vLLM decides."""
    if not getattr(model_config, "word_embeddings_untied_by_checkpoint", False):
        return
    from vllm.model_executor.model_loader.weight_tying import _get_untied_lm_head, maybe_retie_word_embeddings

    untied = _get_untied_lm_head(model)
    if untied is None:
        return
    embed = next(n for n, m in model.named_modules() if m is untied.embed_tokens)
    try:
        checkpoint = CheckpointWeights(Path(model_config.model))
    except ExpectedDigestsError as e:
        raise ExpectedDigestsError(
            f"{model_config.model}: the config ties the word embeddings but the checkpoint has an lm_head; "
            f"whether the engine tied them again depends on that checkpoint, which cannot be read: {e}"
        ) from e
    wanted = (untied.weight_name, f"{embed}.weight")
    pairs = [(n, t) for n, t in checkpoint if n.endswith(wanted)]
    try:
        model.load_weights(iter(pairs if len(pairs) == 2 else checkpoint))
        maybe_retie_word_embeddings(model, model_config)
    except Exception as e:
        raise ExpectedDigestsError(f"vLLM's loader failed on the checkpoint's embeddings: {one_line(e)}") from e


def load_weights_into(
    model: Any, model_config: Any, weights: Pass, tracker: LoadTracker | None, deferred: DeferredWrites
) -> set[str] | None:
    """``weights`` fed to ``model``'s own ``load_weights`` under ``tracker``
    and ``deferred``: the names it says it loaded (``None``: it does not say)."""
    # Only a stable pass's tensors may be read after the loader moves on.
    # No re-tie after the load: vLLM ties the word embeddings again only once,
    # at the engine's start, from its own checkpoint (as the model was built
    # here: _tie_as_the_engine_started); an update never re-ties them, so
    # neither may these weights (equal embeddings and lm_head from a trainer
    # would otherwise tie this cached model and drop lm_head's key).
    tracked = Tracked(weights.pairs, deferred.note_source if weights.stable else None)
    try:
        with tracker if tracker is not None else contextlib.nullcontext(), deferred:
            loaded = model.load_weights(iter(tracked))
    except ExpectedDigestsError:
        raise
    except Exception as e:
        where = f"tensor '{tracked.current}'" if tracked.current else "the weights"
        raise ExpectedDigestsError(f"{where}: vLLM's loader failed: {one_line(e)}") from e
    return loaded if isinstance(loaded, set) else None


def unwritten_of(model: Any, loaded: set[str] | None) -> list[str]:
    """Parameter names ``load_weights`` did not write (none known: ``[]``).
    A LoRA-wrapped model reports its base layers' names without ``.base_layer``."""
    if loaded is None:
        return []
    return sorted(
        n for n, _ in model.named_parameters() if n not in loaded and n.replace(".base_layer", "") not in loaded
    )
