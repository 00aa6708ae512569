"""The RL weight-update check as a library: from a trainer, over HTTP or in process.

    result = weight_checker.verify(llm, transfer=lambda: llm.collective_rpc("reload_weights"))
    result.raise_for_mismatch()

Three modes, one workflow:

- **reset** (vLLM's seed flow): pause, checksum (the baseline), reset (zero
  every weight), checksum (post-reset), transfer, checksum (current),
  compare, resume. Each mismatching key is ``missing``, ``unexpected``,
  ``untouched-since-reset`` or ``changed``.
- **expected** (``expected=``, the digests every rank must hold, from
  :func:`weight_checker.expected_digests`): no reset. Pause, checksum
  (before), transfer, checksum (after), compare with ``expected``, resume.
  ``expected`` may be a callable, called once the transfer ran (step
  "expected digests"): digests computed from the very tensors the transfer
  sent, alongside it.
  Each mismatching key is ``stale``, ``wrong-shard``, ``changed``,
  ``missing`` or ``unexpected`` (:mod:`weight_checker.verify.classes`).
- **baseline** (``baseline=``, no transfer): the current checksum compared
  with a manifest.

Several engines are compared as one model split by rank (``merge``) or as a
fleet of replicas, each against the same reference (``fleet``): see
:mod:`weight_checker.verify.engine_digests`. Whatever fails, every engine
that was paused is resumed, and each failure to resume is reported.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypedDict, Unpack

from weight_checker.engines import DEFAULT_PAUSE
from weight_checker.errors import InputError, InputTypeError, VerifyError
from weight_checker.scope import DEFAULT, parse_include, scope_of
from weight_checker.verify.compare import compare
from weight_checker.verify.engine_digests import EngineDigests, Layout
from weight_checker.verify.fanout import DEFAULT_CONCURRENCY
from weight_checker.verify.results import Step, VerifyResult
from weight_checker.verify.targets import Target, target_for

#: A step: its name, what runs it, and under which name its value is kept.
_StepPlan = tuple[str, Callable[[], Any], str | None]


class Checked(NamedTuple):
    """What a checksum step found: the digests and the weight versions claimed."""

    digests: EngineDigests
    weight_versions: dict[str, str | None]


class _Run:
    """Bookkeeping of one run: the steps, their timings, the result."""

    def __init__(self, target: Target):
        self.target = target
        self.result = VerifyResult(servers=list(target.names))

    def step(self, name: str, seconds: float, *, ok: bool, detail: str = "") -> None:
        timing = self.target.timings.get(name)
        slowest = timing.slowest if timing is not None and len(timing.seconds) > 1 else None
        self.result.steps.append(Step(name, seconds, ok, detail, slowest))


def check_digest_map(digests: Mapping[str, str] | None, what: str) -> Mapping[str, str] | None:
    """``digests`` checked to be a mapping key -> sha256 hex (``None`` passes); ``what`` names it in the error."""
    if digests is None:
        return None
    if not isinstance(digests, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in digests.items()
    ):
        raise InputTypeError(f"{what} must be a mapping key -> sha256 hex")
    return digests


def _resolve_expected(expected: Callable[[], Any]) -> Mapping[str, str]:
    """The expected digests a callable gives, once the transfer ran."""
    try:
        digests = expected()
    except VerifyError:
        raise
    except Exception as e:
        raise VerifyError("expected digests", None, f"{type(e).__name__}: {e}") from e
    checked = check_digest_map(digests, "the expected digests callable's result")
    if checked is None:
        raise VerifyError("expected digests", None, "the expected digests callable returned None")
    return checked


def _mode(transfer: Any, baseline: Any, expected: Any, name: str) -> str:
    if baseline is not None and expected is not None:
        raise InputTypeError(f"{name} takes a baseline or expected digests, not both")
    if expected is not None:
        if transfer is None:
            raise InputTypeError(f"{name} with expected digests needs a transfer callable")
        return "expected"
    if baseline is not None:
        if transfer is not None:
            raise InputTypeError(f"{name} with a baseline compares the current digests only: it takes no transfer")
        return "baseline"
    if transfer is None:
        raise InputTypeError(f"{name} needs a transfer callable (or a baseline to compare with)")
    return "reset"


def requested_layout(fleet: bool, merge: bool) -> Layout | None:
    """``fleet=`` / ``merge=`` as a layout (``None``: the key sets decide)."""
    if fleet and merge:
        raise InputError("fleet and merge exclude each other")
    return "fleet" if fleet else "merge" if merge else None


def scope_for(include: Any, expected: Mapping[str, str] | None) -> tuple[str, ...]:
    """The checksum's scope: ``include``, else every scope the expected
    digests hold keys of, else the target model."""
    if include is not None:
        return parse_include(include)
    if expected:
        return parse_include(sorted({scope_of(k) for k in expected}))
    return DEFAULT


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


def _steps(t: Target, transfer: Callable[[], Any], mode: str, expected: Any = None) -> list[_StepPlan]:
    """The steps of ``mode``, in order (resume is the runner's). A checksum
    step also reads the weight version each engine claims."""

    def checksum(step: str, key: str | None) -> _StepPlan:
        return step, lambda: Checked(t.checksums(step), t.weight_versions(f"{step}: weight version")), key

    if mode == "baseline":
        return [checksum("checksum (current)", "current")]
    if mode == "expected":
        return [
            ("pause", t.pause, None),
            checksum("checksum (before)", "before"),
            ("transfer", transfer, None),
            *([("expected digests", lambda: _resolve_expected(expected), "expected")] if callable(expected) else []),
            checksum("checksum (after)", "current"),
        ]
    return [
        ("pause", t.pause, None),
        checksum("checksum (baseline)", "baseline"),
        ("reset", lambda: t.reset("reset"), None),
        checksum("checksum (post-reset)", "post_reset"),
        ("transfer", transfer, None),
        checksum("checksum (current)", "current"),
    ]


def _call_transfer(transfer: Callable[[], Any], loop: asyncio.AbstractEventLoop | None) -> Callable[[], None]:
    """The transfer as a step: a coroutine it returns runs to completion (on
    ``loop``, the caller's, under :func:`verify_async`); its own failure is
    the transfer step's, with the failure as the cause."""

    def run() -> None:
        try:
            value = transfer()
            if inspect.isawaitable(value):
                if loop is not None:
                    asyncio.run_coroutine_threadsafe(_await(value), loop).result()
                else:
                    asyncio.run(_await(value))
        except VerifyError:
            raise
        except Exception as e:
            raise VerifyError("transfer", None, f"the transfer failed: {type(e).__name__}: {e}") from e

    return run


async def _await(value: Any) -> Any:
    return await value


def _explain(result: VerifyResult, t: Target, values: dict[str, Any], history: Any, limit: int) -> None:
    """Why the check failed (:mod:`weight_checker.verify.explain`), into
    ``result.explanation``; a failure to explain is a warning, never the
    verdict's."""
    try:
        from weight_checker.verify.engine_digests import display_key
        from weight_checker.verify.explain import explain_engines, fetcher_for, source_for, versions_from

        current: EngineDigests = values["current"].digests
        fleet = current.layout == "fleet"
        mismatches = (
            dict(result.by_engine)
            if fleet
            else {
                e: {k: c for k, c in result.mismatches.items() if k in held} for e, held in current.per_engine.items()
            }
        )
        expected = values["expected"]
        result.explanation = explain_engines(
            current.per_engine,
            mismatches,
            expected,
            {engine: fetcher_for(t, engine) for engine in current.per_engine},
            source_for(expected),
            history=versions_from(list(history or ())),
            limit=limit,
            show=display_key if fleet else (lambda engine, key: key),
        )
        result.class_by_explanation()
    except Exception as e:  # whatever fails, the verdict stands and is returned
        result.warnings.append(f"the mismatch could not be explained: {type(e).__name__}: {e}")


def _run(
    t: Target,
    transfer: Callable[[], Any] | None,
    baseline: Mapping[str, str] | None,
    expected: Mapping[str, str] | Callable[[], Mapping[str, str]] | None,
    name: str,
    loop: asyncio.AbstractEventLoop | None = None,
    explain_limit: int = 0,
    history: Any = (),
) -> VerifyResult:
    """The workflow on ``t``, its inputs checked (``name``: the caller, for messages)."""
    baseline = check_digest_map(baseline, "baseline")
    later = expected if callable(expected) else None
    expected = None if callable(expected) else check_digest_map(expected, "expected")
    mode = _mode(transfer, baseline, expected if later is None else later, name)
    values: dict[str, Any] = {"expected": expected, "baseline_manifest": baseline}
    run = _Run(t)
    error: BaseException | None = None
    try:
        if expected is not None:
            run.result.warnings += list(getattr(expected, "warnings", ()))
            run.result.warnings += version_warnings(expected, t.versions())
        call_transfer = _call_transfer(transfer, loop) if transfer is not None else (lambda: None)
        for step, fn, key in _steps(t, call_transfer, mode, later):
            start = time.perf_counter()
            try:
                value = fn()
            except BaseException:
                run.step(step, time.perf_counter() - start, ok=False)
                raise
            run.step(step, time.perf_counter() - start, ok=True)
            if key:
                values[key] = value
            if step == "expected digests":
                run.result.warnings += list(getattr(value, "warnings", ()))
                run.result.warnings += version_warnings(value, t.versions())
        start = time.perf_counter()
        compare(run.result, values)
        run.result.lora_slots = dict(t.lora_slots)
        run.step("compare", time.perf_counter() - start, ok=True)
        if run.result.mismatches and explain_limit and values.get("expected") is not None:
            # While the engines are still paused: the blocks are those of the bytes just hashed.
            start = time.perf_counter()
            _explain(run.result, t, values, history, explain_limit)
            run.step("explain", time.perf_counter() - start, ok=True)
    except BaseException as e:
        error = e
    finally:
        if t.paused:
            start = time.perf_counter()
            failures = t.resume()
            run.step("resume", time.perf_counter() - start, ok=not failures, detail="; ".join(failures))
            run.result.warnings.extend(f"could not resume: {f}" for f in failures)
    return _conclude(run, error)


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


class VerifyOptions(TypedDict, total=False):
    """The options of :func:`verify` and :func:`verify_async`.

    - ``baseline``: compare the current digests with these (no transfer);
    - ``expected``: the digests every rank must hold
      (:func:`weight_checker.expected_digests`), or a callable that returns
      them once the transfer ran: no reset;
    - ``timeout``: seconds per request to each engine (HTTP: 600);
    - ``api_key``: the servers' API key (default ``VLLM_API_KEY``);
    - ``concurrency``: engines asked at once (32);
    - ``fleet`` / ``merge``: the engines are replicas / disjoint ranks of one
      model (default: their key sets decide; a contradiction is an error);
    - ``include``: what a checksum covers (``["target", "draft", "lora"]``;
      default: the expected digests' scopes, else the target model);
    - ``explain``: on a mismatch against expected digests, explain the first
      64 mismatched keys (an int: that many; ``False``: none): where in each
      tensor, and the likely cause (``result.explanation``; see
      :mod:`weight_checker.verify.explain`); nothing is asked on a match;
    - ``history``: the expected digests of previous versions, newest first
      (or ``(label, digests)`` pairs), for causes like ``version:step-11``;
    - ``engine``: the servers' inference engine, ``"vllm"`` or ``"sglang"``
      (default: read from each server); URLs only;
    - ``pause``: how generation is paused, ``"abort"`` (default), ``"wait"``
      or ``"keep"`` (the requests in flight go on after the resume; SGLang:
      abort or keep); URLs only.
    """

    baseline: Mapping[str, str] | None
    expected: Mapping[str, str] | Callable[[], Mapping[str, str]] | None
    timeout: float | None
    api_key: str | None
    concurrency: int
    fleet: bool
    merge: bool
    include: Any
    explain: bool | int
    engine: str | None
    pause: str
    history: Any


def _explaining(options: VerifyOptions) -> tuple[int, Any]:
    """``(how many keys to explain, previous versions)`` from the options."""
    from weight_checker.verify.explain import DEFAULT_LIMIT

    wanted = options.get("explain", True)
    if isinstance(wanted, bool):
        return (DEFAULT_LIMIT if wanted else 0), options.get("history") or ()
    if not isinstance(wanted, int) or wanted < 0:
        raise InputTypeError(f"explain must be a bool or a number of keys >= 0, got {wanted!r}")
    return wanted, options.get("history") or ()


def _prepare(target: Any, options: VerifyOptions, loop: asyncio.AbstractEventLoop | None = None) -> Target:
    unknown = sorted(set(options) - set(VerifyOptions.__annotations__))
    if unknown:
        raise InputTypeError(
            f"unexpected option {unknown[0]!r}; the options are {', '.join(VerifyOptions.__annotations__)}"
        )
    layout = requested_layout(options.get("fleet", False), options.get("merge", False))
    expected = options.get("expected")
    scope = scope_for(options.get("include"), None if callable(expected) else expected)
    return target_for(
        target,
        api_key=options.get("api_key"),
        timeout=options.get("timeout"),
        concurrency=options.get("concurrency", DEFAULT_CONCURRENCY),
        layout=layout,
        loop=loop,
        include=scope,
        engine=options.get("engine"),
        pause=options.get("pause", DEFAULT_PAUSE),
    )


def verify(target: Any, transfer: Callable[[], Any] | None = None, **options: Unpack[VerifyOptions]) -> VerifyResult:
    """Runs the weight-update check against ``target``: URL(s), an in-process
    ``vllm.LLM``, a Ray actor handle hosting an engine, or a list of engines of
    one kind (use :func:`verify_async` for ``AsyncLLM``).

    ``transfer`` pushes the weights (a callable; a coroutine it returns is run
    to completion). ``options`` (:class:`VerifyOptions`): with ``baseline``
    (and no transfer) only the current checksum and the comparison run; with
    ``expected`` there is no reset, and an ``expected.weight_version`` must
    be the one each engine claims while holding its weights
    (``result.version_mismatches``). Every step runs on all engines at once,
    each request with its own timeout. A mismatch is in the result
    (``.match``, ``.raise_for_mismatch()``); a failed step raises
    :class:`VerifyError` (``.result`` holds the steps so far), after every
    paused engine was resumed.
    """
    t = _prepare(target, options)
    return _run(t, transfer, options.get("baseline"), options.get("expected"), "verify", None, *_explaining(options))


async def verify_async(
    target: Any, transfer: Callable[[], Any] | None = None, **options: Unpack[VerifyOptions]
) -> VerifyResult:
    """:func:`verify` from a coroutine, for in-process ``vllm.AsyncLLM``
    engines (paused with ``pause_generation``) and every other target. The
    checks run in a worker thread; the engines' calls and a coroutine
    ``transfer`` run on this event loop, which stays free meanwhile."""
    loop = asyncio.get_running_loop()
    t = _prepare(target, options, loop)
    return await asyncio.to_thread(
        _run, t, transfer, options.get("baseline"), options.get("expected"), "verify_async", loop,
        *_explaining(options),
    )  # fmt: skip
