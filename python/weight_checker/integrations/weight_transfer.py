"""Every update through vLLM's weight-transfer API, verified: a wrapper around
vLLM's trainer-side sync clients.

vLLM ≥ 0.32's trainer engines (``TrainerWeightTransferEngine``: NCCL, IPC, and
the ones TRL's server mode, SkyRL or open-instruct build on it) drive an
inference server through a ``VLLMWeightSyncClient``: ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights`` and ``finish_weight_update``.
:func:`verified` wraps one (or a fleet of them) and checks every update as it
finishes::

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from weight_checker.integrations.weight_transfer import verified

    client = verified(HTTPVLLMWeightSyncClient(url), expected=lambda version: expected_for(version))
    engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)
    engine.send_weights()            # raises WeightMismatchError if the engine does not hold the update
    client.results[-1]               # the verdict, its weight version, where the digests came from, timings

At ``finish_weight_update(weight_version)`` it takes the engines' digests of
the weights the update committed: from the finish answer itself where the
server serves this package's route (``"checksum": true`` is sent with the
update: the workers hash as they commit), else from one checksum, and says
which (``result.digests_from``). It compares them with the expected digests
(a manifest, a mapping, or a callable that returns this update's), classes
each mismatch (``stale``, ``wrong-shard``, ``changed``, ``missing``,
``unexpected``) against what the engines held before, ties the verdict to
the weight version each engine claims, and raises
:class:`~weight_checker.WeightMismatchError` or warns (``on_mismatch``).

What it wraps:

- vLLM's ``HTTPVLLMWeightSyncClient`` (or anything with a ``base_url``): the
  update and the finish are posted here, with the checksum flag;
- an in-process ``vllm.LLM``: the finish is the plugin's worker method, which
  finishes and hashes in one call (:func:`finish_weight_update`);
- any other client (vLLM's Ray client, your own): its own calls, then one
  checksum of ``checksum_from`` (URLs, engines or Ray actor handles: what
  :func:`weight_checker.verify` takes);
- a list of any of these: a fleet, each update sent to all at once.
"""

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

from weight_checker.errors import InputError, InputTypeError, VerifyError, WeightCheckerError
from weight_checker.scope import DEFAULT, parse_include
from weight_checker.verify.compare import compare
from weight_checker.verify.engine_digests import EngineDigests, decide_layout
from weight_checker.httpclient import api_key_from_env, post_json, request
from weight_checker.verify.results import VerifyResult

logger = logging.getLogger("weight_checker.weight_transfer")

__all__ = ["UpdateCheck", "VerifiedClient", "finish_weight_update", "finish_weight_update_async", "verified"]


# --- in process: digests as the update commits ------------------------------------------------------


def finish_weight_update(llm: Any, weight_version: str | None = None, include: Any = None) -> dict[str, str]:
    """``llm.finish_weight_update(weight_version)`` for an in-process
    ``vllm.LLM``, returning the digests of the weights it committed: each
    worker finishes the update and hashes what it holds in one call (this
    package's vLLM plugin), then the version is set as vLLM sets it.
    ``include``: the scope (default: what vLLM's own checksum covers)."""
    scope = parse_include(include) if include is not None else None
    answers = llm.collective_rpc("weight_checker_finish_weight_update", args=(list(scope) if scope else None,))
    if weight_version is not None:
        llm.llm_engine.set_weight_version(weight_version)
    return _merged(answers)


async def finish_weight_update_async(
    engine: Any, weight_version: str | None = None, include: Any = None
) -> dict[str, str]:
    """:func:`finish_weight_update` for an in-process ``vllm.AsyncLLM``: every
    worker of every engine (DP ranks included)."""
    from weight_checker.integrations.vllm.endpoint import _all_engines

    scope = parse_include(include) if include is not None else None
    answers = await _all_engines(engine, "weight_checker_finish_weight_update", (list(scope) if scope else None,))
    if weight_version is not None:
        await engine.update_weight_version(weight_version)
    return _merged(answers)


