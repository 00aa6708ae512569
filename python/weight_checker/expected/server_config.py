"""The engine a running server is, read from the server itself.

``expected_digests(..., like=URL)`` and ``weight-checker expect --server URL``
build the expected digests of the engine behind a vLLM server without
repeating its flags by hand (a server with ``--max-lora-rank 8 --max-loras 2``
checked with vLLM's defaults showed 15 of 47 keys equal: every adapter key
"differed", a false alarm that looks like a sync bug). A dev-mode server
(``VLLM_SERVER_DEV_MODE=1``) states its resolved configuration at
``GET /server_info?config_format=json`` (vLLM's pydantic dump of its
``VllmConfig``; TRL reads it too). Every field of it that changes which
tensors the engine holds, or their bytes, is read here and becomes the
engine argument of the same meaning (:data:`MODEL_FIELDS`,
:data:`LORA_FIELDS`, the layout, a draft model's speculative config); a
field whose effect expected digests cannot reproduce is refused by name
(a quantization this project does not reproduce, or on a device other than
the CPU: :mod:`.vllm.quantized`; class overrides, context parallelism, expert load balancing,
speculative methods other than a draft model, a draft with its own TP size).
A value the caller passed that contradicts the server is an error naming both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weight_checker.errors import ExpectedDigestsError, HttpError
from weight_checker.expected.sglang.server import is_sglang_info, sglang_engine
from weight_checker.httpclient import api_key_from_env, request, validate_url


@dataclass
class ServerEngine:
    """What :func:`server_engine` read: ``expected_digests``' arguments."""

    url: str
    #: The model directory (or hub id) the server loaded.
    model: str
    tp: int
    pp: int
    dp: int
    #: ``expected_digests``' other arguments (engine arguments): dtype, LoRA, draft, EP...
    #: A field the server states as unset is ``None`` here (vLLM's default is used).
    arguments: dict[str, Any] = field(default_factory=dict)
    #: The quantization method the server's engine runs (vLLM's name), or ``None``.
    quantization: str | None = None


def _get(mapping: Any, *path: str) -> Any:
    for part in path:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(part)
    return mapping


#: ``model_config`` fields that change what the model is built from, passed on
#: as the engine argument of the same name: the checkpoint's revision, the
#: config (overrides, its path and format), the implementation, the runner and
#: its conversion (pooling heads), and the context length (some models size
#: their rotary caches by it: ``deepseek_v2``, ``plamo3``, ``minimax_m2``).
MODEL_FIELDS = (
    "max_model_len",
    "revision",
    "code_revision",
    "trust_remote_code",
    "hf_overrides",
    "hf_config_path",
    "config_format",
    "model_impl",
    "runner",
    "convert",
)

#: ``lora_config`` field -> the engine argument: every one that changes the
#: slots' tensors (their shapes: rank, slots, sharding, classifier labels;
#: their dtype; which layers are wrapped, and so which base weights carry
#: ``.base_layer.`` names: target modules, tower/connector; the MoE layouts).
#: Not read, as they change no tensor: ``max_cpu_loras`` (the CPU cache),
#: ``specialize_active_lora`` (kernel grids), ``default_mm_loras`` (adapters
#: chosen per request, held in the same slots as any other).
LORA_FIELDS = {
    "max_lora_rank": "max_lora_rank",
    "max_loras": "max_loras",
    "fully_sharded_loras": "fully_sharded_loras",
    "lora_dtype": "lora_dtype",
    "target_modules": "lora_target_modules",
    "enable_tower_connector_lora": "enable_tower_connector_lora",
    "enable_mixed_moe_lora_format": "enable_mixed_moe_lora_format",
    "enable_moe_shared_loras": "enable_moe_shared_loras",
    "max_lora_cls_labels": "max_lora_cls_labels",
}

#: ``multimodal_config`` fields that leave a tower or the language model unbuilt.
MULTIMODAL_FIELDS = ("language_model_only", "mm_encoder_only")


