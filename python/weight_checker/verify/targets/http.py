"""API servers as a target: one, several behind an external load balancer,
or a fleet of replicas; every step on all of them at once."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from weight_checker.errors import HttpError, InputError, VerifyError
from weight_checker.httpclient import api_key_from_env, clip, post_json, request, validate_url
from weight_checker.scope import DEFAULT
from weight_checker.verify.engine_digests import Layout
from weight_checker.verify.fanout import DEFAULT_CONCURRENCY, EngineSet, Progress
from weight_checker.verify.targets.engines import sharded_names

#: Why a scoped checksum came back without its scope.
IGNORED_SCOPE = (
    "the server answered without the scope asked for ('include'): its /weight_checker is vLLM's built-in "
    "route, which covers the target model only; start the server with "
    "VLLM_PLUGINS=weight_checker,weight_checker_route (this package's route) to check drafts and LoRA adapters"
)


class HttpTarget(EngineSet):
    """API servers, each by its URL."""

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

    def _post(self, url: str, path: str, body: Any, step: str) -> Any:
        try:
            return post_json(url, path, body, timeout=self.timeout, api_key=self.api_key)
        except HttpError as e:
            raise VerifyError(step, url, e.message) from e

    def _call(self, url: str, op: str, step: str) -> Any:
        if op == "pause":
            return self._post(url, "/pause?mode=abort", None, step)
        if op == "resume":
            return self._post(url, "/resume", None, step)
        scope = {"include": list(self.include)} if self.include != DEFAULT else {}
        if op == "reset":
            return self._post(url, "/weight_checker", {"action": "reset", **scope}, step)
        if op == "reload":  # the CLI's --transfer reload
            return self._post(url, "/collective_rpc", {"method": "reload_weights"}, step)
        if op == "version":
            try:
                status, body = request("GET", url, "/version", timeout=min(self.timeout, 30), api_key=self.api_key)
            except HttpError:
                return None  # the version is reported where it is known, never fatal
            return body.get("version") if status == 200 and isinstance(body, dict) else None
        if op == "weight_version":
            return self._weight_version(url)
        if op == "dp_sharded":
            answer = self._post(url, "/collective_rpc", {"method": "weight_checker_dp_sharded"}, step)
            return sharded_names(answer.get("results") if isinstance(answer, dict) else None)
        answer = self._post(url, "/weight_checker", {"action": "checksum", **scope}, step)
        sums = answer.get("checksums") if isinstance(answer, dict) else None
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise VerifyError(step, url, f"unexpected answer {clip(str(answer))}")
        if scope:
            if answer.get("include") != scope["include"]:
                raise VerifyError(step, url, IGNORED_SCOPE)
            self.lora_slots[url] = answer.get("lora_slots")
        return sums

    def _weight_version(self, url: str) -> str | None:
        try:
            status, body = request("GET", url, "/weight_info", timeout=min(self.timeout, 30), api_key=self.api_key)
        except HttpError:
            return None
        version = body.get("weight_version") if status == 200 and isinstance(body, dict) else None
        return version if isinstance(version, str) else None
