"""What the verify workflow checks: one engine or a fleet of them.

Every target implements :class:`Target`: ``pause``, ``resume``, ``checksum``,
``reset``, ``versions`` and ``per_engine`` (one digest map per engine, for
replica checks), plus ``names`` and ``paused``. The runner in
:mod:`weight_checker.verify` is written once against it; :func:`target_for`
picks the implementation for what the caller passed:

- :class:`HttpTarget` (:mod:`weight_checker.http_target`): API servers, every
  step on all of them at once (a bounded pool, ``concurrency``), each request
  with its own timeout, so one hung server costs the timeout, never the sum.
- :class:`Fleet` (= :class:`LLMTarget`) and :class:`AsyncLLMTarget`
  (:mod:`weight_checker.engine_targets`): in-process ``vllm.LLM`` /
  ``vllm.AsyncLLM`` engines and Ray actors that host one (see
  :mod:`weight_checker.ray`), through the plugin's worker methods over
  ``collective_rpc``, fanned out like servers.

The fan-out itself (pool, timings, progress, combining maps) is
:mod:`weight_checker.fanout`. Keys of several engines: servers behind an
external load balancer serve disjoint ranks (``dp0``, ``dp1``, ...), and their
maps are merged. Independent engines (a fleet of replicas) serve the same
keys; those are kept apart as ``"{engine} {key}"``, so each engine is compared
with its own baseline and a mismatch names its engine.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

from weight_checker.engine_targets import AsyncLLMTarget, Fleet, LLMTarget, is_ray_actor
from weight_checker.fanout import DEFAULT_CONCURRENCY, NOTHING_TO_PAUSE, Progress, StepTiming, combine
from weight_checker.http_target import HttpTarget

__all__ = [
    "DEFAULT_CONCURRENCY",
    "NOTHING_TO_PAUSE",
    "AsyncLLMTarget",
    "Fleet",
    "HttpTarget",
    "LLMTarget",
    "Progress",
    "StepTiming",
    "Target",
    "combine",
    "target_for",
]


@runtime_checkable
class Target(Protocol):
    """What the workflow needs of an engine or a fleet. Sync targets return
    values; async ones (``is_async``) return awaitables."""

    names: list[str]
    paused: list[str]
    is_async: bool

    def pause(self) -> Any: ...
    def resume(self) -> Any:
        """Resumes every engine paused so far; gives one message per failure."""

    def checksum(self, step: str) -> Any:
        """One map of every key the target serves (see the module docstring)."""

    def per_engine(self, step: str) -> Any:
        """``[(engine name, {key: hex})]``, for replica checks."""

    def reset(self, step: str) -> Any: ...
    def versions(self) -> dict[str, str | None]: ...


def target_for(
    target: Any,
    *,
    api_key: str | None = None,
    timeout: float | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> Any:
    """The :class:`Target` for ``target``: URL(s), an ``LLM``, an ``AsyncLLM``,
    a Ray actor handle, a list of any one of these kinds, or a target already."""
    if isinstance(target, Target):
        return target
    items = list(target) if isinstance(target, (list, tuple)) else [target]
    if not items:
        raise TypeError("nothing to verify: an empty list")
    if all(isinstance(t, str) for t in items):
        return HttpTarget(items, api_key=api_key, timeout=timeout, concurrency=concurrency)
    rpcs = [getattr(t, "collective_rpc", None) for t in items]
    if all(r is not None and inspect.iscoroutinefunction(r) for r in rpcs):
        return AsyncLLMTarget(items, timeout=timeout)
    sync_rpc = [r is not None and not inspect.iscoroutinefunction(r) for r in rpcs]
    if all(is_ray_actor(t) or ok for t, ok in zip(items, sync_rpc, strict=True)):
        return Fleet(items, timeout=timeout, concurrency=concurrency)
    kinds = sorted({type(t).__name__ for t in items})
    raise TypeError(
        f"cannot verify {', '.join(kinds)}: expected URL(s), vllm.LLM(s), vllm.AsyncLLM(s) or Ray actor handle(s),"
        " one kind per call"
    )