def server_engine(url: str, *, api_key: str | None = None, timeout: float = 60.0) -> ServerEngine:
    """The engine behind the server at ``url``, from its ``/server_info``."""
    url = validate_url(url)
    try:
        status, body = request(
            "GET", url, "/server_info?config_format=json", timeout=timeout, api_key=api_key_from_env(api_key)
        )
    except HttpError as e:
        raise ExpectedDigestsError(f"{url}: {e.message}") from e
    if status == 404:
        raise ExpectedDigestsError(
            f"{url} serves no /server_info: start it with VLLM_SERVER_DEV_MODE=1 (vLLM states its "
            "configuration only in dev mode), or give the model and its layout by hand"
        )
    if status in (401, 403):
        raise ExpectedDigestsError(f"{url}: unauthorized (HTTP {status}): pass the server's API key")
    if status == 200 and is_sglang_info(body):
        model, tp, pp, dp, arguments = sglang_engine(url, body)
        return ServerEngine(url, model, tp, pp, dp, arguments)
    config = _get(body, "vllm_config")
    if status != 200 or not isinstance(config, dict):
        raise ExpectedDigestsError(f"{url}: /server_info did not give a configuration (HTTP {status})")
    model = _get(config, "model_config", "model")
    if not isinstance(model, str) or not model:
        raise ExpectedDigestsError(f"{url}: /server_info names no model")
    parallel = _get(config, "parallel_config") or {}
    tp = int(parallel.get("tensor_parallel_size") or 1)
    args: dict[str, Any] = {}
    _model_arguments(url, config.get("model_config") or {}, args)
    if _get(config, "model_config", "quantization"):
        _quantized_device(url, config)
    _parallel_arguments(url, parallel, args)
    lora = config.get("lora_config")
    if isinstance(lora, dict):
        args["enable_lora"] = True
        _lora_arguments(url, lora, args)
    spec = config.get("speculative_config")
    if isinstance(spec, dict):
        _draft_arguments(url, spec, tp, args)
    args["engine"] = "vllm"
    quantization = _get(config, "model_config", "quantization")
    return ServerEngine(
        url,
        model,
        tp,
        int(parallel.get("pipeline_parallel_size") or 1),
        int(parallel.get("data_parallel_size") or 1),
        args,
        str(quantization) if quantization else None,
    )


def check_quantization(server: ServerEngine, found: str | None) -> None:
    """The quantization the expected digests were computed for (``found``,
    from the weights' config as vLLM resolves it here) must be the server's:
    a checkpoint's format comes from its config, so other weights than the
    server's (an unquantized checkpoint, another format) would give digests
    of another engine."""
    if (found or None) != server.quantization:
        raise ExpectedDigestsError(
            f"{server.url} runs with quantization = {server.quantization!r}, but these weights' config "
            f"resolves to {found!r} here: their digests would be another engine's (give the server's checkpoint, "
            "or weights of its format)"
        )


def _quantized_device(url: str, config: dict[str, Any]) -> None:
    """A quantized engine's bytes are its kernels' on its own device: those
    computed here (vLLM's CPU kernels) hold only for a CPU engine."""
    device = _get(config, "device_config", "device")
    if device not in (None, "cpu") and "cpu" not in str(device):
        raise _refuse(
            url, "device_config.device", device, "a quantized engine's post-load processing is its device's "
            "kernels' (computed here on the CPU: docs/quantized.md)"
        )  # fmt: skip


def _refuse(url: str, name: str, value: Any, why: str) -> ExpectedDigestsError:
    return ExpectedDigestsError(
        f"{url} runs with {name} = {value!r}: {why}; expected digests cannot be computed for it"
    )


