"""The engine an SGLang server runs, read from its ``GET /server_info``.

SGLang states its resolved server arguments there, in every mode (no dev
switch). :func:`sglang_engine` turns them into ``expected_digests``'
arguments for :mod:`.sglang_digests`, and refuses by name what the expected
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
REFUSED: dict[str, str] = {
    "quantization": "quantization: its post-load processing changes the bytes",
    "enable_lora": "LoRA on SGLang is not covered yet",
    "speculative_algorithm": "speculative decoding (a draft model) on SGLang is not covered yet",
    "enable_dp_attention": "data-parallel attention shards differently; not covered",
}


def is_sglang_info(body: Any) -> bool:
    """Whether a ``/server_info`` answer is SGLang's (its server arguments,
    flat) rather than vLLM's (``vllm_config``)."""
    return isinstance(body, dict) and "vllm_config" not in body and "tp_size" in body and "model_path" in body


def config_dtype(model_path: str) -> str:
    """SGLang's ``--dtype auto`` for the checkpoint at ``model_path``
    (``ModelConfig``'s rule: the config's dtype; float32 becomes float16,
    bfloat16 for Gemma), or ``"auto"`` where the config is not on this host."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return "auto"
    stated = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    if stated in ("float32", "float"):
        return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"
    return stated


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
        if value not in (None, False, ""):
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
