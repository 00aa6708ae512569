"""The verified client: :class:`VerifiedClient` checks every update at its finish; :class:`UpdateCheck`: a verdict."""

from __future__ import annotations

import inspect
import logging
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weight_checker.errors import InputError, InputTypeError, VerifyError
from weight_checker.expected.manifest import ExpectedDigests, load_expected
from weight_checker.integrations.weight_transfer_engines import Engine, engine_for
from weight_checker.scope import DEFAULT, parse_include
from weight_checker.verify.compare import compare
from weight_checker.verify.engine_digests import EngineDigests, decide_layout, display_key
from weight_checker.verify.explain import DEFAULT_LIMIT, explain_engines, source_for, versions_from
from weight_checker.verify.fanout import no_digests
from weight_checker.verify.results import VerifyResult
from weight_checker.verify.workflow import Checked, check_digest_map, scope_for

logger = logging.getLogger("weight_checker.weight_transfer")


@dataclass
class UpdateCheck(VerifyResult):
    """One update's verdict (a :class:`~weight_checker.VerifyResult`), with
    the weight version it was finished with and where its digests came from:
    ``"finish"`` (the finish answer: hashed as the update committed) or
    ``"checksum"`` (one checksum after it), per engine."""

    weight_version: str | None = None
    digests_from: dict[str, str] = field(default_factory=dict)
    #: Seconds: ``update`` (start to finish, the transfer included),
    #: ``digests`` (the finish with digests, or the checksum), ``compare``.
    seconds: dict[str, float] = field(default_factory=dict)


