"""In-process ``AsyncLLM`` engines (or any engine client with an async
``collective_rpc``) as a target.

The workflow runs in a worker thread (:func:`weight_checker.verify_async`
awaits it), and every call to an engine is scheduled on the event loop the
engine runs on and waited for, with the timeout, from the pool's thread: the
loop stays free to serve the engine, and async engines share the one pool,
bound and progress line of every other target.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine, Iterable
from typing import Any

from weight_checker.errors import InputError, VerifyError
from weight_checker.scope import DEFAULT
from weight_checker.verify.engine_digests import Layout
from weight_checker.verify.fanout import DEFAULT_CONCURRENCY, EngineSet, Progress
from weight_checker.verify.targets.engines import engine_names, in_process_vllm_version, merge_workers, worker_method


def run_on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], timeout: float | None) -> Any:
    """Runs ``coro`` on ``loop`` (another thread's) and waits for its result."""
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError as e:
        future.cancel()
        raise TimeoutError(f"no answer within {timeout} s") from e


class AsyncLLMTarget(EngineSet):
    """In-process ``AsyncLLM`` engines, paused with ``pause_generation``."""

    def __init__(
        self,
        engines: Iterable[Any],
        loop: asyncio.AbstractEventLoop,
        *,
        timeout: float | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        progress: Progress | None = None,
        layout: Layout | None = None,
        include: tuple[str, ...] = DEFAULT,
    ):
        engines = list(engines)
        if not engines:
            raise InputError("no engine given")
        names = engine_names(engines, lambda e: f"in-process {type(e).__name__}")
        self.engines = dict(zip(names, engines, strict=True))
        self.loop = loop
        self.timeout = timeout
        super().__init__(names, concurrency, progress, layout, include)

    def _call(self, name: str, op: str, step: str) -> Any:
        engine = self.engines[name]
        if op == "version":
            return in_process_vllm_version()
        if op == "weight_version":
            get = getattr(engine, "get_weight_version", None)
            version = run_on_loop(self.loop, get(), self.timeout) if callable(get) else None
            return version if isinstance(version, str) else None
        if op in ("pause", "resume"):
            method = "pause_generation" if op == "pause" else "resume_generation"
            if not callable(getattr(engine, method, None)):
                raise VerifyError(
                    step, name, f"{type(engine).__name__} has no {method}(): it cannot be paused during the check"
                )
            call = engine.pause_generation(mode="abort") if op == "pause" else engine.resume_generation()
            return run_on_loop(self.loop, call, self.timeout)
        method, args = worker_method(op, self.include)
        try:
            call = engine.collective_rpc(method, timeout=self.timeout, args=args)
            result = run_on_loop(self.loop, call, self.timeout)
        except Exception as e:
            raise VerifyError(step, name, f"collective_rpc({method!r}) failed: {e}") from e
        return merge_workers(result, step, name, self.lora_slots) if op == "checksum" else None
