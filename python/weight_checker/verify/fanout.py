"""Running one step of the workflow on many engines at once: a bounded pool,
a per-engine timing, a progress line, and the combination of their digest
maps. :class:`weight_checker.http_target.HttpTarget` and
:class:`weight_checker.engine_targets.Fleet` are built on :class:`FannedOut`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from weight_checker.errors import VerifyError
from weight_checker.httpclient import HttpError
from weight_checker.keys import DuplicateKeysError, merge_digests

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


def first_failure(step: str, names: list[str], failures: dict[str, str]) -> VerifyError:
    first = next(n for n in names if n in failures)
    more = f" (and {len(failures) - 1} more: {', '.join(n for n in names if n in failures and n != first)})"
    return VerifyError(step, first, failures[first] + (more if len(failures) > 1 else ""))


class FannedOut:
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
            raise first_failure("pause", self.names, failures)

    def resume(self) -> list[str]:
        names = list(self.paused)
        done, failures = self._all("resume", "resume", names)
        self.paused = [n for n in self.paused if n not in done]
        return [str(VerifyError("resume", n, failures[n])) for n in names if n in failures]

    def per_engine(self, step: str) -> list[tuple[str, dict[str, str]]]:
        done, failures = self._all("checksum", step)
        if failures:
            raise first_failure(step, self.names, failures)
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
            raise first_failure(step, self.names, failures)

    def versions(self) -> dict[str, str | None]:
        done, _ = self._all("version", "version")
        return {n: done.get(n) for n in self.names}
