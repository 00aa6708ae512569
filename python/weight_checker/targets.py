"""What the verify workflow checks: one engine or a fleet of them.

Every target implements :class:`Target`: ``pause``, ``resume``, ``checksum``,
``reset``, ``versions`` and ``per_engine`` (one digest map per engine, for
replica checks), plus ``names`` and ``paused``. The runner in
:mod:`weight_checker.verify` is written once against it.

- :class:`HttpTarget`: API servers, every step on all of them at once (a
  bounded pool, ``concurrency``), each request with its own timeout, so one
  hung server costs the timeout, never the sum.
- :class:`LLMTarget` / :class:`AsyncLLMTarget`: an in-process ``vllm.LLM`` /
  ``vllm.AsyncLLM``, through the plugin's worker methods over
  ``collective_rpc``.
- :class:`RayTarget`: a Ray actor that hosts an engine and passes
  ``collective_rpc`` through (see :mod:`weight_checker.ray`).
- :class:`Fleet`: several in-process or Ray engines, fanned out like servers.

Keys of several engines: servers behind an external load balancer serve
disjoint ranks (``dp0``, ``dp1``, ...), and their maps are merged. Independent
engines (a fleet of replicas) serve the same keys; those are kept apart as
``"{engine} {key}"``, so each engine is compared with its own baseline and a
mismatch names its engine.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from weight_checker.errors import VerifyError
from weight_checker.httpclient import HttpError, api_key_from_env, post_json, request, validate_url
from weight_checker.keys import DuplicateKeysError, merge_digests

DEFAULT_CONCURRENCY = 32
#: What an engine that serves nothing during the call (an offline ``LLM``)
#: answers to pause: there is nothing to resume afterwards.
NOTHING_TO_PAUSE = object()


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


@dataclass
class StepTiming:
    """Seconds each engine took in one fanned-out step."""

    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def slowest(self) -> tuple[str, float] | None:
        return max(self.seconds.items(), key=lambda kv: kv[1]) if self.seconds else None


def combine(per_engine: Sequence[tuple[str, Mapping[str, str]]]) -> tuple[dict[str, str], bool]:
    """``(digests, kept_apart)``: merged when the engines serve disjoint keys;
    ``"{engine} {key}"`` when any key is served by more than one engine."""
    if len(per_engine) == 1:
        return dict(per_engine[0][1]), False
    seen: set[str] = set()
    shared = False
    for _, sums in per_engine:
        if not seen.isdisjoint(sums):
            shared = True
            break
        seen.update(sums)
    if not shared:
        return merge_digests([s for _, s in per_engine], [n for n, _ in per_engine]), False
    return {f"{name} {k}": v for name, sums in per_engine for k, v in sums.items()}, True


class Progress:
    """``step: done/total engines, slowest so far`` on a TTY's stderr, once a
    fanned-out step has run for a second."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def start(self, step: str, total: int) -> Callable[[int, tuple[str, float] | None], None]:
        begun = time.monotonic()

        def update(done: int, slowest: tuple[str, float] | None) -> None:
            if not self.enabled or time.monotonic() - begun < 1.0:
                return
            slow = f", slowest so far {slowest[0]} {slowest[1]:.1f} s" if slowest else ""
            end = "\n" if done == total else ""
            sys.stderr.write(f"\r{step}: {done}/{total} engines done{slow}   {end}")
            sys.stderr.flush()

        return update


def fan_out(
    step: str,
    names: list[str],
    call: Callable[[str], Any],
    *,
    concurrency: int,
    timing: StepTiming | None = None,
    progress: Progress | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """``call(name)`` for every name at once (at most ``concurrency`` in
    flight); ``(results, failures)``, both by name. Every call ends (each
    has its own timeout) before this returns."""
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    update = (progress or Progress(False)).start(step, len(names))

    def one(name: str) -> None:
        started = time.perf_counter()
        try:
            results[name] = call(name)
        except VerifyError as e:
            failures[name] = e.message
        except HttpError as e:
            failures[name] = e.message
        except Exception as e:  # an engine's own failure, named by the caller
            failures[name] = f"{type(e).__name__}: {e}"
        finally:
            if timing is not None:
                timing.seconds[name] = time.perf_counter() - started
            update(len(results) + len(failures), timing.slowest if timing else None)

    if len(names) == 1:
        one(names[0])
    else:
        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(names)))) as pool:
            list(pool.map(one, names))
    return results, failures


