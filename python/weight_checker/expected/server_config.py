"""The engine a running server is, read from the server itself.

``expected_digests(..., like=URL)`` and ``weight-checker expect --server URL``
build the expected digests of the engine behind a vLLM server without
repeating its flags by hand (a server with ``--max-lora-rank 8 --max-loras 2``
checked with vLLM's defaults showed 15 of 47 keys equal: every adapter key
"differed", a false alarm that looks like a sync bug). A dev-mode server
(``VLLM_SERVER_DEV_MODE=1``) states its resolved configuration at
``GET /server_info?config_format=json`` (TRL reads it too); this takes from it
the model, the dtype, TP / PP / DP, expert parallelism, the LoRA limits and
a draft model's speculative config, and refuses what expected digests
cannot be computed for (quantization, speculative methods other than a
draft model). A value the caller passed that contradicts the server is an
error naming both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weight_checker.errors import ExpectedDigestsError, HttpError
from weight_checker.verify.httpclient import api_key_from_env, request, validate_url


@dataclass
class ServerEngine:
    """What :func:`server_engine` read: ``expected_digests``' arguments."""

    url: str
    #: The model directory (or hub id) the server loaded.
    model: str
    tp: int
    pp: int
    dp: int
    #: ``expected_digests``' other arguments: dtype, LoRA, draft, EP...
    arguments: dict[str, Any] = field(default_factory=dict)


def _get(mapping: Any, *path: str) -> Any:
    for part in path:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(part)
    return mapping


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
    config = _get(body, "vllm_config")
    if status != 200 or not isinstance(config, dict):
        raise ExpectedDigestsError(f"{url}: /server_info did not give a configuration (HTTP {status})")
    model = _get(config, "model_config", "model")
    if not isinstance(model, str) or not model:
        raise ExpectedDigestsError(f"{url}: /server_info names no model")
    quantization = _get(config, "model_config", "quantization")
    if quantization:
        raise ExpectedDigestsError(
            f"{url} runs a quantized model ({quantization}): its post-load processing changes bytes; not supported"
        )
    parallel = _get(config, "parallel_config") or {}
    args: dict[str, Any] = {}
    dtype = _get(config, "model_config", "dtype")
    if isinstance(dtype, str) and dtype:
        args["dtype"] = dtype.removeprefix("torch.")
    for name in ("max_model_len", "revision", "trust_remote_code"):
        value = _get(config, "model_config", name)
        if value is not None:
            args[name] = value
    if parallel.get("enable_expert_parallel"):
        args["enable_expert_parallel"] = True
    lora = config.get("lora_config")
    if isinstance(lora, dict):
        args["enable_lora"] = True
        for name in ("max_lora_rank", "max_loras"):
            if lora.get(name) is not None:
                args[name] = lora[name]
        if lora.get("fully_sharded_loras"):
            args["fully_sharded_loras"] = True
    spec = config.get("speculative_config")
    if isinstance(spec, dict):
        method = spec.get("method")
        if method == "draft_model":
            args["draft"] = spec.get("model")
            if spec.get("num_speculative_tokens") is not None:
                args["num_speculative_tokens"] = spec["num_speculative_tokens"]
        elif method not in (None, "ngram", "suffix"):  # n-gram and suffix methods hold no weights
            raise ExpectedDigestsError(
                f"{url} decodes speculatively with {method!r}: its heads are hashed, but expected digests are "
                "computed for draft models only"
            )
    return ServerEngine(
        url,
        model,
        int(parallel.get("tensor_parallel_size") or 1),
        int(parallel.get("pipeline_parallel_size") or 1),
        int(parallel.get("data_parallel_size") or 1),
        args,
    )


#: expected_digests' arguments a server states, and what the CLI calls them.
FLAGS = {
    "tp": "--tp",
    "pp": "--pp",
    "dp": "--dp",
    "dtype": "--dtype",
    "max_lora_rank": "--max-lora-rank",
    "max_loras": "--max-loras",
    "draft": "--draft",
    "num_speculative_tokens": "--num-speculative-tokens",
    "enable_expert_parallel": "--enable-expert-parallel",
}


def reconcile(server: ServerEngine, given: dict[str, Any]) -> dict[str, Any]:
    """``expected_digests``' arguments: the server's, with what the caller
    gave (``None``: not given) where it agrees; a given value the server
    contradicts is an error naming both."""
    stated: dict[str, Any] = {"tp": server.tp, "pp": server.pp, "dp": server.dp, **server.arguments}
    for name, value in given.items():
        if value is None or name not in stated:
            continue
        want = stated[name]
        same = str(value).removeprefix("torch.") == str(want) if name in ("dtype", "draft") else value == want
        if name == "draft":
            from pathlib import Path

            same = Path(str(value)).resolve() == Path(str(want)).resolve()
        if not same:
            raise ExpectedDigestsError(
                f"{FLAGS.get(name, name)} {value} contradicts {server.url}, which runs with {name} = {want!r}"
            )
    if given.get("enable_lora") and not stated.get("enable_lora"):
        raise ExpectedDigestsError(f"LoRA was asked for, but {server.url} runs without --enable-lora")
    return {**{k: v for k, v in given.items() if v is not None}, **stated}
