"""API servers as one target: every step on all of them at once."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from weight_checker.errors import VerifyError
from weight_checker.fanout import DEFAULT_CONCURRENCY, FannedOut, Progress
from weight_checker.httpclient import HttpError, api_key_from_env, post_json, request, validate_url


class HttpTarget(FannedOut):
    """API servers: one, several behind an external load balancer, or a fleet."""

    def __init__(
        self,
        urls: str | Iterable[str],
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        progress: Progress | None = None,
    ):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("no server URL given")
        valid = [validate_url(u) for u in urls]
        twice = sorted({u for u in valid if valid.count(u) > 1})
        if twice:
            raise ValueError(f"server given twice: {', '.join(twice)}")
        super().__init__(valid, concurrency, progress)
        self.urls = valid
        self.api_key = api_key_from_env(api_key)
        self.timeout = 600.0 if timeout is None else timeout

    def _post(self, url: str, path: str, body: Any, step: str) -> Any:
        try:
            return post_json(url, path, body, timeout=self.timeout, api_key=self.api_key)
        except HttpError as e:
            raise VerifyError(step, url, e.message) from None

    def _call(self, url: str, op: str, step: str) -> Any:
        if op == "pause":
            return self._post(url, "/pause?mode=abort", None, step)
        if op == "resume":
            return self._post(url, "/resume", None, step)
        if op == "reset":
            return self._post(url, "/weight_checker", {"action": "reset"}, step)
        if op == "version":
            try:
                status, body = request("GET", url, "/version", timeout=min(self.timeout, 30), api_key=self.api_key)
            except HttpError:
                return None
            return body.get("version") if status == 200 and isinstance(body, dict) else None
        answer = self._post(url, "/weight_checker", {"action": "checksum"}, step)
        sums = answer.get("checksums") if isinstance(answer, dict) else None
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise VerifyError(step, url, f"unexpected answer {str(answer)[:200]}")
        return sums

    def checksums_by_server(self, step: str) -> list[dict[str, str]]:
        return [sums for _, sums in self.per_engine(step)]
