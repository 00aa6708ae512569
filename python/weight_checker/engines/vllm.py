"""vLLM's servers: paused and resumed by its dev-mode RL routes (``/pause``,
``/resume``), reloaded by ``/collective_rpc reload_weights``, its versions at
``/version`` and ``/weight_info``."""

from __future__ import annotations

from typing import Any

from weight_checker.engines.family import Get, Post
from weight_checker.errors import HttpError


class VLLMFamily:
    name = "vllm"
    display = "vLLM"
    #: vLLM's own ``pause_generation`` modes, the same three words.
    pause_modes: tuple[str, ...] = ("abort", "wait", "keep")

    def pause(self, post: Post, url: str, mode: str, step: str) -> Any:
        return post(url, f"/pause?mode={mode}", None, step)

    def resume(self, post: Post, url: str, step: str) -> Any:
        return post(url, "/resume", None, step)

    def reload(self, post: Post, get: Get, url: str, step: str, pause_mode: str = "abort") -> Any:
        return post(url, "/collective_rpc", {"method": "reload_weights"}, step)

    def version(self, get: Get, url: str) -> str | None:
        try:
            status, body = get(url, "/version")
        except HttpError:
            return None  # the version is reported where it is known, never fatal
        return body.get("version") if status == 200 and isinstance(body, dict) else None

    def weight_version(self, get: Get, url: str) -> str | None:
        try:
            status, body = get(url, "/weight_info")
        except HttpError:
            return None
        version = body.get("weight_version") if status == 200 and isinstance(body, dict) else None
        return version if isinstance(version, str) else None

    def dp_sharded(self, post: Post, url: str, step: str) -> list[str] | None:
        answer = post(url, "/collective_rpc", {"method": "weight_checker_dp_sharded"}, step)
        return sharded_names(answer.get("results") if isinstance(answer, dict) else None)


def sharded_names(results: Any) -> list[str] | None:
    """The workers' ``weight_checker_dp_sharded`` answers as one list (``None``: not such answers)."""
    if not isinstance(results, list) or not all(isinstance(r, list) for r in results):
        return None
    return sorted({n for r in results for n in r if isinstance(n, str)})


VLLM = VLLMFamily()
