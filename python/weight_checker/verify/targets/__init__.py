"""What the verify workflow checks: one engine or several, of one kind.

Every target is an :class:`~weight_checker.verify.fanout.EngineSet` and so
implements :class:`Target`, the whole contract the workflow
(:mod:`weight_checker.verify.workflow`) relies on. :func:`target_for` picks
the implementation for what the caller passed:

- :class:`~weight_checker.verify.targets.http.HttpTarget`: API servers;
- :class:`~weight_checker.verify.targets.engines.RpcTarget`: in-process
  ``vllm.LLM`` engines and Ray actors hosting one, through the plugin's
  worker methods over ``collective_rpc``;
- :class:`~weight_checker.verify.targets.async_engines.AsyncLLMTarget`:
  in-process ``AsyncLLM`` engines, reached on their event loop;
- :class:`~weight_checker.verify.targets.sglang_engines.SGLangEngineTarget`:
  in-process ``sglang.Engine``s, through their tokenizer manager.

All of them run each step on every engine at once through the one fan-out
pool (:mod:`weight_checker.verify.fanout`). Another kind of engine is one
more module here with one ``_call``.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Protocol

from weight_checker.engines import DEFAULT_PAUSE
from weight_checker.errors import InputTypeError
from weight_checker.scope import parse_include
from weight_checker.verify.engine_digests import EngineDigests, Layout
from weight_checker.verify.fanout import DEFAULT_CONCURRENCY, StepTiming
from weight_checker.verify.targets.async_engines import AsyncLLMTarget
from weight_checker.verify.targets.engines import RpcTarget, is_ray_actor
from weight_checker.verify.targets.http import HttpTarget
from weight_checker.verify.targets.sglang_engines import SGLangEngineTarget, is_sglang_engine


class Target(Protocol):
    """What the workflow needs of an engine or a set of them (checked by mypy:
    :func:`target_for` returns every implementation as a ``Target``)."""

    #: The engines, by the names every message uses.
    names: list[str]
    #: The engines paused so far (to be resumed, whatever happens).
    paused: list[str]
    #: How the engines' digests relate, once the first checksum decided it.
    layout: Layout | None
    #: step -> seconds each engine took, for the report's slowest engine.
    timings: dict[str, StepTiming]
    #: What a checksum covers (:mod:`weight_checker.scope`).
    include: tuple[str, ...]
    #: engine -> rank -> slot -> adapter name, from the latest scoped checksum.
    lora_slots: dict[str, Any]

    def pause(self) -> None:
        """Pauses every engine, or none: raises after the failure is recorded."""

    def resume(self) -> list[str]:
        """Resumes every engine paused so far; one message per failure."""

    def per_engine(self, step: str) -> dict[str, dict[str, str]]:
        """Every engine's ``{key: hex}``, as they are (for replica checks)."""

    def checksums(self, step: str) -> EngineDigests:
        """Every engine's ``{key: hex}`` and their layout."""

    def reset(self, step: str) -> None:
        """Zeroes every engine's weights."""

    def versions(self) -> dict[str, str | None]:
        """Each engine's vLLM version, ``None`` where it cannot be read."""

    def weight_versions(self, step: str) -> dict[str, str | None]:
        """The weight version each engine claims, ``None`` where it reports none."""


def target_for(
    target: Any,
    *,
    api_key: str | None = None,
    timeout: float | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    layout: Layout | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
    include: Any = None,
    engine: str | None = None,
    pause: str = DEFAULT_PAUSE,
) -> Target:
    """The :class:`Target` for ``target``: URL(s), an ``LLM``, an ``AsyncLLM``
    (``loop``: the event loop it runs on), a Ray actor handle, a list of any
    one of these kinds, or a target already. ``include``: the checksum's
    scope (:func:`weight_checker.scope.parse_include`)."""
    scope = parse_include(include)
    if isinstance(target, (HttpTarget, RpcTarget, AsyncLLMTarget, SGLangEngineTarget)):
        if include is not None and target.include != scope:
            raise InputTypeError(f"the target checks {target.include}; include={list(scope)} asks otherwise")
        return target
    items = list(target) if isinstance(target, (list, tuple)) else [target]
    if not items:
        raise InputTypeError("nothing to verify: an empty list")
    if all(isinstance(t, str) for t in items):
        return HttpTarget(
            items,
            api_key=api_key,
            timeout=timeout,
            concurrency=concurrency,
            layout=layout,
            include=scope,
            engine=engine,
            pause=pause,
        )
    if all(is_sglang_engine(t) for t in items):
        if engine not in (None, "sglang"):
            raise InputTypeError(f"engine={engine!r}, but these are in-process sglang.Engines")
        if include is not None and scope != parse_include(None):
            raise InputTypeError("an in-process sglang.Engine is checked for its target model only (include)")
        return SGLangEngineTarget(items, pause=pause, timeout=timeout, concurrency=concurrency, layout=layout)
    if engine is not None or pause != DEFAULT_PAUSE:
        raise InputTypeError(
            "engine and pause are options of servers (URLs) and sglang.Engines; an in-process vLLM engine pauses as "
            "it can"
        )
    rpcs = [getattr(t, "collective_rpc", None) for t in items]
    if all(r is not None and inspect.iscoroutinefunction(r) for r in rpcs):
        if loop is None:
            raise InputTypeError("an AsyncLLM is verified with `await weight_checker.verify_async(...)`")
        return AsyncLLMTarget(items, loop, timeout=timeout, concurrency=concurrency, layout=layout, include=scope)
    sync_rpc = [r is not None and not inspect.iscoroutinefunction(r) for r in rpcs]
    if all(is_ray_actor(t) or ok for t, ok in zip(items, sync_rpc, strict=True)):
        return RpcTarget(items, timeout=timeout, concurrency=concurrency, layout=layout, include=scope)
    kinds = sorted({type(t).__name__ for t in items})
    raise InputTypeError(
        f"cannot verify {', '.join(kinds)}: expected URL(s), vllm.LLM(s), vllm.AsyncLLM(s), sglang.Engine(s) or Ray "
        "actor handle(s), one kind per call"
    )
