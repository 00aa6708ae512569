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

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected_weights import CheckpointWeights, Tracked, weights_source
from weight_checker.keys import rank_prefix
from weight_checker.rank_groups import rank_groups

__all__ = ["CheckpointWeights", "ExpectedDigests", "ExpectedDigestsError", "expected_digests", "release_buffers"]


class ExpectedDigests(dict[str, str]):
    """``{key: hex}`` for every key the engine reports, plus what produced them."""

    #: The vLLM version whose model class and loader ran.
    vllm_version: str = ""
    #: ``{"tp": T, "pp": P, "dp": D, "dtype": ..., "architecture": ...}``
    layout: dict[str, Any]
    #: Keys of parameters the weights never wrote (not in the mapping: their
    #: bytes would be uninitialized memory, so they are never hashed).
    unwritten: list[str]
    #: Seconds spent building and loading the rank models, and hashing them.
    seconds: dict[str, float]

    def manifest(self) -> dict[str, Any]:
        """The ``checksum`` manifest format, with the provenance beside it."""
        return {
            "checksums": dict(sorted(self.items())),
            "vllm_version": self.vllm_version,
            "layout": self.layout,
            "unwritten": self.unwritten,
        }


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
    of this one buffer instead, which is zeroed first: bytes that the weights
    do not write read as zeros, never as what an earlier rank or step left
    there. The buffer is the size of the largest rank seen;
    :func:`release_buffers` frees it.
    """

    ALIGN = 64

    def __init__(self) -> None:
        self.buffer: Any = None

    def bind(self, model: Any) -> None:
        import torch

        params = [p for _, p in model.named_parameters() if p.device.type == "cpu" and p.numel() > 0]
        sizes = [-(-p.nbytes // self.ALIGN) * self.ALIGN for p in params]
        total = sum(sizes)
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = None
            self.buffer = torch.empty(total, dtype=torch.uint8)
        self.buffer[:total].zero_()
        offset = 0
        for p, size in zip(params, sizes, strict=True):
            view = self.buffer[offset : offset + p.nbytes].view(p.dtype).view(p.shape)
            p.data = view
            offset += size


_ARENA = _Arena()


def release_buffers() -> None:
    """Frees the parameter memory :func:`expected_digests` keeps between calls."""
    _ARENA.buffer = None


def _refuse_quantized_config(checkpoint: Path) -> None:
    """A model directory's config, checked before vLLM reads it."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except FileNotFoundError:
        raise ExpectedDigestsError(f"{checkpoint}: not a model directory (no config.json)") from None
    except (OSError, ValueError) as e:
        raise ExpectedDigestsError(f"{checkpoint / 'config.json'}: cannot read: {e}") from None
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