def _merged(answers: Any) -> dict[str, str]:
    from weight_checker.keys import merge_digests

    if isinstance(answers, list) and all(isinstance(a, dict) for a in answers):
        failed = [f"{a.get('rank', '?')}: {a['error']}" for a in answers if "error" in a]
        if failed:  # the update committed; its digests did not
            raise WeightCheckerError(f"the update committed but its digests failed: {'; '.join(failed)[:500]}")
    if not isinstance(answers, list) or not all(isinstance(a, dict) and "checksums" in a for a in answers):
        raise WeightCheckerError(f"unexpected answer from the workers' finish: {str(answers)[:200]}")
    return merge_digests(a["checksums"] for a in answers)


# --- the clients a wrapper can reach -------------------------------------------------------------


class _Engine:
    """One inference server or engine behind a client: how to reach it for
    what the wrapper adds (the update with the checksum flag, the finish
    with digests, a checksum, the weight version)."""

    name: str
    #: Whether the finish answers with the digests of what it committed.
    digests_at_finish = False
    #: Why the last finish gave no digests where it was asked for them.
    finish_note: str | None = None

    def __init__(self, client: Any, include: tuple[str, ...] | None):
        self.client = client
        self.include = include

    def init(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start(self) -> None:
        self.client.start_weight_update()

    def update(self, update_info: Any) -> None:
        self.client.update_weights(update_info)

    def finish(self, weight_version: str | None) -> dict[str, str] | None:
        """Finishes; the digests of what it committed, or ``None`` where
        this engine's finish does not give them."""
        self.client.finish_weight_update(weight_version)
        return None

    def checksum(self, include: tuple[str, ...] | None = None) -> dict[str, str]:
        """One checksum of ``include`` (default: the wrapper's scope)."""
        raise NotImplementedError

    def weight_version(self) -> str | None:
        return None

    def block_fetcher(self) -> Any:
        """How to ask this engine for block digests (``None``: it cannot be)."""
        return None


class _HttpEngine(_Engine):
    """A server, through vLLM's HTTP client: the update and the finish are
    posted here (with ``"checksum": true``), the rest is the client's."""

    def __init__(self, client: Any, include: tuple[str, ...] | None, api_key: str | None, timeout: float):
        super().__init__(client, include)
        self.url = str(client.base_url).rstrip("/")
        self.name = self.url
        self.api_key = api_key_from_env(api_key)
        self.timeout = float(getattr(client, "timeout", None) or timeout)
        self.digests_at_finish = True

    def block_fetcher(self) -> Any:
        from weight_checker.verify.explain import http_fetcher

        return http_fetcher(self.url, api_key=self.api_key, timeout=self.timeout)

    def update(self, update_info: Any) -> None:
        payload = _json_safe(update_info)
        body: dict[str, Any] = {"update_info": payload, "checksum": True}
        if self.include is not None:
            body["include"] = list(self.include)
        post_json(self.url, "/update_weights", body, timeout=self.timeout, api_key=self.api_key)

    def finish(self, weight_version: str | None) -> dict[str, str] | None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        answer = post_json(self.url, "/finish_weight_update", body, timeout=self.timeout, api_key=self.api_key)
        sums = answer.get("checksums") if isinstance(answer, dict) else None
        if isinstance(sums, dict) and all(isinstance(v, str) for v in sums.values()):
            self.finish_note = None
            return sums
        failed = answer.get("checksum_error") if isinstance(answer, dict) else None
        if failed:
            self.finish_note = f"the update committed but its digests at finish failed ({str(failed)[:300]})"
        else:  # vLLM's own route, or this package's without a session in this process
            self.finish_note = "the finish returned no digests (this package's endpoint plugin not loaded there?)"
        return None

    def checksum(self, include: tuple[str, ...] | None = None) -> dict[str, str]:
        include = include or self.include
        body: dict[str, Any] = {"action": "checksum"}
        if include is not None:
            body["include"] = list(include)
        answer = post_json(self.url, "/weight_checker", body, timeout=self.timeout, api_key=self.api_key)
        sums = dict(answer["checksums"])
        if not sums:  # an engine that proves nothing never passes, nor tells what is stale
            from weight_checker.verify.fanout import no_digests

            raise VerifyError("checksum", self.url, no_digests(include))
        return sums

    def weight_version(self) -> str | None:
        status, body = request("GET", self.url, "/weight_info", timeout=min(self.timeout, 30), api_key=self.api_key)
        version = body.get("weight_version") if status == 200 and isinstance(body, dict) else None
        return version if isinstance(version, str) else None


class _LLMEngine(_Engine):
    """An in-process ``vllm.LLM``: vLLM's own methods, and the finish that
    hashes as it commits (:func:`finish_weight_update`)."""

    def __init__(self, llm: Any, include: tuple[str, ...] | None):
        super().__init__(llm, include)
        self.name = f"in-process {type(llm).__name__}"
        self.digests_at_finish = True

    def block_fetcher(self) -> Any:
        from weight_checker.verify.explain import llm_fetcher

        return llm_fetcher(self.client)

    def init(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine({"init_info": init_info})

    def update(self, update_info: Any) -> None:
        try:  # each worker hashes every layer as it commits (the finish takes those digests)
            self.client.collective_rpc("weight_checker_begin_update_digests")
        except Exception as e:  # only the overlap is lost: the finish hashes everything
            logger.debug("weight_checker: no early digests on %s (%s)", self.name, e)
        self.client.update_weights({"update_info": update_info})

    def finish(self, weight_version: str | None) -> dict[str, str] | None:
        try:
            digests = finish_weight_update(self.client, weight_version, self.include)
        except WeightCheckerError as e:  # committed (and versioned), its digests failed
            self.finish_note = f"the update committed but its digests at finish failed ({e})"
            return None
        self.finish_note = None
        return digests

    def checksum(self, include: tuple[str, ...] | None = None) -> dict[str, str]:
        from weight_checker.verify.targets import target_for

        # One engine: its digests, whatever name the wrapper gave it (a
        # fleet's engines are numbered).
        per_engine = target_for(self.client, include=include or self.include or DEFAULT).per_engine("checksum")
        return next(iter(per_engine.values()))

    def weight_version(self) -> str | None:
        version = self.client.get_weight_version()
        return version if isinstance(version, str) else None


class _OtherEngine(_Engine):
    """Any other client: its own calls; digests from one checksum of
    ``checksum_from``."""

    def __init__(self, client: Any, include: tuple[str, ...] | None, checksum_from: Any, name: str):
        super().__init__(client, include)
        self.checksum_from = checksum_from
        self.name = name

    def checksum(self, include: tuple[str, ...] | None = None) -> dict[str, str]:
        from weight_checker.keys import merge_digests
        from weight_checker.verify.targets import target_for

        scope = include or self.include or DEFAULT
        per_engine = target_for(self.checksum_from, include=scope).per_engine("checksum")
        return merge_digests(per_engine.values(), per_engine)

    def block_fetcher(self) -> Any:
        from weight_checker.verify.explain import http_fetcher, llm_fetcher

        source = self.checksum_from
        if isinstance(source, str):
            return http_fetcher(source)
        if callable(getattr(source, "collective_rpc", None)):
            return llm_fetcher(source)
        return None  # several engines behind one client: which holds a key is not known here


def _json_safe(update_info: Any) -> Any:
    """The payload as vLLM's HTTP client sends it (IPC handles pickled)."""
    try:
        from vllm.distributed.weight_transfer.clients import _json_safe_update_payload
    except ImportError:
        return update_info
    return _json_safe_update_payload(update_info)


def _engine_for(
    client: Any, include: tuple[str, ...] | None, checksum_from: Any, api_key: Any, timeout: float
) -> _Engine:
    if hasattr(client, "base_url"):
        return _HttpEngine(client, include, api_key, timeout)
    if callable(getattr(client, "collective_rpc", None)) and hasattr(client, "llm_engine"):
        return _LLMEngine(client, include)
    missing = [m for m in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                           "finish_weight_update") if not callable(getattr(client, m, None))]  # fmt: skip
    if missing:
        raise InputTypeError(f"{type(client).__name__} is not a VLLMWeightSyncClient: it has no {', '.join(missing)}")
    if checksum_from is None:
        raise InputError(
            f"{type(client).__name__}: cannot tell where to take the engines' digests: pass checksum_from= "
            "(the servers' URLs, the engines, or their Ray actor handles)"
        )
    handles = getattr(client, "handles", None) or getattr(client, "_handles", None)
    return _OtherEngine(client, include, checksum_from, f"{type(client).__name__}" + (" (ray)" if handles else ""))


# --- the wrapper --------------------------------------------------------------------------------------


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
        from weight_checker.verify.explain import DEFAULT_LIMIT

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
            from weight_checker.verify.workflow import scope_for

            scope = scope_for(None, self.expected.static)
            self.include = scope if scope != DEFAULT else None
        self.engines = [_engine_for(c, self.include, checksum_from, api_key, timeout) for c in clients]
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

    def _each(self, fn: Callable[[_Engine], Any]) -> dict[str, Any]:
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
            from weight_checker.verify.workflow import scope_for

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
                from weight_checker.verify.fanout import no_digests

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
        from weight_checker.verify.workflow import Checked

        if weight_version is not None and getattr(expected, "weight_version", None) is None:
            # The version this update was finished with is the one its weights must be held under.
            from weight_checker.expected.manifest import ExpectedDigests

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
            from weight_checker.verify.engine_digests import decide_layout, display_key
            from weight_checker.verify.explain import explain_engines, source_for, versions_from

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
        from weight_checker.verify.workflow import _check_digest_map

        digests = _check_digest_map(self._get(weight_version), "the expected digests")
        if digests is None:
            raise InputError("the expected digests callable returned None")
        return digests


def _expected_source(expected: Any) -> _ExpectedSource:
    if isinstance(expected, (str, Path)):
        from weight_checker.cli.files import load_expected

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


def verified(
    client: Any,
    expected: Any,
    *,
    on_mismatch: str = "raise",
    include: Any = None,
    checksum_from: Any = None,
    api_key: str | None = None,
    timeout: float = 600.0,
    weight_version: Callable[[], str | None] | None = None,
    explain: bool | int = True,
    keep_versions: int = 2,
) -> VerifiedClient:
    """``client`` (a ``VLLMWeightSyncClient``, an in-process ``vllm.LLM``, or
    a list of them: a fleet) wrapped so that every update is verified at its
    finish against ``expected`` (a manifest path, a ``{key: hex}`` mapping, or
    a callable returning this update's, given the weight version if it takes
    an argument). Usable wherever the client is: ``client=`` of
    ``TrainerWeightTransferEngine.trainer_init``. ``on_mismatch``: ``"raise"``
    (:class:`~weight_checker.WeightMismatchError` from
    ``finish_weight_update``) or ``"warn"``; ``include``: the checksum's scope
    (default: every scope a manifest or mapping ``expected`` holds keys of,
    else what vLLM's own checksum covers; a callable's digests that hold more
    are checked by one checksum after the finish); ``checksum_from``: where to
    take the digests of a client that is neither vLLM's HTTP client nor an
    engine (URLs, engines, Ray actor handles); ``weight_version``: a callable
    giving the version to finish each update with where the caller finishes
    without one (vLLM's trainer engines call ``finish_weight_update()`` with
    no argument): the engines are finished with it, ``expected`` is given it
    and the verdict is tied to it. ``explain``: on a mismatch, explain the
    first 64 mismatched keys (an int: that many; ``False``: none): where in
    each tensor and the likely cause, in ``.results[-1].explanation`` and on
    the raised error; ``keep_versions``: how many previous updates' expected
    digests are kept for causes like ``version:step-11`` (default 2)."""
    clients = list(client) if isinstance(client, (list, tuple)) else [client]
    if not clients:
        raise InputError("no client given")
    return VerifiedClient(
        clients, expected, on_mismatch=on_mismatch, include=include, checksum_from=checksum_from,
        api_key=api_key, timeout=timeout, weight_version=weight_version, explain=explain,
        keep_versions=keep_versions,
    )  # fmt: skip
