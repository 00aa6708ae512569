"""One step of the workflow on many engines at once: the one fan-out pool
every target uses (bounded, each engine timed, a progress line), and
:class:`EngineSet`, the workflow's operations written once over it.

A target subclasses :class:`EngineSet` and gives ``_call(name, op, step)``
for one engine; everything else (all or none pausing, resuming whatever
was paused, failures named by engine, how the engines' digests relate) is
here. Async engines are reached from the pool's threads through their event
loop (:mod:`weight_checker.verify.targets.async_engines`), so there is one
pool, one bound and one progress line for every kind of engine.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from weight_checker.errors import HttpError, InputError, VerifyError
from weight_checker.scope import DEFAULT, parse_include, scope_of
from weight_checker.verify.engine_digests import EngineDigests, Layout, decide_layout

DEFAULT_CONCURRENCY = 32
#: What an engine that serves nothing during the call (an offline ``LLM``)
#: answers to pause: there is nothing to resume afterwards.
NOTHING_TO_PAUSE = object()


@dataclass
class StepTiming:
    """Seconds each engine took in one fanned-out step."""

    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def slowest(self) -> tuple[str, float] | None:
        return max(self.seconds.items(), key=lambda kv: kv[1]) if self.seconds else None


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


def _failure_message(e: BaseException) -> str:
    if isinstance(e, (VerifyError, HttpError)):
        return e.message
    return f"{type(e).__name__}: {e}"


def fan_out(
    step: str,
    names: list[str],
    call: Callable[[str], Any],
    *,
    concurrency: int,
    timing: StepTiming | None = None,
    progress: Progress | None = None,
) -> tuple[dict[str, Any], dict[str, BaseException]]:
    """``call(name)`` for every name at once (at most ``concurrency`` in
    flight); ``(results, failures)``, both by name. Every call ends (each
    has its own timeout) before this returns."""
    results: dict[str, Any] = {}
    failures: dict[str, BaseException] = {}
    update = (progress or Progress(False)).start(step, len(names))

    def one(name: str) -> None:
        started = time.perf_counter()
        try:
            results[name] = call(name)
        except Exception as e:  # an engine's own failure, named by the caller
            failures[name] = e
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


def no_digests(include: Any) -> str:
    """Why an engine that answered an empty digest map fails the check: it
    proves nothing (an engine serving no model, or a scope it holds nothing
    of), and must never pass for an engine whose keys all match."""
    scope = ", ".join(include) if include else "the target model"
    return f"answered no digests at all (scope: {scope}): nothing it holds can be checked"


def first_failure(step: str, names: list[str], failures: dict[str, BaseException]) -> VerifyError:
    """One error for a step that failed on some engines: the first one named,
    the others listed; the first one's exception is its cause."""
    first = next(n for n in names if n in failures)
    others = [n for n in names if n in failures and n != first]
    more = f" (and {len(others)} more: {', '.join(others)})" if others else ""
    error = VerifyError(step, first, _failure_message(failures[first]) + more)
    error.__cause__ = failures[first]
    return error


