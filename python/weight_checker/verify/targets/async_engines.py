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

from weight_checker.engines.vllm import sharded_names
from weight_checker.errors import VerifyError
from weight_checker.verify.targets.engines import InProcessTarget, in_process_vllm_version, merge_workers, worker_method


def run_on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], timeout: float | None) -> Any:
    """Runs ``coro`` on ``loop`` (another thread's) and waits for its result."""
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError as e:
        future.cancel()
        raise TimeoutError(f"no answer within {timeout} s") from e


class AsyncLLMTarget(InProcessTarget):
    """In-process ``AsyncLLM`` engines, paused with ``pause_generation``;
    ``loop`` is the event loop they run on."""

    def __init__(self, engines: Iterable[Any], loop: asyncio.AbstractEventLoop, **options: Any):
        self.loop = loop
        super().__init__(engines, **options)

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
        result = self.rpc(name, method, args, step)
        if op == "dp_sharded":
            return sharded_names(result)
        return merge_workers(result, step, name, self.lora_slots) if op == "checksum" else None

    def rpc(self, name: str, method: str, args: tuple[Any, ...], step: str) -> Any:
        """Engine ``name``'s workers' answers to ``method(*args)``: scheduled on
        the engine's loop from the calling thread (never the loop's own), which
        stays free; any failure is a :class:`VerifyError` of ``step``."""
        try:
            call = self.engines[name].collective_rpc(method, timeout=self.timeout, args=args)
            return run_on_loop(self.loop, call, self.timeout)
        except Exception as e:
            raise VerifyError(step, name, f"collective_rpc({method!r}) failed: {e}") from e
