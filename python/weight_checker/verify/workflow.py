"""The RL weight-update check as a library: from a trainer, over HTTP or in process.

    result = weight_checker.verify(llm, transfer=lambda: llm.collective_rpc("reload_weights"))
    result.raise_for_mismatch()

The workflow is vLLM's seed flow: pause, checksum (the baseline), reset (zero
every weight), checksum (post-reset), transfer (the trainer pushes the
weights), checksum (current), compare, resume. Every mismatching key is
classed ``missing`` (baseline only), ``unexpected`` (current only),
``untouched-since-reset`` (still its post-reset digest: the update never
reached it) or ``changed``.

With ``expected`` (the digests every rank must hold, from
:func:`weight_checker.expected_digests`), there is no reset: pause, checksum
(before), transfer, checksum (after), compare with ``expected``, resume. Each
mismatching key is then classed ``stale`` (after equals before: the update
never reached it), ``wrong-shard`` (it holds the expected digest of another tp
rank or another key; ``details`` says which), ``changed``, ``missing`` or
``unexpected``.

Targets, each an adapter with the same four operations:

- HTTP: one URL or several (external load balancing: keys merged, a key
  served twice is an error), optional API key (``Authorization: Bearer``);
- an in-process ``vllm.LLM``: ``collective_rpc`` to the plugin's worker
  methods; an offline engine serves no requests during the call, so there
  is nothing to pause;
- an in-process ``vllm.AsyncLLM`` (:func:`verify_async`): pause and resume
  through ``pause_generation`` / ``resume_generation``.

Whatever fails, every server that was paused is resumed, and each failure
to resume is reported. :func:`replicas` compares the replicas of a model
(the ``dp`` ranks of one server, or several independent servers) with no
pause and no reset.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Generator, Mapping
from typing import Any

from weight_checker.classes import (
    EMPTY_DIGEST,
    already_zeroed_warning,
    classify,
    classify_expected,
)
from weight_checker.errors import VerifyError, WeightCheckerError
from weight_checker.replicas import ReplicaResult, replicas
from weight_checker.results import Step, VerifyResult, WeightMismatchError
from weight_checker.targets import (
    DEFAULT_CONCURRENCY,
    AsyncLLMTarget,
    Fleet,
    HttpTarget,
    LLMTarget,
    Target,
    target_for,
)

__all__ = [
    "AsyncLLMTarget",
    "Fleet",
    "HttpTarget",
    "LLMTarget",
    "ReplicaResult",
    "Target",
    "VerifyError",
    "VerifyResult",
    "WeightCheckerError",
    "WeightMismatchError",
    "classify",
    "classify_expected",
    "replicas",
    "target_for",
    "verify",
    "verify_async",
]


# --- the workflow --------------------------------------------------------------------
#
# One workflow for sync and async targets: a generator that yields each
# operation's return value (a value, or an awaitable for async targets and
# async transfers) and is sent back the result. `verify` resolves them in
# place, `verify_async` awaits them.


class _Run:
    """Bookkeeping of one run: the steps, their timings, the result."""

    def __init__(self, target: Any):
        self.target = target
        self.result = VerifyResult(servers=list(target.names))

    def step(self, name: str, seconds: float, *, ok: bool, detail: str = "") -> None:
        timing = getattr(self.target, "timings", {}).get(name)
        slowest = timing.slowest if timing is not None and len(timing.seconds) > 1 else None
        self.result.steps.append(Step(name, seconds, ok, detail, slowest))

    def finish(self, values: dict[str, Any]) -> None:
        start = time.perf_counter()
        expected = values.get("expected")
        if expected is not None:
            unwritten = set(getattr(expected, "unwritten", ()))
            if getattr(self.target, "kept_apart", False):  # one copy of the expectation per engine
                unwritten = {f"{n} {k}" for n in self.target.names for k in unwritten}
                expected = {f"{n} {k}": v for n in self.target.names for k, v in expected.items()}
            after = {k: v for k, v in values["current"].items() if k not in unwritten}
            self.result.mismatches, self.result.details = classify_expected(expected, values.get("before"), after)
            self.result.key_count = len(expected)
            if unwritten:
                self.result.warnings.append(
                    f"{len(unwritten)} key(s) not checked: the expected weights never wrote them"
                )
            emptied = [k for k in self.result.mismatches if after.get(k) == EMPTY_DIGEST != expected.get(k)]
            if emptied:
                self.result.warnings.append(
                    f"{len(emptied)} key(s) hold no bytes on the engine but are expected to (a CPU backend repacks "
                    f"linear weights into empty parameters): they cannot match, e.g. {emptied[0]}"
                )
        else:
            baseline, post_reset = values["baseline"], values.get("post_reset")
            self.result.mismatches = classify(baseline, values["current"], post_reset)
            self.result.key_count = len(baseline)
            if post_reset is not None and (w := already_zeroed_warning(baseline, post_reset)):
                self.result.warnings.append(w)
        self.result.match = not self.result.mismatches
        self.step("compare", time.perf_counter() - start, ok=True)


def _load_digests(digests: Mapping[str, str] | None, what: str) -> Mapping[str, str] | None:
    if digests is None:
        return None
    if not isinstance(digests, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in digests.items()
    ):
        raise TypeError(f"{what} must be a mapping key -> sha256 hex")
    return digests


def _mode(transfer: Any, baseline: Any, expected: Any, name: str) -> str:
    if baseline is not None and expected is not None:
        raise TypeError(f"{name} takes a baseline or expected digests, not both")
    if expected is not None:
        if transfer is None:
            raise TypeError(f"{name} with expected digests needs a transfer callable")
        return "expected"
    if baseline is not None:
        return "baseline"
    if transfer is None:
        raise TypeError(f"{name} needs a transfer callable (or a baseline to compare with)")
    return "reset"


def version_warnings(expected: Mapping[str, str] | None, versions: Mapping[str, str | None]) -> list[str]:
    """One warning per engine whose vLLM is not the one that computed ``expected``."""
    want = getattr(expected, "vllm_version", "") or ""
    if not want:
        return []
    return [
        f"{name} runs vLLM {got}, the expected digests were computed with vLLM {want}"
        for name, got in versions.items()
        if got and got != want
    ]


def _steps(t: Target, transfer: Callable[[], Any] | None, mode: str) -> list[tuple[str, Callable[[], Any], str | None]]:
    """``(step, call, result key)`` in order. ``mode``: ``reset`` (the seed's
    flow), ``expected`` (no reset: before, transfer, after) or ``baseline``
    (the current checksum only)."""
    call_transfer = lambda: _call_transfer(transfer)  # noqa: E731
    if mode == "expected":
        return [
            ("pause", t.pause, None),
            ("checksum (before)", lambda: t.checksum("checksum (before)"), "before"),
            ("transfer", call_transfer, None),
            ("checksum (after)", lambda: t.checksum("checksum (after)"), "current"),
        ]
    steps: list[tuple[str, Callable[[], Any], str | None]] = []
    if mode == "reset":
        steps += [
            ("pause", t.pause, None),
            ("checksum (baseline)", lambda: t.checksum("checksum (baseline)"), "baseline"),
            ("reset", lambda: t.reset("reset"), None),
            ("checksum (post-reset)", lambda: t.checksum("checksum (post-reset)"), "post_reset"),
            ("transfer", call_transfer, None),
        ]
    steps.append(("checksum (current)", lambda: t.checksum("checksum (current)"), "current"))
    return steps


def _call_transfer(transfer: Callable[[], Any] | None) -> Any:
    """Calls the transfer; its awaitable (if any) is resolved by the driver."""
    try:
        return transfer()  # type: ignore[misc]
    except VerifyError:
        raise
    except Exception as e:
        raise _as_step_error("transfer", e) from e


#: What the workflow yields (step, a value or awaitable), is sent, and returns.
_Workflow = Generator[tuple[str, Any], Any, VerifyResult]


def _workflow(t: Target, transfer: Callable[[], Any] | None, mode: str, values: dict[str, Any], run: _Run) -> _Workflow:
    """The check as a generator (see the section comment); returns the result."""
    error: BaseException | None = None
    try:
        if values.get("expected") is not None:
            run.result.warnings += version_warnings(values["expected"], t.versions())
        for name, fn, key in _steps(t, transfer, mode):
            start = time.perf_counter()
            try:
                value = yield (name, fn())
            except BaseException:
                run.step(name, time.perf_counter() - start, ok=False)
                raise
            run.step(name, time.perf_counter() - start, ok=True)
            if key:
                values[key] = value
        run.finish(values)
    except BaseException as e:
        error = e
    finally:
        if t.paused:
            start = time.perf_counter()
            failures = yield ("resume", t.resume())
            run.step("resume", time.perf_counter() - start, ok=not failures, detail="; ".join(failures))
            run.result.warnings.extend(f"could not resume: {f}" for f in failures)
    return _conclude(run, error)


def _as_step_error(step: str, e: BaseException) -> BaseException:
    """An awaited transfer's own failure, named as the transfer step's."""
    if step == "transfer" and isinstance(e, Exception) and not isinstance(e, VerifyError):
        return VerifyError("transfer", None, f"the transfer failed: {type(e).__name__}: {e}")
    return e


#: ``(value, None)`` or ``(None, exception)``: how a yielded item settled.
_Outcome = tuple[Any, BaseException | None]


def _resume(gen: _Workflow, step: str, outcome: _Outcome) -> tuple[str, Any]:
    value, error = outcome
    return gen.throw(_as_step_error(step, error)) if error is not None else gen.send(value)


def _settle_sync(item: Any) -> _Outcome:
    try:
        return (asyncio.run(_await(item)) if inspect.isawaitable(item) else item), None
    except BaseException as e:
        return None, e


async def _settle_async(item: Any) -> _Outcome:
    try:
        return ((await item) if inspect.isawaitable(item) else item), None
    except BaseException as e:
        return None, e


def _drive_sync(gen: _Workflow) -> VerifyResult:
    try:
        step, item = next(gen)
        while True:
            step, item = _resume(gen, step, _settle_sync(item))
    except StopIteration as done:
        result: VerifyResult = done.value
        return result


async def _drive_async(gen: _Workflow) -> VerifyResult:
    try:
        step, item = next(gen)
        while True:
            step, item = _resume(gen, step, await _settle_async(item))
    except StopIteration as done:
        result: VerifyResult = done.value
        return result


async def _await(value: Awaitable[Any]) -> Any:
    return await value


def _start(
    t: Target,
    transfer: Callable[[], Any] | None,
    baseline: Mapping[str, str] | None,
    expected: Mapping[str, str] | None,
    name: str,
) -> _Workflow:
    """The workflow for ``t``, its inputs checked (``name``: the caller, for
    the messages)."""
    baseline = _load_digests(baseline, "baseline")
    expected = _load_digests(expected, "expected")
    mode = _mode(transfer, baseline, expected, name)
    return _workflow(t, transfer, mode, {"baseline": baseline, "expected": expected}, _Run(t))


def verify(
    target: Any,
    transfer: Callable[[], Any] | None = None,
    *,
    baseline: Mapping[str, str] | None = None,
    expected: Mapping[str, str] | None = None,
    timeout: float | None = None,
    api_key: str | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> VerifyResult:
    """Runs the weight-update check against ``target``: URL(s), an in-process
    ``vllm.LLM``, a Ray actor handle hosting an engine, or a list of engines of
    one kind (use :func:`verify_async` for ``AsyncLLM``).

    ``transfer`` pushes the weights (a callable; a coroutine function is run
    to completion). With ``baseline``, only the current checksum and the
    comparison run; with ``expected`` (:func:`weight_checker.expected_digests`)
    there is no reset. Every step runs on all engines at once (at most
    ``concurrency``), each request with its own ``timeout``. A mismatch is in
    the result (``.match``, ``.raise_for_mismatch()``); a failed step raises
    :class:`VerifyError` (with ``.result`` holding the steps so far), after
    every paused engine was resumed.
    """
    t = target_for(target, api_key=api_key, timeout=timeout, concurrency=concurrency)
    if t.is_async:
        raise TypeError("an AsyncLLM is verified with `await weight_checker.verify_async(...)`")
    return _drive_sync(_start(t, transfer, baseline, expected, "verify"))


async def verify_async(
    target: Any,
    transfer: Callable[[], Any] | None = None,
    *,
    baseline: Mapping[str, str] | None = None,
    expected: Mapping[str, str] | None = None,
    timeout: float | None = None,
    api_key: str | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> VerifyResult:
    """:func:`verify` for in-process ``vllm.AsyncLLM`` engines (paused with
    ``pause_generation``); other targets are run in a thread."""
    t = target_for(target, api_key=api_key, timeout=timeout, concurrency=concurrency)
    if not t.is_async:
        return await asyncio.to_thread(verify, t, transfer, baseline=baseline, expected=expected, timeout=timeout)
    return await _drive_async(_start(t, transfer, baseline, expected, "verify_async"))


def _conclude(run: _Run, error: BaseException | None) -> VerifyResult:
    resume_failures = [s for s in run.result.steps if s.name == "resume" and not s.ok]
    if error is None and resume_failures:
        error = VerifyError("resume", None, resume_failures[0].detail)
    if error is None:
        return run.result
    if isinstance(error, VerifyError):
        run.result.error = str(error)
        error.result = run.result
    # Any error (Ctrl-C too) carries the steps so far, for the report.
    setattr(error, "weight_checker_result", run.result)  # noqa: B010
    raise error
