"""The engine an SGLang server runs, read from its ``GET /server_info``.

SGLang states its resolved server arguments there, in every mode (no dev
switch). :func:`sglang_engine` turns them into ``expected_digests``'
arguments for :mod:`.digests`, and refuses by name what the expected
digests cannot reproduce: quantization, LoRA, speculative decoding (a draft
model), pipeline parallelism, data-parallel attention, model overrides,
load formats other than safetensors, an SGLang version this package does
not know, and a CPU engine whose kernel repacks its weights (Intel AMX).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from weight_checker.errors import ExpectedDigestsError
from weight_checker.integrations.sglang.plugin import KNOWN_VERSIONS

#: The engine family name the expected digests of an SGLang server carry.
SGLANG = "sglang"

#: ``/server_info`` fields that must be unset (``None``, false or empty), and why.
#: Why an SGLang quantized engine is refused (docs/quantized.md): its CPU
#: paths switch on only with AMX (``cpu_has_amx_support``) and a real
#: ``sgl_kernel``, whose ops repack every layer (VNNI-packed weights for
#: ``fp8_scaled_mm_cpu``, ``int8_scaled_mm_with_quant``, ``int4_scaled_mm_cpu``);
#: its GPU paths are its CUDA kernels' post-load transforms. Neither runs here.
SGLANG_QUANTIZED = (
    "quantization on SGLang: its CPU kernels need AMX and repack every layer through sgl_kernel ops, its GPU "
    "kernels transform the weights after loading; neither is reproduced (docs/quantized.md)"
)
REFUSED: dict[str, str] = {
    "quantization": SGLANG_QUANTIZED,
    "modelopt_quant": SGLANG_QUANTIZED,
    "quantize_and_serve": SGLANG_QUANTIZED,
    "rl_quant_profile": SGLANG_QUANTIZED,
    "enable_lora": "LoRA on SGLang is not covered yet",
    "speculative_algorithm": "speculative decoding (a draft model) on SGLang is not covered yet",
    "enable_dp_attention": "data-parallel attention shards differently; not covered",
    "enable_dp_lm_head": "a data-parallel lm_head shards differently; not covered",
    "moe_dense_tp_size": "a dense TP size of its own shards differently; not covered",
    "custom_weight_loader": "a custom weight loader: not covered",
    "is_embedding": "an embedding model: not covered",
}
#: ``/server_info`` fields that must hold one of these values (SGLang's defaults), and why.
DEFAULTS: dict[str, tuple[tuple[Any, ...], str]] = {
    "ep_size": ((1, None), "expert parallelism: not covered"),
    "attn_cp_size": ((1, None), "context parallelism shards differently; not covered"),
    "dcp_size": ((1, None), "decode context parallelism shards differently; not covered"),
    "model_impl": (("auto", None), "another model implementation than SGLang's own: not covered"),
    "model_loader_extra_config": (("{}", "", None, {}), "a loader's extra config: not covered"),
}


def is_sglang_info(body: Any) -> bool:
    """Whether a ``/server_info`` answer is SGLang's (its server arguments,
    flat) rather than vLLM's (``vllm_config``)."""
    return isinstance(body, dict) and "vllm_config" not in body and "tp_size" in body and "model_path" in body


#: How a config may name a dtype, in SGLang's words (``_STR_DTYPE_TO_TORCH_DTYPE``).
DTYPE_NAMES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def config_dtype(model_path: str) -> str:
    """SGLang's ``--dtype auto`` for the checkpoint at ``model_path``
    (``_get_and_verify_dtype`` over the text config: its dtype; float32
    becomes float16, bfloat16 for Gemma), or ``"auto"`` where the config is
    not on this host. The expected digests are built with this dtype; where
    it were not the server's, every key would differ (a false alarm, never a
    false match)."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return "auto"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    stated = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    name = str(stated or "float32").removeprefix("torch.")
    name = DTYPE_NAMES.get(name, name)
    if name == "float32":
        model_type = str(text.get("model_type") or config.get("model_type") or "")
        return "bfloat16" if model_type.startswith("gemma") else "float16"
    return name


def sglang_engine(url: str, info: dict[str, Any]) -> tuple[str, int, int, int, dict[str, Any]]:
    """``(model, tp, pp, dp, arguments)`` of the SGLang server at ``url`` from
    its ``/server_info`` answer ``info``; raises :class:`ExpectedDigestsError`
    for what expected digests cannot reproduce, naming the field."""
    version = info.get("version")
    if version not in KNOWN_VERSIONS:
        raise ExpectedDigestsError(
            f"{url} runs SGLang {version}: expected digests are computed through SGLang {', '.join(KNOWN_VERSIONS)}'s "
            "own model classes only"
        )
    for name, why in REFUSED.items():
        value = info.get(name)
        if value not in (None, False, "", [], {}):
            raise ExpectedDigestsError(f"{url} runs with {name} = {value!r}: {why}")
    for name, (allowed, why) in DEFAULTS.items():
        value = info.get(name)
        if value not in allowed:
            raise ExpectedDigestsError(f"{url} runs with {name} = {value!r}: {why}")
    pp = int(info.get("pp_size") or 1)
    if pp != 1:
        raise ExpectedDigestsError(f"{url} runs with pp_size = {pp}: SGLang pipeline parallelism is not covered yet")
    overrides = info.get("json_model_override_args")
    if overrides not in (None, "", "{}"):
        raise ExpectedDigestsError(f"{url} runs with json_model_override_args = {overrides!r}: not covered")
    load_format = info.get("load_format") or "auto"
    if load_format not in ("auto", "safetensors"):
        raise ExpectedDigestsError(f"{url} runs with load_format = {load_format!r}: only safetensors is covered")
    model = info.get("model_path")
    if not isinstance(model, str) or not model:
        raise ExpectedDigestsError(f"{url}: /server_info names no model_path")
    dtype = str(info.get("dtype") or "auto")
    arguments: dict[str, Any] = {
        "engine": SGLANG,
        "dtype": config_dtype(model) if dtype == "auto" else dtype,
        "device": info.get("device"),
    }
    if info.get("revision"):
        arguments["revision"] = info["revision"]
    return model, int(info.get("tp_size") or 1), pp, int(info.get("dp_size") or 1), arguments
