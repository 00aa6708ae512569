"""Work the suite runs in the background from its first test: each in-process
engine a test needs (a trainer-like process driving ``vllm.LLM``, the
engines that are expected digests' oracle, TRL's GRPO run, Ray actors) is a
subprocess that spends most of its time importing vLLM and starting
engines, on one or two cores. Started at the session's start, two at a time,
they run while the tests that need neither run, and the tests that read
their results run last (``conftest.py`` orders them).

A test module plans its jobs with a module-level ``background_jobs(env)``
returning ``{name: callable}`` (``env.models``: the session's checkpoints,
tests/servers.py's :class:`~tests.servers.Models`; ``env.servers``: the
server pool, for a one-off server); a test reads a job's
result with the ``jobs`` fixture: ``jobs.result(name)`` (the callable's
return value, or its exception raised again). A job no collected test plans
is not run; one asked for that was not planned runs when asked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Jobs:
    """The session's background jobs (see the module docstring)."""

    def __init__(self, workers: int = 2):
        self.planned: dict[str, Callable[[], Any]] = {}
        #: name -> seconds it ran, for the summary.
        self.seconds: dict[str, float] = {}
        self._futures: dict[str, Future[Any]] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="test-job")

    def plan(self, name: str, fn: Callable[[], Any]) -> None:
        self.planned.setdefault(name, fn)

    def start(self) -> None:
        """Every planned job, queued in plan order."""
        with self._lock:
            for name, fn in self.planned.items():
                if name not in self._futures:
                    self._futures[name] = self._executor.submit(self._timed, name, fn)

    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        from .servers import wait_for_memory

        wait_for_memory()  # an engine's start takes as much as a server's
        began = time.monotonic()
        try:
            return fn()
        finally:
            self.seconds[name] = time.monotonic() - began

    def result(self, name: str) -> Any:
        with self._lock:
            future = self._futures.get(name)
            if future is None:
                future = self._futures[name] = self._executor.submit(self._timed, name, self.planned[name])
        return future.result()

    def close(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._executor.shutdown(wait=True)

    def summary(self) -> list[str]:
        if not self.seconds:
            return []
        lines = [f"background jobs: {len(self.seconds)} (tests/jobs.py)"]
        lines += [f"  {name:32} {s:6.1f} s" for name, s in self.seconds.items()]
        return lines