def _first_failure(step: str, names: list[str], failures: dict[str, str]) -> VerifyError:
    first = next(n for n in names if n in failures)
    more = f" (and {len(failures) - 1} more: {', '.join(n for n in names if n in failures and n != first)})"
    return VerifyError(step, first, failures[first] + (more if len(failures) > 1 else ""))


class _FannedOut:
    """The workflow's operations over named engines, fanned out; subclasses
    give ``_call(name, op, step)``."""

    is_async = False

    def __init__(self, names: list[str], concurrency: int, progress: Progress | None):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.names = names
        self.concurrency = concurrency
        self.progress = progress or Progress()
        self.paused: list[str] = []
        self.kept_apart = False
        #: step -> per-engine seconds, for the report.
        self.timings: dict[str, StepTiming] = {}

    def _call(self, name: str, op: str, step: str) -> Any:
        raise NotImplementedError

    def _all(self, op: str, step: str, names: list[str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
        names = list(self.names if names is None else names)
        timing = self.timings.setdefault(step, StepTiming())
        return fan_out(
            step,
            names,
            lambda n: self._call(n, op, step),
            concurrency=self.concurrency,
            timing=timing,
            progress=self.progress,
        )

    def pause(self) -> None:
        done, failures = self._all("pause", "pause")
        self.paused += [n for n in self.names if n in done and done[n] is not NOTHING_TO_PAUSE]
        if failures:  # all or none: the runner resumes every engine that did pause
            raise _first_failure("pause", self.names, failures)

    def resume(self) -> list[str]:
        names = list(self.paused)
        done, failures = self._all("resume", "resume", names)
        self.paused = [n for n in self.paused if n not in done]
        return [str(VerifyError("resume", n, failures[n])) for n in names if n in failures]

    def per_engine(self, step: str) -> list[tuple[str, dict[str, str]]]:
        done, failures = self._all("checksum", step)
        if failures:
            raise _first_failure(step, self.names, failures)
        return [(n, done[n]) for n in self.names]

    def checksum(self, step: str) -> dict[str, str]:
        per_engine = self.per_engine(step)
        try:
            digests, self.kept_apart = combine(per_engine)
        except DuplicateKeysError as e:
            raise VerifyError(step, str(e.source), f"keys also served by another engine: {e.keys[:5]}") from None
        return digests

    def reset(self, step: str) -> None:
        _, failures = self._all("reset", step)
        if failures:
            raise _first_failure(step, self.names, failures)

    def versions(self) -> dict[str, str | None]:
        done, _ = self._all("version", "version")
        return {n: done.get(n) for n in self.names}


# --- HTTP -----------------------------------------------------------------------------


class HttpTarget(_FannedOut):
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


# --- in-process and Ray engines ---------------------------------------------------------

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


class Fleet(_FannedOut):
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
            raise _first_failure("pause", self.names, failures)

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
            raise _first_failure(step, self.names, failures)
        return [(n, done[n]) for n in self.names]

    async def checksum(self, step: str) -> dict[str, str]:
        digests, self.kept_apart = combine(await self.per_engine(step))
        return digests

    async def reset(self, step: str) -> None:
        async def one(name: str, engine: Any) -> None:
            await self._rpc(name, engine, WORKER_METHODS["reset"], step)

        _, failures = await self._each(step, one)
        if failures:
            raise _first_failure(step, self.names, failures)

    def versions(self) -> dict[str, str | None]:
        return dict.fromkeys(self.names, _in_process_vllm_version())


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