def _model_arguments(url: str, model: dict[str, Any], args: dict[str, Any]) -> None:
    quant = model.get("quantization")
    if quant:
        from weight_checker.expected.vllm.quantized import ONLINE, check_known

        check_known(quant, f"{url} runs with quantization = {quant!r}")
        config = model.get("quantization_config")
        if quant in ONLINE and isinstance(config, dict) and config.get("ignore"):
            # Layers the engine left unquantized by a config of its own: not
            # the shorthand's, and not read back from vLLM's dump (yet).
            raise _refuse(url, "quantization_config.ignore", config["ignore"], "an online quantization of its own")
        # A checkpoint format is read from the checkpoint's own config again; an
        # online shorthand is the engine argument, its quantization_config the
        # one vLLM derives from it.
        args["quantization"] = quant if quant in ONLINE else None
    elif model.get("quantization_config"):
        raise _refuse(url, "quantization_config", model["quantization_config"], "an online quantization of its own")
    if model.get("model_class_overrides"):
        raise _refuse(
            url,
            "model_class_overrides",
            model["model_class_overrides"],
            "model classes registered in the server's process, not in this one",
        )
    overrides = model.get("hf_overrides")
    if overrides is not None and not isinstance(overrides, dict):
        raise _refuse(
            url, "hf_overrides", overrides, "a function changed the model's config (only a mapping is stated)"
        )
    dtype = model.get("dtype")
    if isinstance(dtype, str) and dtype:
        args["dtype"] = dtype.removeprefix("torch.")
    for name in MODEL_FIELDS:
        if name in model:
            args[name] = model[name]
    multimodal = model.get("multimodal_config")
    if isinstance(multimodal, dict):
        for name in MULTIMODAL_FIELDS:
            if name in multimodal:
                args[name] = bool(multimodal[name])
        # A modality limited to 0 a prompt: vLLM builds no tower for it
        # (SupportsMultiModal._mark_tower_model), so the engine holds none.
        limits = multimodal.get("limit_per_prompt")
        zero = sorted(m for m, v in (limits or {}).items() if isinstance(limits, dict) and _limit_count(v) == 0)
        if zero:
            raise _refuse(
                url, "multimodal_config.limit_per_prompt", {m: 0 for m in zero},
                "a modality limited to 0 a prompt leaves its tower unbuilt; expected digests are built with every "
                "tower",
            )  # fmt: skip


def _limit_count(value: Any) -> Any:
    """The count of a ``limit_per_prompt`` entry: a number, or vLLM's dump of
    its options (``{"count": 0}``)."""
    return value.get("count") if isinstance(value, dict) else value


def _parallel_arguments(url: str, parallel: dict[str, Any], args: dict[str, Any]) -> None:
    pcp = parallel.get("prefill_context_parallel_size")
    if isinstance(pcp, int) and pcp > 1:
        raise _refuse(
            url, "prefill_context_parallel_size", pcp, "expected digests are computed for context-parallel rank 0 only"
        )
    if parallel.get("enable_eplb"):
        raise _refuse(url, "enable_eplb", True, "expert load balancing moves experts between ranks as it runs")
    if "enable_expert_parallel" in parallel:
        args["enable_expert_parallel"] = bool(parallel["enable_expert_parallel"])
    strategy = parallel.get("expert_placement_strategy")
    if isinstance(strategy, str) and strategy != "linear":
        args["expert_placement_strategy"] = strategy


def _lora_arguments(url: str, lora: dict[str, Any], args: dict[str, Any]) -> None:
    extra_vocab = lora.get("lora_extra_vocab_size")
    if extra_vocab:  # earlier vLLMs: extra embedding rows per slot
        from importlib.util import find_spec

        if find_spec("vllm") is None or not hasattr(_engine_args_class(), "lora_extra_vocab_size"):
            raise _refuse(url, "lora_extra_vocab_size", extra_vocab, "this vLLM has no extra LoRA vocabulary")
        args["lora_extra_vocab_size"] = extra_vocab
    for name, argument in LORA_FIELDS.items():
        if name not in lora:
            continue
        value = lora[name]
        if isinstance(value, bool) or name.startswith(("enable_", "fully_")):
            value = bool(value)
        elif name == "lora_dtype" and isinstance(value, str):
            value = value.removeprefix("torch.")
        args[argument] = value


def _engine_args_class() -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