def expected_digests(
    model: Any,
    weights: Any = None,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    dtype: str | None = None,
    allow_unwritten: bool = False,
    progress: Callable[[str], None] | None = None,
    **engine_args: Any,
) -> ExpectedDigests:
    """``{key: hex}`` for every ``dp{d}:pp{p}:pcp0:tp{t}:{name}`` an engine
    started with this model and layout reports after loading ``weights``.

    ``model``: a checkpoint directory (its config and, unless ``weights`` is
    given, its weights), a ``vllm.EngineArgs``, or a mapping of the engine
    arguments the server was started with (``{"model": dir, "dtype": ...}``;
    ``engine_args`` add to them). ``weights``: a checkpoint (path), or the
    trainer's ``(hf_name, tensor)`` pairs as a mapping, a list, ``.items()``
    or a callable returning a fresh iterable (every rank reads them all).

    Raises :class:`ExpectedDigestsError` naming the tensor or the reason, and,
    unless ``allow_unwritten``, when the weights leave a parameter unwritten.
    """
    for label, n in (("tp", tp), ("pp", pp), ("dp", dp)):
        if not isinstance(n, int) or n < 1:
            raise ExpectedDigestsError(f"{label} must be a positive integer, got {n!r}")
    checkpoint = Path(model) if isinstance(model, (str, Path)) else None
    if checkpoint is not None:
        _refuse_quantized_config(checkpoint)
    source = weights_source(weights, checkpoint, tp * pp)

    import torch
    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.model_loader.weight_tying import maybe_retie_word_embeddings
    from vllm.utils.torch_utils import set_default_torch_dtype

    import weight_checker

    try:
        config = _engine_args(model, tp, pp, dtype, engine_args).create_engine_config()
    except Exception as e:
        reason = " ".join(str(e).split()).split(" Supported architectures:")[0]
        raise ExpectedDigestsError(f"vLLM cannot configure this model: {reason[:300]}") from None
    model_config = config.model_config
    if model_config.quantization is not None:
        raise ExpectedDigestsError(
            f"quantized model ({model_config.quantization}): its post-load processing changes bytes; not supported"
        )
    out = ExpectedDigests()
    out.vllm_version = vllm.__version__
    out.layout = {
        "tp": tp, "pp": pp, "dp": dp, "dtype": str(model_config.dtype).removeprefix("torch."),
        "architecture": model_config.architecture,
    }  # fmt: skip
    out.unwritten = []
    out.seconds = {"load": 0.0, "hash": 0.0}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            if progress is not None:
                progress(f"pp{pp_rank}:tp{tp_rank}")
            config.compilation_config.static_forward_context.clear()
            started = time.perf_counter()
            with (
                rank_groups(tp_rank, tp, pp_rank, pp),
                set_current_vllm_config(config),
                set_default_torch_dtype(model_config.dtype),
                torch.device("cpu"),
            ):
                try:
                    rank_model = initialize_model(vllm_config=config)
                except ExpectedDigestsError:
                    raise
                except Exception as e:
                    raise ExpectedDigestsError(
                        f"vLLM cannot build {model_config.architecture}: {' '.join(str(e).split())[:300]}"
                    ) from None
                _refuse_byte_changing_post_load(rank_model)
                _ARENA.bind(rank_model)
                tracked = Tracked(source())
                try:
                    loaded = rank_model.load_weights(iter(tracked))
                except ExpectedDigestsError:
                    raise
                except Exception as e:
                    where = f"tensor '{tracked.current}'" if tracked.current else "the weights"
                    message = " ".join(str(e).split())[:300] or type(e).__name__
                    raise ExpectedDigestsError(f"{where}: vLLM's loader failed: {message}") from None
                maybe_retie_word_embeddings(rank_model, model_config)
            names = [n for n, _ in rank_model.named_parameters()]
            unwritten = sorted(set(names) - set(loaded)) if isinstance(loaded, set) else []
            if unwritten and not allow_unwritten:
                shown = ", ".join(unwritten[:5]) + (" ..." if len(unwritten) > 5 else "")
                raise ExpectedDigestsError(
                    f"the weights never wrote {len(unwritten)} parameter(s) of pp{pp_rank}:tp{tp_rank}: {shown}"
                )
            prefix = rank_prefix(0, pp_rank, 0, tp_rank)
            loaded_at = time.perf_counter()
            digests = weight_checker.checksum(rank_model, prefix=prefix)
            out.seconds["load"] += loaded_at - started
            out.seconds["hash"] += time.perf_counter() - loaded_at
            skipped = {prefix + n for n in unwritten}
            for key in list(digests):
                # A SharedWeightParameter or tensor subclass reports name.{part}.
                if key in skipped or key.rsplit(".", 1)[0] in skipped:
                    del digests[key]
            for d in range(dp):
                replica = rank_prefix(d, pp_rank, 0, tp_rank)
                out.update({replica + k[len(prefix) :]: v for k, v in digests.items()})
                out.unwritten += [replica + k[len(prefix) :] for k in sorted(skipped)]
            del rank_model, digests
    return out
