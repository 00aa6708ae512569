"""One rank's model, built and loaded by vLLM's own code on the CPU: the
engine configuration, the parameter arena, and the refusals that keep the
result exact (quantized layers, post-load processing that changes bytes)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.load_tracker import LoadTracker
from weight_checker.expected.weights import Tracked

if TYPE_CHECKING:  # .deferred needs torch: imported when a rank is built, so `import weight_checker` does not
    from weight_checker.expected.deferred import DeferredWrites


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
    return EngineArgs(**args)


class _Arena:
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
TARGET_ARENA = _Arena()
DRAFT_ARENA = _Arena()


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


def release_buffers() -> None:
    """Frees the parameter memory and the models
    :func:`weight_checker.expected_digests` keeps between calls."""
    from weight_checker.expected.weights import MAPPINGS

    TARGET_ARENA.buffer = None
    DRAFT_ARENA.buffer = None
    MAPPINGS.clear()
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
        stamp = (Path(directory) / "config.json").stat().st_mtime_ns if directory is not None else 0
    except OSError:
        stamp = 0  # not a local directory (a hub id): its arguments (revision included) are the key
    described = {"model": model if isinstance(model, Mapping) else str(model), "stamp": stamp, **settings}
    try:
        return json.dumps(described, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None


def refuse_quantized_config(checkpoint: Path) -> None:
    """A model directory's config, checked before vLLM reads it."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except FileNotFoundError as e:
        raise ExpectedDigestsError(f"{checkpoint}: not a model directory (no config.json)") from e
    except (OSError, ValueError) as e:
        raise ExpectedDigestsError(f"{checkpoint / 'config.json'}: cannot read: {e}") from e
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if quant is not None:
        method = quant.get("quant_method", "unknown method") if isinstance(quant, dict) else "unknown method"
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


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def engine_config(model: Any, tp: int, pp: int, dtype: str | None, engine_args: Mapping[str, Any]) -> Any:
    """vLLM's configuration of the engine these digests are for."""
    try:
        return _engine_args(model, tp, pp, dtype, engine_args).create_engine_config()
    except Exception as e:
        reason = one_line(e).split(" Supported architectures:")[0]
        raise ExpectedDigestsError(f"vLLM cannot configure this model: {reason}") from e


def build_and_load(
    vllm_config: Any,
    model_config: Any,
    source: WeightsSource,
    arena: _Arena,
    model: Any = None,
    **build: Any,
) -> tuple[Any, set[str] | None, DeferredWrites]:
    """One rank's model (the caller set vLLM's current config, dtype, device
    and rank groups), its parameters bound to ``arena`` and loaded with the
    weights ``source()`` gives; with the names ``load_weights`` says it
    loaded (``None`` where it does not say), and the loader's plain copies,
    deferred (:mod:`.deferred`: hash with its ``checksum``, or ``flush`` it
    before anything else reads the parameters). ``model``: one built before
    for the same configuration and rank (:class:`ModelCache`), loaded again.
    ``build``: more arguments of ``initialize_model``.

    Only the parameters the load does not write in full are zeroed first
    (:mod:`.load_tracker`); should a tracked one be left incomplete, the rank
    is loaded again into a fully zeroed arena, so no byte of an earlier load
    is ever hashed."""
    from vllm.model_executor.model_loader.utils import initialize_model

    from weight_checker.expected.deferred import DeferredWrites

    if model is None:
        try:
            model = initialize_model(vllm_config=vllm_config, model_config=model_config, **build)
        except ExpectedDigestsError:
            raise
        except Exception as e:
            raise ExpectedDigestsError(f"vLLM cannot build {model_config.architecture}: {one_line(e)}") from e
        _refuse_byte_changing_post_load(model)
    params = arena.bind(model, zero=False)
    tracker = LoadTracker(model)
    for p in params:
        if not tracker.tracked(p):
            p.data.zero_()
    deferred = DeferredWrites(arena.buffer, params)
    loaded = _load(model, model_config, source, tracker, deferred)
    if tracker.incomplete([p for _, p in model.named_parameters()]):
        params = arena.bind(model, zero=True)
        deferred = DeferredWrites(arena.buffer, params)
        loaded = _load(model, model_config, source, LoadTracker(model), deferred)
    return model, loaded, deferred


def _load(
    model: Any, model_config: Any, source: WeightsSource, tracker: LoadTracker, deferred: DeferredWrites
) -> set[str] | None:
    from vllm.model_executor.model_loader.weight_tying import maybe_retie_word_embeddings

    tracked = Tracked(source(), deferred.note_source)
    try:
        with tracker, deferred:
            loaded = model.load_weights(iter(tracked))
            maybe_retie_word_embeddings(model, model_config)  # reads the embeddings: under the mode
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


WeightsSource = Callable[[], Iterable[tuple[str, Any]]]