def _draft_arguments(url: str, spec: dict[str, Any], tp: int, args: dict[str, Any]) -> None:
    method = spec.get("method")
    if method in (None, "ngram", "suffix"):  # n-gram and suffix methods hold no weights
        return
    if method != "draft_model":
        raise ExpectedDigestsError(
            f"{url} decodes speculatively with {method!r}: its heads are hashed, but expected digests are "
            "computed for draft models only"
        )
    if spec.get("quantization"):
        raise _refuse(url, "speculative_config.quantization", spec["quantization"], "a quantized draft")
    draft_tp = spec.get("draft_tensor_parallel_size")
    if draft_tp is not None and draft_tp != tp:
        raise _refuse(
            url,
            "speculative_config.draft_tensor_parallel_size",
            draft_tp,
            f"a draft sharded otherwise than the target (TP {tp})",
        )
    args["draft"] = spec.get("model")
    if spec.get("num_speculative_tokens") is not None:
        args["num_speculative_tokens"] = spec["num_speculative_tokens"]


#: expected_digests' arguments a server states, and what the CLI calls them.
FLAGS = {
    "tp": "--tp",
    "pp": "--pp",
    "dp": "--dp",
    "dtype": "--dtype",
    "engine": "--engine",
    "max_lora_rank": "--max-lora-rank",
    "max_loras": "--max-loras",
    "lora_dtype": "--lora-dtype",
    "lora_target_modules": "--lora-target-modules",
    "fully_sharded_loras": "--fully-sharded-loras",
    "hf_overrides": "--hf-overrides",
    "draft": "--draft",
    "num_speculative_tokens": "--num-speculative-tokens",
    "enable_expert_parallel": "--enable-expert-parallel",
}

#: The LoRA arguments: given to an engine without LoRA, an error.
LORA_ARGUMENTS = frozenset(LORA_FIELDS.values()) | {"lora_extra_vocab_size"}


def _dtype_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _same_modules(given: Any, stated: Any) -> bool:
    if stated is None or given is None:
        return given is stated
    given = [given] if isinstance(given, str) else given
    return sorted(set(given)) == sorted(set(stated))


def _same_path(given: Any, stated: Any) -> bool:
    return Path(str(given)).resolve() == Path(str(stated)).resolve()


_SAME: dict[str, Callable[[Any, Any], bool]] = {
    # "auto" asks for what the server chose, whatever it is.
    "dtype": lambda given, stated: _dtype_name(given) in ("auto", _dtype_name(stated)),
    "draft": _same_path,
    "lora_target_modules": _same_modules,
}


def _shown(name: str, value: Any) -> str:
    """How the CLI would have been given ``value``: ``--flag value``."""
    flag = FLAGS.get(name, name)
    if value is True:
        return flag
    if isinstance(value, (list, tuple)):
        return " ".join([flag, *map(str, value)])
    if isinstance(value, dict):
        import json

        return f"{flag} {json.dumps(value)}"
    return f"{flag} {value}"


def reconcile(server: ServerEngine, given: dict[str, Any]) -> dict[str, Any]:
    """``expected_digests``' arguments: the server's, with what the caller
    gave (``None``: not given) where it agrees; a given value the server
    contradicts is an error naming both."""
    stated: dict[str, Any] = {"tp": server.tp, "pp": server.pp, "dp": server.dp, **server.arguments}
    for name, value in given.items():
        if value is None or name not in stated:
            continue
        want = stated[name]
        if name == "lora_dtype" and _dtype_name(value) == "auto":
            # vLLM's "auto": the model's dtype.
            same = _dtype_name(want) in ("auto", _dtype_name(stated.get("dtype")))
        elif name == "lora_dtype":
            same = _dtype_name(value) == _dtype_name(want)
        else:
            same = _SAME.get(name, lambda a, b: bool(a == b))(value, want)
        if not same:
            raise ExpectedDigestsError(
                f"{_shown(name, value)} contradicts {server.url}, which runs with {name} = {want!r}"
            )
    if not stated.get("enable_lora"):
        asked = [n for n in ("enable_lora", *sorted(LORA_ARGUMENTS)) if given.get(n) not in (None, False)]
        if asked:
            what = "LoRA" if asked[0] == "enable_lora" else _shown(asked[0], given[asked[0]])
            raise ExpectedDigestsError(f"{what} was asked for, but {server.url} runs without --enable-lora")
    return {**{k: v for k, v in given.items() if v is not None}, **stated}
