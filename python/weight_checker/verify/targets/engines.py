"""In-process and Ray-hosted vLLM engines as targets, through the plugin's
worker methods over ``collective_rpc``."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from weight_checker.errors import VerifyError
from weight_checker.fanout import (
    DEFAULT_CONCURRENCY,
    NOTHING_TO_PAUSE,
    FannedOut,
    Progress,
    StepTiming,
    combine,
    first_failure,
)
from weight_checker.keys import DuplicateKeysError, merge_digests

WORKER_METHODS = {"checksum": "weight_checker_checksums", "reset": "weight_checker_reset"}


def _merge_workers(results: Any, step: str, name: str) -> dict[str, str]:
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        raise VerifyError(step, name, f"unexpected answer {str(results)[:200]}")
    try:
        return merge_digests(results)
    except DuplicateKeysError as e:
        raise VerifyError(step, name, f"two workers produced the same keys: {e.keys[:5]}") from None


def _in_process_vllm_version() -> str | None:
    return getattr(sys.modules.get("vllm"), "__version__", None)


class _RpcEngine:
    """One engine reached by ``collective_rpc(method, timeout=...)``; subclasses
    say how the call is made."""

    def __init__(self, engine: Any, name: str, timeout: float | None):
        self.engine = engine
        self.name = name
        self.timeout = timeout

    def rpc(self, method: str, step: str) -> Any:
        try:
            return self._collective_rpc(method)
        except Exception as e:
            raise VerifyError(step, self.name, f"collective_rpc({method!r}) failed: {e}") from None

    def _collective_rpc(self, method: str) -> Any:
        return self.engine.collective_rpc(method, timeout=self.timeout)

    def version(self) -> str | None:
        return _in_process_vllm_version()

    def call(self, op: str, step: str) -> Any:
        if op in ("pause", "resume"):
            return NOTHING_TO_PAUSE  # an offline engine serves nothing during the call
        if op == "version":
            return self.version()
        result = self.rpc(WORKER_METHODS[op], step)
        return _merge_workers(result, step, self.name) if op == "checksum" else None


class _RayEngine(_RpcEngine):
    """A Ray actor handle whose actor passes ``collective_rpc`` through to the
    engine it hosts (:class:`weight_checker.ray.EngineActorMixin`)."""

    def _collective_rpc(self, method: str) -> Any:
        import ray  # only where a Ray handle was passed

        return ray.get(self.engine.collective_rpc.remote(method), timeout=self.timeout)

    def version(self) -> str | None:
        import ray

        try:
            version = ray.get(self.engine.vllm_version.remote(), timeout=self.timeout)
        except Exception:
            return None
        return version if isinstance(version, str) else None


def is_ray_actor(obj: Any) -> bool:
    """A Ray actor handle, recognised without importing Ray."""
    return type(obj).__module__.startswith("ray.") and type(obj).__name__ == "ActorHandle"


class Fleet(FannedOut):
    """In-process ``vllm.LLM`` engines or Ray actor handles (one or several),
    every step on all of them at once."""

    def __init__(
        self,
        engines: Iterable[Any],
        *,
        timeout: float | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        progress: Progress | None = None,
    ):
        engines = list(engines)
        if not engines:
            raise ValueError("no engine given")
        self.engines: dict[str, _RpcEngine] = {}
        for i, e in enumerate(engines):
            ray = is_ray_actor(e)
            label = "ray actor" if ray else f"in-process {type(e).__name__}"
            name = f"engine {i} ({label})" if len(engines) > 1 else label
            self.engines[name] = (_RayEngine if ray else _RpcEngine)(e, name, timeout)
        super().__init__(list(self.engines), concurrency, progress)

    def _call(self, name: str, op: str, step: str) -> Any:
        return self.engines[name].call(op, step)


LLMTarget = Fleet  # one in-process LLM is a fleet of one


class AsyncLLMTarget:
    """In-process ``vllm.AsyncLLM`` engines (one or several, or any engine
    client with an async ``collective_rpc``); paused with ``pause_generation``."""

    is_async = True

    def __init__(self, engines: Any, *, timeout: float | None = None):
        engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        self.engines = {
            (f"engine {i} (in-process {type(e).__name__})" if len(engines) > 1 else f"in-process {type(e).__name__}"): e
            for i, e in enumerate(engines)
        }
        self.names = list(self.engines)
        self.timeout = timeout
        self.paused: list[str] = []
        self.kept_apart = False
        self.timings: dict[str, StepTiming] = {}

    async def _each(
        self, step: str, fn: Callable[[str, Any], Any], names: list[str] | None = None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        names = list(self.names if names is None else names)
        timing = self.timings.setdefault(step, StepTiming())

        async def one(name: str) -> tuple[str, Any, str | None]:
            started = time.perf_counter()
            try:
                return name, await fn(name, self.engines[name]), None
            except VerifyError as e:
                return name, None, e.message
            except Exception as e:
                return name, None, f"{type(e).__name__}: {e}"
            finally:
                timing.seconds[name] = time.perf_counter() - started

        out = await asyncio.gather(*(one(n) for n in names))
        return {n: r for n, r, err in out if err is None}, {n: err for n, _, err in out if err is not None}

    async def _rpc(self, name: str, engine: Any, method: str, step: str) -> Any:
        try:
            return await engine.collective_rpc(method, timeout=self.timeout)
        except Exception as e:
            raise VerifyError(step, name, f"collective_rpc({method!r}) failed: {e}") from None

    async def pause(self) -> None:
        async def one(name: str, engine: Any) -> None:
            if hasattr(engine, "pause_generation"):
                await engine.pause_generation(mode="abort")
                self.paused.append(name)

        _, failures = await self._each("pause", one)
        if failures:
            raise first_failure("pause", self.names, failures)

    async def resume(self) -> list[str]:
        async def one(name: str, engine: Any) -> None:
            await engine.resume_generation()
            self.paused.remove(name)

        _, failures = await self._each("resume", one, list(self.paused))
        return [str(VerifyError("resume", n, m)) for n, m in failures.items()]

    async def per_engine(self, step: str) -> list[tuple[str, dict[str, str]]]:
        async def one(name: str, engine: Any) -> dict[str, str]:
            return _merge_workers(await self._rpc(name, engine, WORKER_METHODS["checksum"], step), step, name)

        done, failures = await self._each(step, one)
        if failures:
            raise first_failure(step, self.names, failures)
        return [(n, done[n]) for n in self.names]

    async def checksum(self, step: str) -> dict[str, str]:
        digests, self.kept_apart = combine(await self.per_engine(step))
        return digests

    async def reset(self, step: str) -> None:
        async def one(name: str, engine: Any) -> None:
            await self._rpc(name, engine, WORKER_METHODS["reset"], step)

        _, failures = await self._each(step, one)
        if failures:
            raise first_failure(step, self.names, failures)

    def versions(self) -> dict[str, str | None]:
        return dict.fromkeys(self.names, _in_process_vllm_version())
