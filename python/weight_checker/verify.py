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
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from weight_checker.digests import compare
from weight_checker.httpclient import HttpError, api_key_from_env, post_json, validate_url
from weight_checker.keys import DuplicateKeysError, merge_digests, split_key

EMPTY_DIGEST = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
CLASSES = ("missing", "unexpected", "untouched-since-reset", "changed")
EXPECTED_CLASSES = ("missing", "unexpected", "stale", "wrong-shard", "changed")


class WeightCheckerError(Exception):
    """Base class of the verify workflow's errors."""


class WeightMismatchError(WeightCheckerError):
    """The weights after the transfer differ from the baseline."""

    def __init__(self, mismatches: Mapping[str, str]):
        counts: dict[str, int] = {}
        for c in mismatches.values():
            counts[c] = counts.get(c, 0) + 1
        summary = ", ".join(f"{n} {c}" for c, n in sorted(counts.items()))
        first = ", ".join(sorted(mismatches)[:5])
        more = " ..." if len(mismatches) > 5 else ""
        super().__init__(f"{len(mismatches)} keys differ from the baseline ({summary}): {first}{more}")
        self.mismatches = dict(mismatches)


class VerifyError(WeightCheckerError):
    """A step of the workflow failed (not a mismatch): names the step and the server."""

    def __init__(self, step: str, server: str | None, message: str):
        where = f" on {server}" if server else ""
        super().__init__(f"step '{step}'{where}: {message}")
        self.step = step
        self.server = server
        self.message = message
        self.result: VerifyResult | None = None


@dataclass
class Step:
    name: str
    seconds: float
    ok: bool
    detail: str = ""


@dataclass
class VerifyResult:
    """What one run of the workflow found."""

    match: bool = False
    #: key -> class, for every mismatching key (vLLM's union semantics).
    mismatches: dict[str, str] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    keys: int = 0
    servers: list[str] = field(default_factory=list)
    error: str | None = None
    #: key -> what a ``wrong-shard`` key holds instead (the key whose expected
    #: digest it has), with ``expected``.
    details: dict[str, str] = field(default_factory=dict)

    def raise_for_mismatch(self) -> None:
        if self.mismatches:
            raise WeightMismatchError(self.mismatches)

    def classes(self) -> dict[str, list[str]]:
        """class -> sorted keys."""
        out: dict[str, list[str]] = {}
        for k in sorted(self.mismatches):
            out.setdefault(self.mismatches[k], []).append(k)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "servers": self.servers,
            "steps": [{"step": s.name, "ok": s.ok, "seconds": s.seconds, "detail": s.detail} for s in self.steps],
            "match": self.match,
            "mismatches": sorted(self.mismatches),
            "classes": self.classes(),
            "keys": self.keys,
            "warnings": self.warnings,
            **({"details": self.details} if self.details else {}),
            **({"error": self.error} if self.error else {}),
        }


def classify(
    baseline: Mapping[str, str], current: Mapping[str, str], post_reset: Mapping[str, str] | None = None
) -> dict[str, str]:
    """key -> class for every key whose digests differ (missing and extra keys included)."""
    out: dict[str, str] = {}
    for k in compare(baseline, current)["mismatches"]:
        if k not in current:
            out[k] = "missing"
        elif k not in baseline:
            out[k] = "unexpected"
        elif post_reset is not None and post_reset.get(k) == current[k]:
            out[k] = "untouched-since-reset"
        else:
            out[k] = "changed"
    return out


def _rank_and_name(key: str) -> tuple[str, str]:
    """``("dp0:pp0:pcp0", "name")`` and the tp rank apart: keys that differ
    only in their tp rank are shards of one tensor."""
    parts = key.split(":", 4)
    if len(parts) < 5:
        return key, ""
    return ":".join(parts[:3]) + ":" + parts[4], parts[3]


