"""API servers as a target: one, several behind an external load balancer,
or a fleet of replicas; every step on all of them at once."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from weight_checker.engines import DEFAULT_PAUSE, FAMILIES, EngineFamily, check_pause_mode, detect, family_named
from weight_checker.errors import HttpError, InputError, VerifyError
from weight_checker.httpclient import api_key_from_env, clip, post_json, request, validate_url
from weight_checker.scope import DEFAULT
from weight_checker.verify.engine_digests import Layout
from weight_checker.verify.fanout import DEFAULT_CONCURRENCY, EngineSet, Progress

#: Why a scoped checksum came back without its scope.
IGNORED_SCOPE = (
    "the server answered without the scope asked for ('include'): its /weight_checker is vLLM's built-in "
    "route, which covers the target model only; start the server with "
    "VLLM_PLUGINS=weight_checker,weight_checker_route (this package's route) to check drafts and LoRA adapters"
)


class HttpTarget(EngineSet):
    """API servers, each by its URL. ``engine``: their family (``vllm``,
    ``sglang``; default: read from each server, :func:`weight_checker.engines.detect`);
    ``pause``: how generation is paused (:data:`weight_checker.engines.PAUSE_MODES`)."""

    def __init__(
        self,
        urls: str | Iterable[str],
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        progress: Progress | None = None,
        layout: Layout | None = None,
        include: tuple[str, ...] = DEFAULT,
        engine: str | None = None,
        pause: str = DEFAULT_PAUSE,
    ):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise InputError("no server URL given")
        valid = [validate_url(u) for u in urls]
        twice = sorted({u for u in valid if valid.count(u) > 1})
        if twice:
            raise InputError(f"server given twice: {', '.join(twice)}")
        super().__init__(valid, concurrency, progress, layout, include)
        self.urls = valid
        self.api_key = api_key_from_env(api_key)
        self.timeout = 600.0 if timeout is None else timeout
        self.pause_mode = check_pause_mode(pause)
        if engine is not None and engine not in FAMILIES:
            raise InputError(f"unknown engine {engine!r}: expected {', '.join(FAMILIES)}")
        self._families: dict[str, EngineFamily] = {u: family_named(engine) for u in valid} if engine else {}
        self._families_lock = threading.Lock()  # the fan-out's threads detect at once
        if engine is not None and self.pause_mode not in self._families[valid[0]].pause_modes:
            family = self._families[valid[0]]
            raise InputError(
                f"{family.display} has no {self.pause_mode!r} pause: use {' or '.join(family.pause_modes)}"
            )

    def family(self, url: str) -> EngineFamily:
        """The server's engine family: as given, else read from the server
        (kept once it answered; a server that did not answer is asked again
        next time, and meanwhile taken for vLLM, as before there were families)."""
        with self._families_lock:
            known = self._families.get(url)
        if known is not None:
            return known
        found = detect(self._get, url)
        if found is None:
            return family_named("vllm")
        with self._families_lock:
            return self._families.setdefault(url, found)

    def pause(self) -> None:
        """Refuses, before any server is paused, a pause mode one of them lacks."""
        for url in self.names:
            family = self.family(url)
            if self.pause_mode not in family.pause_modes:
                modes = " or ".join(family.pause_modes)
                raise VerifyError("pause", url, f"{family.display} has no {self.pause_mode!r} pause: use {modes}")
        super().pause()

    def _get(self, url: str, path: str) -> tuple[int, Any]:
        return request("GET", url, path, timeout=min(self.timeout, 30), api_key=self.api_key)

    def _post(self, url: str, path: str, body: Any, step: str) -> Any:
        try:
            return post_json(url, path, body, timeout=self.timeout, api_key=self.api_key)
        except HttpError as e:
            raise VerifyError(step, url, e.message) from e

    def _call(self, url: str, op: str, step: str) -> Any:
        scope = {"include": list(self.include)} if self.include != DEFAULT else {}
        if op == "reset":  # checksum and reset: one contract on every engine, asked of no family
            return self._post(url, "/weight_checker", {"action": "reset", **scope}, step)
        if op == "checksum":
            return self._checksum(url, scope, step)
        family = self.family(url)
        if op == "pause":
            try:
                return family.pause(self._post, url, self.pause_mode, step)
            except InputError as e:
                raise VerifyError(step, url, str(e)) from e
        if op == "resume":
            return family.resume(self._post, url, step)
        if op == "reload":  # the CLI's --transfer reload
            try:
                return family.reload(self._post, self._get, url, step, self.pause_mode)
            except InputError as e:
                raise VerifyError(step, url, str(e)) from e
        if op == "version":
            return family.version(self._get, url)
        if op == "weight_version":
            return family.weight_version(self._get, url)
        if op == "dp_sharded":
            return family.dp_sharded(self._post, url, step)
        raise ValueError(f"unknown step operation {op!r}")

    def _checksum(self, url: str, scope: dict[str, Any], step: str) -> dict[str, str]:
        answer = self._post(url, "/weight_checker", {"action": "checksum", **scope}, step)
        sums = answer.get("checksums") if isinstance(answer, dict) else None
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise VerifyError(step, url, f"unexpected answer {clip(str(answer))}")
        if scope:
            if answer.get("include") != scope["include"]:
                raise VerifyError(step, url, IGNORED_SCOPE)
            self.lora_slots[url] = answer.get("lora_slots")
        return sums
