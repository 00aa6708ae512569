"""The engines a verified client reaches, one adaptor per kind of client: vLLM's HTTP client, an in-process
``vllm.LLM``, any other client (digests from ``checksum_from``); :func:`engine_for` picks one."""

from __future__ import annotations

import logging
from typing import Any

from weight_checker.errors import InputError, InputTypeError, VerifyError, WeightCheckerError
from weight_checker.httpclient import api_key_from_env, post_json, request
from weight_checker.integrations.weight_transfer_finish import finish_weight_update
from weight_checker.keys import merge_digests
from weight_checker.scope import DEFAULT
from weight_checker.verify.explain import http_fetcher, llm_fetcher
from weight_checker.verify.fanout import no_digests
from weight_checker.verify.targets import target_for

logger = logging.getLogger("weight_checker.weight_transfer")


class Engine:
    """One inference server or engine behind a client: how to reach it for
    what the wrapper adds (the update with the checksum flag, the finish
    with digests, a checksum, the weight version)."""

    name: str
    #: Whether the finish answers with the digests of what it committed.
    digests_at_finish = False
    #: Why the last finish gave no digests where it was asked for them.
    finish_note: str | None = None

    def __init__(self, client: Any, include: tuple[str, ...] | None):
        self.client = client
        self.include = include

    def init(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start(self) -> None:
        self.client.start_weight_update()

    def update(self, update_info: Any) -> None:
        self.client.update_weights(update_info)

    def finish(self, weight_version: str | None) -> dict[str, str] | None:
        """Finishes; the digests of what it committed, or ``None`` where
        this engine's finish does not give them."""
        self.client.finish_weight_update(weight_version)
        return None

    def checksum(self, include: tuple[str, ...] | None = None) -> dict[str, str]:
        """One checksum of ``include`` (default: the wrapper's scope)."""
        raise NotImplementedError

    def weight_version(self) -> str | None:
        return None

    def block_fetcher(self) -> Any:
        """How to ask this engine for block digests (``None``: it cannot be)."""
        return None


class _HttpEngine(Engine):
    """A server, through vLLM's HTTP client: the update and the finish are
    posted here (with ``"checksum": true``), the rest is the client's."""

    def __init__(self, client: Any, include: tuple[str, ...] | None, api_key: str | None, timeout: float):
        super().__init__(client, include)
        self.url = str(client.base_url).rstrip("/")
        self.name = self.url
        self.api_key = api_key_from_env(api_key)
        self.timeout = float(getattr(client, "timeout", None) or timeout)
        self.digests_at_finish = True

    def block_fetcher(self) -> Any:
        return http_fetcher(self.url, api_key=self.api_key, timeout=self.timeout)

    def update(self, update_info: Any) -> None:
        payload = _json_safe(update_info)
        body: dict[str, Any] = {"update_info": payload, "checksum": True}
        if self.include is not None:
            body["include"] = list(self.include)
        post_json(self.url, "/update_weights", body, timeout=self.timeout, api_key=self.api_key)

    def finish(self, weight_version: str | None) -> dict[str, str] | None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        answer = post_json(self.url, "/finish_weight_update", body, timeout=self.timeout, api_key=self.api_key)
        sums = answer.get("checksums") if isinstance(answer, dict) else None
        if isinstance(sums, dict) and all(isinstance(v, str) for v in sums.values()):
            self.finish_note = None
            return sums
        failed = answer.get("checksum_error") if isinstance(answer, dict) else None
        if failed:
            self.finish_note = f"the update committed but its digests at finish failed ({str(failed)[:300]})"
        else:  # vLLM's own route, or this package's without a session in this process
            self.finish_note = "the finish returned no digests (this package's endpoint plugin not loaded there?)"
        return None

    def checksum(self, include: tuple[str, ...] | None = None) -> dict[str, str]:
        include = include or self.include
        body: dict[str, Any] = {"action": "checksum"}
        if include is not None:
            body["include"] = list(include)
        answer = post_json(self.url, "/weight_checker", body, timeout=self.timeout, api_key=self.api_key)
        sums = dict(answer["checksums"])
        if not sums:  # an engine that proves nothing never passes, nor tells what is stale
            raise VerifyError("checksum", self.url, no_digests(include))
        return sums

    def weight_version(self) -> str | None:
        status, body = request("GET", self.url, "/weight_info", timeout=min(self.timeout, 30), api_key=self.api_key)
        version = body.get("weight_version") if status == 200 and isinstance(body, dict) else None
        return version if isinstance(version, str) else None


class _LLMEngine(Engine):
    """An in-process ``vllm.LLM``: vLLM's own methods, and the finish that
    hashes as it commits (:func:`finish_weight_update`)."""

    def __init__(self, llm: Any, include: tuple[str, ...] | None):
        super().__init__(llm, include)
        self.name = f"in-process {type(llm).__name__}"
        self.digests_at_finish = True

    def block_fetcher(self) -> Any:
        return llm_fetcher(self.client)

    def init(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine({"init_info": init_info})

    def update(self, update_info: Any) -> None:
        try:  # each worker hashes every layer as it commits (the finish takes those digests)
            self.client.collective_rpc("weight_checker_begin_update_digests")
        except Exception as e:  # only the overlap is lost: the finish hashes everything
            logger.debug("weight_checker: no early digests on %s (%s)", self.name, e)
        self.client.update_weights({"update_info": update_info})

    def finish(self, weight_version: str | None) -> dict[str, str] | None:
        try:
            digests = finish_weight_update(self.client, weight_version, self.include)
        except WeightCheckerError as e:  # committed (and versioned), its digests failed
            self.finish_note = f"the update committed but its digests at finish failed ({e})"
            return None
        self.finish_note = None
        return digests

    def checksum(self, include: tuple[str, ...] | None = None) -> dict[str, str]:
        # One engine: its digests, whatever name the wrapper gave it (a
        # fleet's engines are numbered).
        per_engine = target_for(self.client, include=include or self.include or DEFAULT).per_engine("checksum")
        return next(iter(per_engine.values()))

    def weight_version(self) -> str | None:
        version = self.client.get_weight_version()
        return version if isinstance(version, str) else None


class _OtherEngine(Engine):
    """Any other client: its own calls; digests from one checksum of
    ``checksum_from``."""

    def __init__(self, client: Any, include: tuple[str, ...] | None, checksum_from: Any, name: str):
        super().__init__(client, include)
        self.checksum_from = checksum_from
        self.name = name

    def checksum(self, include: tuple[str, ...] | None = None) -> dict[str, str]:
        scope = include or self.include or DEFAULT
        per_engine = target_for(self.checksum_from, include=scope).per_engine("checksum")
        return merge_digests(per_engine.values(), per_engine)

    def block_fetcher(self) -> Any:
        source = self.checksum_from
        if isinstance(source, str):
            return http_fetcher(source)
        if callable(getattr(source, "collective_rpc", None)):
            return llm_fetcher(source)
        return None  # several engines behind one client: which holds a key is not known here


def _json_safe(update_info: Any) -> Any:
    """The payload as vLLM's HTTP client sends it (IPC handles pickled)."""
    try:
        from vllm.distributed.weight_transfer.clients import _json_safe_update_payload
    except ImportError:
        return update_info
    return _json_safe_update_payload(update_info)


def engine_for(
    client: Any, include: tuple[str, ...] | None, checksum_from: Any, api_key: Any, timeout: float
) -> Engine:
    if hasattr(client, "base_url"):
        return _HttpEngine(client, include, api_key, timeout)
    if callable(getattr(client, "collective_rpc", None)) and hasattr(client, "llm_engine"):
        return _LLMEngine(client, include)
    missing = [m for m in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                           "finish_weight_update") if not callable(getattr(client, m, None))]  # fmt: skip
    if missing:
        raise InputTypeError(f"{type(client).__name__} is not a VLLMWeightSyncClient: it has no {', '.join(missing)}")
    if checksum_from is None:
        raise InputError(
            f"{type(client).__name__}: cannot tell where to take the engines' digests: pass checksum_from= "
            "(the servers' URLs, the engines, or their Ray actor handles)"
        )
    handles = getattr(client, "handles", None) or getattr(client, "_handles", None)
    return _OtherEngine(client, include, checksum_from, f"{type(client).__name__}" + (" (ray)" if handles else ""))
