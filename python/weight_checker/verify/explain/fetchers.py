"""The engine's block digests: how each kind of engine is asked (HTTP route, ``LLM``, ``AsyncLLM``, Ray actor)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from weight_checker.engines.sglang import BLOCKS, block_request, rank_blocks
from weight_checker.errors import HttpError, VerifyError, WeightCheckerError
from weight_checker.hashing.blocks import MAX_KEYS
from weight_checker.httpclient import api_key_from_env, post_json
from weight_checker.verify.targets.async_engines import AsyncLLMTarget
from weight_checker.verify.targets.engines import RpcTarget
from weight_checker.verify.targets.http import HttpTarget
from weight_checker.verify.targets.sglang_engines import SGLangEngineTarget

#: ``fetch(keys, block_bytes)`` -> ``{key: {"digests", "nbytes", "shape",
#: "dtype", "block_bytes"}}``: the engine's block digests of those keys.
#: The fetchers made here also take ``chain`` (``{key: [[block, state_hex],
#: ...]}``: those keys' answers are ``{"blocks", "states", "zeros", ...}``,
#: :mod:`weight_checker.hashing.block_states`) and say so (:func:`chains`).
BlockFetcher = Callable[..., Mapping[str, Mapping[str, Any]]]


def chains(fetch: BlockFetcher | None) -> bool:
    """Whether ``fetch`` continues chain states (one of this module's fetchers)."""
    return bool(getattr(fetch, "chains", False))


def _chaining(fetch: Any) -> BlockFetcher:
    fetch.chains = True
    return fetch  # type: ignore[no-any-return]


def fetch_all(
    fetch: BlockFetcher,
    keys: list[str],
    block_bytes: int,
    chain: Mapping[str, Any] | None = None,
    each: bool = True,
) -> tuple[dict[str, Mapping[str, Any]], dict[str, str]]:
    """The engine's block digests of ``keys`` (with ``chain``: the states it
    names continued, see :data:`BlockFetcher`), asked :data:`MAX_KEYS` at a
    time (what the route takes); a request refused is asked again key by
    key (``each``), so that one key (a tensor smaller than expected) hides
    no other. ``(answers, key -> why refused)``."""
    answers: dict[str, Mapping[str, Any]] = {}
    refused: dict[str, str] = {}

    def ask(chunk: list[str]) -> Mapping[str, Mapping[str, Any]]:
        if chain is None:
            return fetch(chunk, block_bytes)
        return fetch(chunk, block_bytes, {k: chain[k] for k in chunk if k in chain})

    for at in range(0, len(keys), MAX_KEYS):
        chunk = keys[at : at + MAX_KEYS]
        try:
            answers.update(ask(chunk))
            continue
        except WeightCheckerError as err:
            if len(chunk) == 1 or not each:
                refused.update(dict.fromkeys(chunk, str(err)))
                continue
        for key in chunk:
            try:
                answers.update(ask([key]))
            except WeightCheckerError as err:
                refused[key] = str(err)
    return answers, refused


def _merge_answers(answers: Any, source: str) -> dict[str, Mapping[str, Any]]:
    """One map of every worker's ``weight_checker_block_digests`` answer; an
    error a worker reports is raised, naming the key."""
    if not isinstance(answers, list) or not all(isinstance(a, dict) for a in answers):
        raise VerifyError("block digests", source, f"unexpected answer {str(answers)[:200]}")
    out: dict[str, Mapping[str, Any]] = {}
    for answer in answers:
        errors = answer.get("errors") or {}
        if errors:
            key = min(errors)
            raise VerifyError("block digests", source, f"{key}: {errors[key]}")
        out.update(answer.get("blocks") or {})
    return out


def llm_fetcher(engine: Any) -> BlockFetcher:
    """Block digests from an in-process ``vllm.LLM`` (every worker, through
    ``collective_rpc``; this package's plugin gives the worker method)."""

    def fetch(keys: list[str], block_bytes: int, chain: Any = None) -> dict[str, Mapping[str, Any]]:
        try:
            answers = engine.collective_rpc("weight_checker_block_digests", args=_args(keys, block_bytes, chain))
        except Exception as e:  # an engine without the plugin's method, or a worker that failed
            raise VerifyError("block digests", "in-process engine", f"collective_rpc failed: {e}") from e
        return _merge_answers(answers, "in-process engine")

    return _chaining(fetch)


def _args(keys: list[str], block_bytes: int, chain: Any) -> tuple[Any, ...]:
    """The worker method's arguments (``chain`` only where given: a plugin that predates it takes two)."""
    return (keys, block_bytes) if chain is None else (keys, block_bytes, chain)


#: Why a server gives no block digests (vLLM's own route knows only its three actions).
NO_BLOCK_ROUTE = (
    "the server's /weight_checker gives no block digests (vLLM's built-in route): start it with "
    "VLLM_PLUGINS=weight_checker,weight_checker_route to see where in each tensor"
)


def http_fetcher(url: str, *, api_key: str | None = None, timeout: float = 600.0) -> BlockFetcher:
    """Block digests from a server through this package's route
    (``{"action": "block_digests", "keys": [...], "block_bytes": B}``)."""

    def fetch(keys: list[str], block_bytes: int, chain: Any = None) -> dict[str, Mapping[str, Any]]:
        body: dict[str, Any] = {"action": "block_digests", "keys": keys, "block_bytes": block_bytes}
        if chain is not None:
            body["chain"] = chain
        try:
            answer = post_json(url, "/weight_checker", body, timeout=timeout, api_key=api_key_from_env(api_key))
        except HttpError as e:
            own_route = "'action' must be one of" in e.message  # this package's route, too old for it
            vllms_route = "literal_error" in e.message or "Input should be 'checksum'" in e.message
            message = NO_BLOCK_ROUTE if (own_route or vllms_route) and e.status == 400 else e.message
            raise VerifyError("block digests", url, message) from e
        blocks = answer.get("block_digests") if isinstance(answer, dict) else None
        if not isinstance(blocks, dict):
            raise VerifyError("block digests", url, f"unexpected answer {str(answer)[:200]}")
        return blocks

    return _chaining(fetch)


def fetcher_for(target: Any, engine: str) -> BlockFetcher | None:
    """How to ask ``engine`` of a verify target for block digests: this
    package's route over HTTP, the worker method over ``collective_rpc`` in
    process (an ``LLM``, or an ``AsyncLLM`` on its event loop) or on a Ray
    actor, the plugin's action through an ``sglang.Engine``'s fan-out;
    ``None`` where none can be reached."""
    if isinstance(target, HttpTarget):
        return http_fetcher(engine, api_key=target.api_key, timeout=target.timeout)
    if isinstance(target, RpcTarget):
        handle = target.engines[engine]

        def fetch(keys: list[str], block_bytes: int, chain: Any = None) -> dict[str, Mapping[str, Any]]:
            answers = handle.rpc("weight_checker_block_digests", _args(keys, block_bytes, chain), "block digests")
            return _merge_answers(answers, engine)

        return _chaining(fetch)
    if isinstance(target, AsyncLLMTarget):

        def fetch_async(keys: list[str], block_bytes: int, chain: Any = None) -> dict[str, Mapping[str, Any]]:
            args = _args(keys, block_bytes, chain)
            answers = target.rpc(engine, "weight_checker_block_digests", args, "block digests")
            return _merge_answers(answers, engine)

        return _chaining(fetch_async)
    if isinstance(target, SGLangEngineTarget):

        def fetch_sglang(keys: list[str], block_bytes: int, chain: Any = None) -> dict[str, Mapping[str, Any]]:
            ranks = target.ask(engine, BLOCKS, block_request(keys, block_bytes, chain), "block digests")
            return _merge_answers(rank_blocks(ranks), engine)

        return _chaining(fetch_sglang)
    return None