def classify_expected(
    expected: Mapping[str, str], before: Mapping[str, str] | None, after: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """``(key -> class, key -> detail)`` for every key whose digest after the
    transfer is not the expected one.

    ``wrong-shard`` first where the key holds the expected digest of the same
    tensor on another tp rank (every rank loading shard 0 looks the same
    before and after); then ``stale`` where it is unchanged by the transfer;
    then ``wrong-shard`` where it holds another key's expected digest;
    else ``changed``. ``missing`` / ``unexpected``: expected only / after only.
    """
    by_digest: dict[str, list[str]] = {}
    for k, v in expected.items():
        by_digest.setdefault(v, []).append(k)
    classes: dict[str, str] = {}
    details: dict[str, str] = {}
    for k in sorted(set(expected) | set(after)):
        if k not in after:
            classes[k] = "missing"
            continue
        if k not in expected:
            classes[k] = "unexpected"
            continue
        got = after[k]
        if got == expected[k]:
            continue
        holders = [h for h in by_digest.get(got, []) if h != k]
        name, _ = _rank_and_name(k)
        shards = [h for h in holders if _rank_and_name(h)[0] == name]
        if shards:
            other = shards[0]
            classes[k], details[k] = "wrong-shard", f"holds the expected digest of {_rank_and_name(other)[1]} ({other})"
        elif before is not None and before.get(k) == got:
            classes[k] = "stale"
        elif holders:
            classes[k], details[k] = "wrong-shard", f"holds the expected digest of {holders[0]}"
        else:
            classes[k] = "changed"
    return classes, details


def already_zeroed_warning(baseline: Mapping[str, str], post_reset: Mapping[str, str]) -> str | None:
    """The diagnosis when the baseline equals the post-reset digests: the
    engine was zeroed before this run started (an earlier update failed?)."""
    if baseline == post_reset and any(v != EMPTY_DIGEST for v in baseline.values()):
        return (
            "the baseline digests equal the post-reset digests: the engine's weights were already "
            "zeroed (reset) before this run, so the baseline is not the model you loaded; "
            "reload the model, then verify again"
        )
    return None


# --- targets -------------------------------------------------------------------


class HttpTarget:
    """One API server or several (``--data-parallel-external-lb``)."""

    def __init__(self, urls: str | Iterable[str], *, api_key: str | None = None, timeout: float | None = None):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("no server URL given")
        self.urls = [validate_url(u) for u in urls]
        self.api_key = api_key_from_env(api_key)
        self.timeout = 600.0 if timeout is None else timeout
        self.paused: list[str] = []

    @property
    def names(self) -> list[str]:
        return list(self.urls)

    def _post(self, url: str, path: str, body: Any, step: str) -> Any:
        try:
            return post_json(url, path, body, timeout=self.timeout, api_key=self.api_key)
        except HttpError as e:
            raise VerifyError(step, url, e.message) from None

    def pause(self) -> None:
        for url in self.urls:
            self._post(url, "/pause?mode=abort", None, "pause")
            self.paused.append(url)

    def resume(self) -> list[str]:
        """Resumes every server paused so far; returns one message per failure."""
        failures = []
        for url in list(self.paused):
            try:
                self._post(url, "/resume", None, "resume")
                self.paused.remove(url)
            except VerifyError as e:
                failures.append(str(e))
        return failures

    def checksums_by_server(self, step: str) -> list[dict[str, str]]:
        out = []
        for url in self.urls:
            answer = self._post(url, "/weight_checker", {"action": "checksum"}, step)
            sums = answer.get("checksums") if isinstance(answer, dict) else None
            if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
                raise VerifyError(step, url, f"unexpected answer {str(answer)[:200]}")
            out.append(sums)
        return out

    def checksum(self, step: str) -> dict[str, str]:
        per_server = self.checksums_by_server(step)
        try:
            return merge_digests(per_server, self.urls)
        except DuplicateKeysError as e:
            raise VerifyError(step, str(e.source), f"keys also served by another server: {e.keys[:5]}") from None

    def reset(self, step: str) -> None:
        for url in self.urls:
            self._post(url, "/weight_checker", {"action": "reset"}, step)

    def versions(self) -> dict[str, str | None]:
        """Each server's vLLM version (``GET /version``), None where unknown."""
        from weight_checker.httpclient import request

        out: dict[str, str | None] = {}
        for url in self.urls:
            try:
                status, body = request("GET", url, "/version", timeout=min(self.timeout, 30), api_key=self.api_key)
                out[url] = body.get("version") if status == 200 and isinstance(body, dict) else None
            except HttpError:
                out[url] = None
        return out


def _in_process_vllm_version() -> str | None:
    vllm = sys.modules.get("vllm")
    return getattr(vllm, "__version__", None)


def _merge_workers(results: list[Any], step: str, name: str) -> dict[str, str]:
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        raise VerifyError(step, name, f"unexpected answer {str(results)[:200]}")
    try:
        return merge_digests(results)
    except DuplicateKeysError as e:
        raise VerifyError(step, name, f"two workers produced the same keys: {e.keys[:5]}") from None


class LLMTarget:
    """An in-process ``vllm.LLM``: the plugin's worker methods over ``collective_rpc``."""

    def __init__(self, llm: Any, *, timeout: float | None = None):
        self.llm = llm
        self.timeout = timeout
        self.name = f"in-process {type(llm).__name__}"
        self.names = [self.name]

    def _rpc(self, method: str, step: str) -> Any:
        try:
            return self.llm.collective_rpc(method, timeout=self.timeout)
        except Exception as e:
            raise VerifyError(step, self.name, f"collective_rpc({method!r}) failed: {e}") from None

    def pause(self) -> None:  # an offline engine serves nothing during the call
        pass

    def resume(self) -> list[str]:
        return []

    def checksum(self, step: str) -> dict[str, str]:
        return _merge_workers(self._rpc("weight_checker_checksums", step), step, self.name)

    def reset(self, step: str) -> None:
        self._rpc("weight_checker_reset", step)

    def versions(self) -> dict[str, str | None]:
        return {self.name: _in_process_vllm_version()}


class AsyncLLMTarget:
    """An in-process ``vllm.AsyncLLM`` (or any engine client with an async
    ``collective_rpc``); paused with ``pause_generation``."""

    def __init__(self, engine: Any, *, timeout: float | None = None):
        self.engine = engine
        self.timeout = timeout
        self.name = f"in-process {type(engine).__name__}"
        self.names = [self.name]
        self.paused = False

    async def _rpc(self, method: str, step: str) -> Any:
        try:
            return await self.engine.collective_rpc(method, timeout=self.timeout)
        except Exception as e:
            raise VerifyError(step, self.name, f"collective_rpc({method!r}) failed: {e}") from None

    async def pause(self) -> None:
        if hasattr(self.engine, "pause_generation"):
            try:
                await self.engine.pause_generation(mode="abort")
            except Exception as e:
                raise VerifyError("pause", self.name, str(e)) from None
            self.paused = True

    async def resume(self) -> list[str]:
        if not self.paused:
            return []
        try:
            await self.engine.resume_generation()
            self.paused = False
            return []
        except Exception as e:
            return [str(VerifyError("resume", self.name, str(e)))]

    async def checksum(self, step: str) -> dict[str, str]:
        return _merge_workers(await self._rpc("weight_checker_checksums", step), step, self.name)

    async def reset(self, step: str) -> None:
        await self._rpc("weight_checker_reset", step)

    def versions(self) -> dict[str, str | None]:
        return {self.name: _in_process_vllm_version()}


def target_for(target: Any, *, api_key: str | None = None, timeout: float | None = None) -> Any:
    """The adapter for ``target``: a URL or list of URLs, an ``LLM``, an
    ``AsyncLLM``, or an adapter already."""
    if isinstance(target, (HttpTarget, LLMTarget, AsyncLLMTarget)):
        return target
    if isinstance(target, str) or (
        isinstance(target, (list, tuple)) and target and all(isinstance(t, str) for t in target)
    ):
        return HttpTarget(target, api_key=api_key, timeout=timeout)
    rpc = getattr(target, "collective_rpc", None)
    if rpc is not None and inspect.iscoroutinefunction(rpc):
        return AsyncLLMTarget(target, timeout=timeout)
    if rpc is not None:
        return LLMTarget(target, timeout=timeout)
    raise TypeError(f"cannot verify a {type(target).__name__}: expected URL(s), a vllm.LLM or a vllm.AsyncLLM")


# --- the workflow --------------------------------------------------------------------


class _Run:
    """Bookkeeping shared by the sync and async workflows."""

    def __init__(self, target: Any):
        self.target = target
        self.result = VerifyResult(servers=list(getattr(target, "names", [])))

    def begin(self) -> float:
        return time.perf_counter()

    def end(self, name: str, start: float, *, ok: bool, detail: str = "") -> None:
        self.result.steps.append(Step(name, time.perf_counter() - start, ok, detail))

    def finish(self, values: dict[str, Any]) -> None:
        start = self.begin()
        expected = values.get("expected")
        if expected is not None:
            unwritten = set(getattr(expected, "unwritten", ()))
            after = {k: v for k, v in values["current"].items() if k not in unwritten}
            self.result.mismatches, self.result.details = classify_expected(expected, values.get("before"), after)
            self.result.keys = len(expected)
            if unwritten:
                self.result.warnings.append(
                    f"{len(unwritten)} key(s) not checked: the expected weights never wrote them"
                )
        else:
            baseline, post_reset = values["baseline"], values.get("post_reset")
            self.result.mismatches = classify(baseline, values["current"], post_reset)
            self.result.keys = len(baseline)
            if post_reset is not None and (w := already_zeroed_warning(baseline, post_reset)):
                self.result.warnings.append(w)
        self.result.match = not self.result.mismatches
        self.end("compare", start, ok=True)


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


def verify(
    target: Any,
    transfer: Callable[[], Any] | None = None,
    *,
    baseline: Mapping[str, str] | None = None,
    expected: Mapping[str, str] | None = None,
    timeout: float | None = None,
    api_key: str | None = None,
) -> VerifyResult:
    """Runs the weight-update check against ``target`` (URL(s) or an in-process
    ``vllm.LLM``; use :func:`verify_async` for an ``AsyncLLM``).

    ``transfer`` pushes the weights (a callable; a coroutine function is run
    to completion). With ``baseline``, only the current checksum and the
    comparison run. A mismatch is in the result (``.match``,
    ``.raise_for_mismatch()``); a failed step raises :class:`VerifyError`
    (with ``.result`` holding the steps so far), after every paused server
    was resumed.
    """
    t = target_for(target, api_key=api_key, timeout=timeout)
    if isinstance(t, AsyncLLMTarget):
        raise TypeError("an AsyncLLM is verified with `await weight_checker.verify_async(...)`")
    baseline = _load_digests(baseline, "baseline")
    expected = _load_digests(expected, "expected")
    mode = _mode(transfer, baseline, expected, "verify")
    run = _Run(t)
    values: dict[str, Any] = {"baseline": baseline, "expected": expected}
    error: BaseException | None = None
    try:
        if expected is not None:
            run.result.warnings += version_warnings(expected, t.versions())
        for name, fn, key in _steps(t, transfer, mode, _call_transfer):
            start = run.begin()
            try:
                value = fn()
            except BaseException:
                run.end(name, start, ok=False)
                raise
            run.end(name, start, ok=True)
            if key:
                values[key] = value
        run.finish(values)
    except BaseException as e:
        error = e
    finally:
        if getattr(t, "paused", None):
            start = run.begin()
            failures = t.resume()
            _note_resume(run, failures, run.begin() - start, True)
    return _conclude(run, error)


async def verify_async(
    target: Any,
    transfer: Callable[[], Any] | None = None,
    *,
    baseline: Mapping[str, str] | None = None,
    expected: Mapping[str, str] | None = None,
    timeout: float | None = None,
    api_key: str | None = None,
) -> VerifyResult:
    """:func:`verify` for an in-process ``vllm.AsyncLLM`` (paused with
    ``pause_generation``); also accepts URL(s) and an ``LLM``, run in a thread."""
    t = target_for(target, api_key=api_key, timeout=timeout)
    if not isinstance(t, AsyncLLMTarget):
        return await asyncio.to_thread(verify, t, transfer, baseline=baseline, expected=expected, timeout=timeout)
    baseline = _load_digests(baseline, "baseline")
    expected = _load_digests(expected, "expected")
    mode = _mode(transfer, baseline, expected, "verify_async")
    run = _Run(t)
    values: dict[str, Any] = {"baseline": baseline, "expected": expected}
    error: BaseException | None = None
    try:
        if expected is not None:
            run.result.warnings += version_warnings(expected, t.versions())
        for name, fn, key in _steps(t, transfer, mode, _call_transfer_async):
            start = run.begin()
            try:
                value = await fn()
            except BaseException:
                run.end(name, start, ok=False)
                raise
            run.end(name, start, ok=True)
            if key:
                values[key] = value
        run.finish(values)
    except BaseException as e:
        error = e
    finally:
        if t.paused:
            start = run.begin()
            failures = await t.resume()
            _note_resume(run, failures, run.begin() - start, True)
    return _conclude(run, error)


def _steps(
    t: Any, transfer: Callable[[], Any] | None, mode: str, call_transfer: Callable[[Any], Any]
) -> list[tuple[str, Callable[[], Any], str | None]]:
    """The workflow, once for both runners: ``(step, call, result key)``.
    The calls return values (sync targets) or awaitables (async targets).
    ``mode``: ``reset`` (the seed's flow), ``expected`` (no reset: before,
    transfer, after) or ``baseline`` (the current checksum only)."""
    steps: list[tuple[str, Callable[[], Any], str | None]] = []
    if mode == "expected":
        steps += [
            ("pause", t.pause, None),
            ("checksum (before)", lambda: t.checksum("checksum (before)"), "before"),
            ("transfer", lambda: call_transfer(transfer), None),
            ("checksum (after)", lambda: t.checksum("checksum (after)"), "current"),
        ]
        return steps
    if mode == "reset":
        steps += [
            ("pause", t.pause, None),
            ("checksum (baseline)", lambda: t.checksum("checksum (baseline)"), "baseline"),
            ("reset", lambda: t.reset("reset"), None),
            ("checksum (post-reset)", lambda: t.checksum("checksum (post-reset)"), "post_reset"),
            ("transfer", lambda: call_transfer(transfer), None),
        ]
    steps.append(("checksum (current)", lambda: t.checksum("checksum (current)"), "current"))
    return steps


def _call_transfer(transfer: Callable[[], Any] | None) -> Any:
    try:
        value = transfer()  # type: ignore[misc]
        if inspect.isawaitable(value):
            value = asyncio.run(_await(value))
    except (KeyboardInterrupt, VerifyError):
        raise
    except Exception as e:
        raise VerifyError("transfer", None, f"the transfer failed: {type(e).__name__}: {e}") from e
    return value


async def _call_transfer_async(transfer: Callable[[], Any] | None) -> Any:
    try:
        value = transfer()  # type: ignore[misc]
        if inspect.isawaitable(value):
            value = await value
    except (KeyboardInterrupt, VerifyError):
        raise
    except Exception as e:
        raise VerifyError("transfer", None, f"the transfer failed: {type(e).__name__}: {e}") from e
    return value


async def _await(value: Awaitable[Any]) -> Any:
    return await value


def _note_resume(run: _Run, failures: list[str], seconds: float, attempted: bool) -> None:
    if not attempted:
        return
    run.result.steps.append(Step("resume", seconds, not failures, "; ".join(failures)))
    if failures:
        run.result.warnings.extend(f"could not resume: {f}" for f in failures)


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
    error.weight_checker_result = run.result  # type: ignore[union-attr]
    raise error


# --- replicas ---------------------------------------------------------------------


@dataclass
class ReplicaResult:
    """Replica consistency: every key group whose replicas disagree."""

    consistent: bool
    replicas: list[str]
    groups: int
    #: group key (``pp..:pcp..:tp..:name``) -> replica -> digest, for groups
    #: with more than one distinct digest.
    inconsistent: dict[str, dict[str, str]]

    def to_json(self) -> dict[str, Any]:
        return {
            "consistent": self.consistent,
            "replicas": self.replicas,
            "groups": self.groups,
            "inconsistent": self.inconsistent,
        }


def replicas(target: Any, *, timeout: float | None = None, api_key: str | None = None) -> ReplicaResult:
    """One checksum of every replica (no pause, no reset), keys grouped by
    everything but the replica: the ``dp`` rank inside one server, and the
    server itself when several are given."""
    t = target_for(target, api_key=api_key, timeout=timeout)
    if isinstance(t, AsyncLLMTarget):
        raise TypeError("replicas() of an AsyncLLM: run it in process with an LLM or over HTTP")
    if isinstance(t, HttpTarget):
        per_source = list(zip(t.urls, t.checksums_by_server("checksum"), strict=True))
    else:
        per_source = [(t.name, t.checksum("checksum"))]
    several = len(per_source) > 1
    groups: dict[str, dict[str, str]] = {}
    names: list[str] = []
    for source, sums in per_source:
        for key, digest in sums.items():
            dp, rest = split_key(key)
            replica = f"{source} {dp}" if several else dp
            groups.setdefault(rest, {})[replica] = digest
            if replica not in names:
                names.append(replica)
    inconsistent = {g: dict(sorted(r.items())) for g, r in sorted(groups.items()) if len(set(r.values())) > 1}
    # A group that some replica lacks is inconsistent too: that replica holds nothing.
    for g, r in groups.items():
        if len(r) < len(names) and g not in inconsistent:
            inconsistent[g] = dict(sorted({**dict.fromkeys(names, "(missing)"), **r}.items()))
    return ReplicaResult(not inconsistent, sorted(names), len(groups), dict(sorted(inconsistent.items())))
