"""The seam's interface: what an engine family does for a check, in HTTP calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from weight_checker.errors import InputError

#: How generation is paused for a check: ``abort`` the requests in flight,
#: ``wait`` for them to finish (new ones queue), or ``keep`` them frozen in
#: place, to go on after the resume (async RL keeps its rollouts).
PAUSE_MODES = ("abort", "wait", "keep")
DEFAULT_PAUSE = "abort"

#: ``post(url, path, body, step) -> answer`` (a failure is a VerifyError naming the step and the server).
Post = Callable[[str, str, Any, str], Any]
#: ``get(url, path) -> (status, body)``; raises HttpError where nothing answers.
Get = Callable[[str, str], tuple[int, Any]]


class EngineFamily(Protocol):
    """What differs between the servers of one inference engine."""

    #: ``"vllm"``, ``"sglang"``.
    name: str
    #: As people write it: ``"vLLM"``, ``"SGLang"``.
    display: str
    #: The :data:`PAUSE_MODES` this engine has.
    pause_modes: tuple[str, ...]

    def pause(self, post: Post, url: str, mode: str, step: str) -> Any: ...

    def resume(self, post: Post, url: str, step: str) -> Any: ...

    def reload(self, post: Post, get: Get, url: str, step: str, pause_mode: str = "abort") -> Any:
        """The weights loaded again from the checkpoint the server runs
        (``--transfer reload``), while it is paused in ``pause_mode``."""

    def version(self, get: Get, url: str) -> str | None: ...

    def weight_version(self, get: Get, url: str) -> str | None: ...

    def dp_sharded(self, post: Post, url: str, step: str) -> list[str] | None:
        """The parameters its DP ranks shard between them (``None``: not told)."""


def check_pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise InputError(f"unknown pause mode {mode!r}: expected {', '.join(PAUSE_MODES)}")
    return mode