class VerifiedClient:
    """A ``VLLMWeightSyncClient`` that verifies every update at its finish
    (see :func:`verified`). ``results``: one :class:`UpdateCheck` per update."""

    def __init__(
        self,
        clients: list[Any],
        expected: Any,
        *,
        on_mismatch: str = "raise",
        include: Any = None,
        checksum_from: Any = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        log: logging.Logger | None = None,
        weight_version: Callable[[], str | None] | None = None,
        explain: bool | int = True,
        keep_versions: int = 2,
    ):
        if isinstance(explain, bool):
            explain = DEFAULT_LIMIT if explain else 0
        if not isinstance(explain, int) or explain < 0:
            raise InputTypeError(f"explain must be a bool or a number of keys >= 0, got {explain!r:.80}")
        if isinstance(keep_versions, bool) or not isinstance(keep_versions, int) or keep_versions < 0:
            raise InputTypeError(f"keep_versions must be a number of versions >= 0, got {keep_versions!r:.80}")
        #: How many mismatched keys an update's explanation covers (0: none).
        self.explain = explain
        #: The expected digests of the last ``keep_versions`` updates, newest
        #: first, as ``(label, digests)``: causes like ``version:step-11``.
        self.history: list[tuple[str, Any]] = []
        self.keep_versions = keep_versions
        if on_mismatch not in ("raise", "warn"):
            raise InputError(f"on_mismatch must be 'raise' or 'warn', got {on_mismatch!r}")
        if weight_version is not None and not callable(weight_version):
            raise InputTypeError(
                f"weight_version must be a callable returning the next update's version, got {weight_version!r:.80}"
            )
        self.next_version = weight_version
        self.expected = _expected_source(expected)
        self.include = parse_include(include) if include is not None else None
        if self.include is None and self.expected.static is not None:
            # Expected digests known now: the finish hashes every scope they
            # hold keys of (a draft, adapters, buffers), as verify() does.
            scope = scope_for(None, self.expected.static)
            self.include = scope if scope != DEFAULT else None
        self.engines = [engine_for(c, self.include, checksum_from, api_key, timeout) for c in clients]
        names = [e.name for e in self.engines]
        for i, engine in enumerate(self.engines):  # names must tell the engines apart
            if names.count(engine.name) > 1:
                engine.name = f"{engine.name} #{i}"
        self.on_mismatch = on_mismatch
        self.log = log or logger
        #: One verdict per update, in order.
        self.results: list[UpdateCheck] = []
        self._before: dict[str, dict[str, str]] | None = None
        self._started = 0.0
        self._clients = clients

    def __getattr__(self, name: str) -> Any:
        # Anything else of the client (shutdown_weight_transfer_engine,
        # start_draft_weight_update...): a method is called on every client
        # of a fleet at once (the first one's answer returned), an attribute
        # is the first one's.
        if name.startswith("__") or "_clients" not in self.__dict__:
            raise AttributeError(name)
        first = getattr(self._clients[0], name)
        if not callable(first) or len(self._clients) == 1:
            return first

        def on_every_client(*args: Any, **kwargs: Any) -> Any:
            with ThreadPoolExecutor(len(self._clients)) as pool:
                futures = [pool.submit(getattr(c, name), *args, **kwargs) for c in self._clients]
                answers = [f.result() for f in futures]
            return answers[0]

        return on_every_client

    def _each(self, fn: Callable[[Engine], Any]) -> dict[str, Any]:
        """``fn`` on every engine at once (each may block in a collective until all have joined)."""
        if len(self.engines) == 1:
            return {self.engines[0].name: fn(self.engines[0])}
        with ThreadPoolExecutor(len(self.engines)) as pool:
            futures = {e.name: pool.submit(fn, e) for e in self.engines}
            return {name: f.result() for name, f in futures.items()}

    # The protocol (vllm.distributed.weight_transfer.base.VLLMWeightSyncClient).

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each(lambda e: e.init(init_info))

    def start_weight_update(self) -> None:
        if self._before is None:
            # What the engines hold before the first update: what "stale" is told by.
            self._before = self._each(lambda e: e.checksum())
        self._started = time.perf_counter()
        self._each(lambda e: e.start())

    def update_weights(self, update_info: Any) -> None:
        self._each(lambda e: e.update(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None and self.next_version is not None:
            # vLLM's trainer engines finish without a version: the one the
            # caller's callable names is what the engines are finished with.
            weight_version = self.next_version()
        transferred = time.perf_counter()
        at_finish = self._each(lambda e: e.finish(weight_version))
        # This update's expected digests, now that the transfer is done; a
        # scope they need that the finish did not hash is taken by checksum.
        expected = self.expected(weight_version)
        needed = self.include
        if needed is None:
            scope = scope_for(None, expected)
            needed = scope if scope != DEFAULT else None
        after: dict[str, dict[str, str]] = {}
        check = UpdateCheck(servers=[e.name for e in self.engines], weight_version=weight_version)
        for engine in self.engines:
            digests = at_finish[engine.name]
            if digests is not None and needed != self.include:
                check.warnings.append(
                    f"{engine.name}: the expected digests cover {', '.join(needed or DEFAULT)}, not what the finish "
                    "hashed: one checksum of that scope was taken after it (pass include= to hash it at the finish)"
                )
                digests = None
            elif digests is None and engine.finish_note:
                check.warnings.append(f"{engine.name}: {engine.finish_note}: one checksum was taken after it")
            check.digests_from[engine.name] = "finish" if digests is not None else "checksum"
            if digests is None:
                digests = engine.checksum(needed)
            if not digests:  # an engine that proves nothing never passes
                raise VerifyError("finish", engine.name, no_digests(needed))
            after[engine.name] = digests
        hashed = time.perf_counter()
        self._verdict(check, after, weight_version, expected)
        if check.mismatches and self.explain:
            self._explain(check, after, expected)
        if self.keep_versions:
            label = weight_version or f"update-{len(self.results) + 1}"
            self.history = [(label, expected), *self.history][: self.keep_versions]
        check.seconds = check.seconds | {
            "update": transferred - self._started,
            "digests": hashed - transferred,
            "compare": time.perf_counter() - hashed,
        }
        self._before = after
        self.results.append(check)
        self._report(check)

    def _verdict(
        self, check: UpdateCheck, after: dict[str, dict[str, str]], weight_version: str | None, expected: Any
    ) -> None:
        if weight_version is not None and getattr(expected, "weight_version", None) is None:
            # The version this update was finished with is the one its weights must be held under.
            expected = ExpectedDigests(
                expected,
                weight_version=weight_version,
                vllm_version=getattr(expected, "vllm_version", ""),
                layout=dict(getattr(expected, "layout", {})),
                unwritten=list(getattr(expected, "unwritten", [])),
                warnings=list(getattr(expected, "warnings", [])),
            )
        layout = decide_layout(after, None)
        versions = self._each(lambda e: e.weight_version())
        values = {
            "expected": expected,
            "before": Checked(EngineDigests(self._before or {}, layout), {}),
            "current": Checked(EngineDigests(after, layout), versions),
        }
        check.warnings += list(getattr(expected, "warnings", ()))
        compare(check, values)

    def _explain(self, check: UpdateCheck, after: dict[str, dict[str, str]], expected: Any) -> None:
        """Why this update's check failed (``check.explanation``): where in
        each of the first mismatched tensors, and the likely cause, from
        block digests each engine gives and the expected tensors recomputed
        for those keys. Never raises: a failure to explain is a warning."""
        started = time.perf_counter()
        try:
            fleet = decide_layout(after, None) == "fleet"
            mismatches = (
                dict(check.by_engine)
                if fleet
                else {e: {k: c for k, c in check.mismatches.items() if k in held} for e, held in after.items()}
            )
            fetchers = {e.name: e.block_fetcher() for e in self.engines}
            check.explanation = explain_engines(
                after, mismatches, expected, fetchers, source_for(expected),
                history=versions_from(self.history), limit=self.explain,
                show=display_key if fleet else (lambda engine, key: key),
            )  # fmt: skip
            check.class_by_explanation()
        except Exception as e:  # whatever fails, the verdict stands and is reported
            check.warnings.append(f"the mismatch could not be explained: {type(e).__name__}: {e}")
        check.seconds["explain"] = time.perf_counter() - started

    def _report(self, check: UpdateCheck) -> None:
        version = f" {check.weight_version!r}" if check.weight_version is not None else ""
        sources = sorted(set(check.digests_from.values()))
        if check.match:
            self.log.info(
                "weight update%s verified: %d keys (digests from the %s, %.3f s)",
                version, check.key_count, " and ".join(sources), check.seconds["digests"],
            )  # fmt: skip
            return
        error = check.mismatch_error()
        message = f"weight update{version}: {error}"
        if self.on_mismatch == "raise":
            raise error
        self.log.warning(message)
        warnings.warn(message, stacklevel=3)


class _ExpectedSource:
    """This update's expected digests, from what the caller gave."""

    def __init__(self, get: Callable[[str | None], Mapping[str, str]], static: Mapping[str, str] | None = None):
        self._get = get
        #: The digests where they are the same for every update (a manifest, a mapping).
        self.static = static

    def __call__(self, weight_version: str | None) -> Mapping[str, str]:
        digests = check_digest_map(self._get(weight_version), "the expected digests")
        if digests is None:
            raise InputError("the expected digests callable returned None")
        return digests


def _expected_source(expected: Any) -> _ExpectedSource:
    if isinstance(expected, (str, Path)):
        manifest = load_expected(str(expected))
        return _ExpectedSource(lambda version: manifest, manifest)
    if isinstance(expected, Mapping):
        return _ExpectedSource(lambda version: expected, expected)
    if callable(expected):
        takes_version = bool(inspect.signature(expected).parameters)
        return _ExpectedSource(lambda version: expected(version) if takes_version else expected())
    raise InputTypeError(
        "expected must be a manifest path, a mapping key -> sha256 hex, or a callable returning one "
        f"(given the weight version), got {type(expected).__name__}"
    )