class EngineSet:
    """The workflow's operations over named engines, fanned out by one pool.
    Subclasses give ``_call(name, op, step)`` for ``op`` in ``pause``,
    ``resume``, ``checksum`` (returns ``{key: hex}`` of the scope
    ``include``), ``reset`` (of that scope), ``version`` (vLLM's version)
    and ``weight_version`` (the weight version the engine claims), the last
    two a string or ``None`` where unknown, and ``dp_sharded`` (a list: the
    names of the parameters the engine's DP ranks shard between them)."""

    def __init__(
        self,
        names: list[str],
        concurrency: int,
        progress: Progress | None,
        layout: Layout | None = None,
        include: tuple[str, ...] = DEFAULT,
    ):
        if concurrency < 1:
            raise InputError(f"concurrency must be >= 1, got {concurrency}")
        self.names = names
        #: What a checksum covers (:mod:`weight_checker.scope`).
        self.include = parse_include(list(include))
        #: engine -> rank -> slot -> adapter name, from the latest scoped checksum.
        self.lora_slots: dict[str, Any] = {}
        self.concurrency = concurrency
        self.progress = progress or Progress()
        self.paused: list[str] = []
        #: How the engines' digests relate, as the caller asked (``"merge"``,
        #: ``"fleet"``) or ``None``: the first checksum's key sets decide.
        self.requested_layout = layout
        #: The layout decided by the first checksum, then held to.
        self.layout: Layout | None = None
        #: step -> per-engine seconds, for the report.
        self.timings: dict[str, StepTiming] = {}

    def _call(self, name: str, op: str, step: str) -> Any:
        raise NotImplementedError

    def _all(
        self, op: str, step: str, names: list[str] | None = None
    ) -> tuple[dict[str, Any], dict[str, BaseException]]:
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
        """All or none. A pause that failed may still have paused its engine
        (a client-side timeout after the server paused), and an interrupted
        one may be in flight: then every engine asked is to be resumed (a
        resume of an engine that is not paused changes nothing)."""
        asked = [n for n in self.names if n not in self.paused]
        try:
            done, failures = self._all("pause", "pause")
        except BaseException:
            self.paused += asked
            raise
        if failures:
            self.paused += [n for n in asked if done.get(n) is not NOTHING_TO_PAUSE]
            raise first_failure("pause", self.names, failures)
        self.paused += [n for n in asked if done[n] is not NOTHING_TO_PAUSE]

    def resume(self) -> list[str]:
        names = list(self.paused)
        done, failures = self._all("resume", "resume", names)
        self.paused = [n for n in self.paused if n not in done]
        return [str(VerifyError("resume", n, _failure_message(failures[n]))) for n in names if n in failures]

    def per_engine(self, step: str) -> dict[str, dict[str, str]]:
        """Every engine's ``{key: hex}``, as they are (no layout decided)."""
        done = self.each("checksum", step)
        for name in self.names:
            if isinstance(done[name], dict) and not done[name]:
                raise VerifyError(step, name, no_digests(self.include))
            # A draft asked for and none hashed: the scope was not checked
            # (an engine without a draft answers its target keys only).
            # Adapters and buffers may be absent for good reasons.
            if "draft" in self.include and isinstance(done[name], dict):
                if not any(scope_of(k) == "draft" for k in done[name]):
                    raise VerifyError(step, name, "answered no digests of the scope draft: it serves no draft model")
        return {n: done[n] for n in self.names}

    def checksums(self, step: str) -> EngineDigests:
        """Every engine's ``{key: hex}``, and how they relate: decided at the
        first checksum, then held to (a merge must stay disjoint; a fleet's
        engines may then differ: that is what the comparison reports)."""
        per_engine = self.per_engine(step)
        try:
            if self.layout is None:
                self.layout = decide_layout(per_engine, self.requested_layout)
            elif self.layout == "merge":
                decide_layout(per_engine, "merge")
        except InputError as e:
            raise VerifyError(step, None, str(e)) from e
        return EngineDigests(per_engine, self.layout)

    def reset(self, step: str) -> None:
        self.each("reset", step)

    def each(self, op: str, step: str) -> dict[str, Any]:
        """``op`` on every engine, as step ``step``; raises naming the first
        engine that failed, once every call has ended."""
        done, failures = self._all(op, step)
        if failures:
            raise first_failure(step, self.names, failures)
        return done

    def dp_sharded(self, step: str) -> set[str] | None:
        """Names of the parameters the engines' DP ranks shard between them
        (a MoE model's experts: not replicas), or ``None`` where an engine
        cannot say (a vLLM without this package's plugin)."""
        done, failures = self._all("dp_sharded", step)
        if failures or any(not isinstance(v, list) for v in done.values()):
            return None
        return {name for names in done.values() for name in names}

    def versions(self) -> dict[str, str | None]:
        done, _ = self._all("version", "version")
        return {n: done.get(n) for n in self.names}

    def weight_versions(self, step: str) -> dict[str, str | None]:
        """The weight version each engine claims, ``None`` where it reports
        none (no ``/weight_info``): reported, never a failure."""
        done, _ = self._all("weight_version", step)
        return {n: done.get(n) for n in self.names}
