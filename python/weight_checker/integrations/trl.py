"""Every weight sync of TRL's GRPO trainer verified, in one line:

    from weight_checker.integrations.trl import verify_every_sync

    trainer = GRPOTrainer(...)
    verify_every_sync(trainer, every=1, on_mismatch="raise")
    trainer.train()

TRL (colocate mode) pushes the policy's weights into its in-process vLLM
engine in ``trainer.vllm_generation.sync_weights()``, before each generation
whose optimizer step moved. This wraps that method (on this trainer only):

1. the sync runs as the transfer of :func:`weight_checker.verify`: the
   engine is checksummed before and after it (no reset: the engine never
   serves zeros);
2. the tensors the sync walks (``_iter_named_params``: the same names,
   dtypes, merged adapters and gathering) also feed the expected digests,
   computed through vLLM's own loader while the sync runs
   (:func:`weight_checker.expected_digests`): one walk, no copy, no second
   gather; the engine's digests are compared with them. A failure there is
   not the engine's: the sync still runs, and it is logged (``"warn"``) or
   raised once the sync has run (``"raise"``);
3. the verdict is logged (``verified step 3: 15/15 keys``, or the classes
   and the first keys) and added to the trainer's metrics
   (``weight_check/mismatches``, ``weight_check/seconds``);
   ``on_mismatch="raise"`` stops training with
   :class:`~weight_checker.WeightMismatchError`, ``"warn"`` logs it.

A sync that is not due (``every``) costs one counter; the TRL version and
mode are checked once, at setup: anything this module does not know is one
clear :class:`TrlIntegrationError` there, never a traceback at step 1.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from weight_checker.errors import WeightCheckerError

logger = logging.getLogger("weight_checker.trl")

#: TRL versions (major.minor) whose weight sync this module was written and tested against.
SUPPORTED = ("1.16",)
#: What the integration uses of TRL: ``(object path, attribute)``.
REQUIRED = (
    ("trainer", "vllm_generation"),
    ("trainer", "state"),
    ("trainer", "_metrics"),
    ("trainer.vllm_generation", "sync_weights"),
    ("trainer.vllm_generation", "_iter_named_params"),
    ("trainer.vllm_generation", "llm"),
    ("trainer.vllm_generation", "mode"),
)


class TrlIntegrationError(WeightCheckerError):
    """The trainer is not one this integration can check: another TRL version,
    another mode, or internals it does not find. Raised at setup."""


@dataclass
class StepCheck:
    """What one verified sync found."""

    step: int
    match: bool
    keys: int
    mismatches: dict[str, str]
    seconds: float
    #: Computing the expected digests, from the tensors the sync walked, while
    #: it ran (so it overlaps ``sync_seconds``).
    expected_seconds: float
    #: The sync's own time (TRL's ``sync_weights``), measured inside the check.
    sync_seconds: float
    #: Why a failed check failed, where it could be told: where in each of
    #: the first mismatched tensors, and the likely cause
    #: (:class:`weight_checker.verify.explain.Explanation`).
    explanation: Any = None


@dataclass
class SyncVerifier:
    """The hook :func:`verify_every_sync` installed: its results, and ``remove()``."""

    trainer: Any
    every: int
    on_mismatch: str
    original: Callable[..., Any]
    results: list[StepCheck] = field(default_factory=list)
    syncs: int = 0
    #: Syncs that ran but could not be verified (the expected digests failed).
    unverified: int = 0
    #: The expected digests of the last ``keep_versions`` verified syncs,
    #: newest first, as ``("step-N", digests)``: causes like ``version:step-11``.
    history: list[tuple[str, Any]] = field(default_factory=list)
    keep_versions: int = 2

    def remove(self) -> None:
        """Restores TRL's own ``sync_weights`` on this trainer."""
        vg = self.trainer.vllm_generation
        if vg.__dict__.get("sync_weights") is not None:
            del vg.__dict__["sync_weights"]


def _check_trainer(trainer: Any) -> None:
    try:
        import trl
    except ImportError as e:
        raise TrlIntegrationError("TRL is not installed (pip install trl)") from e
    version = str(getattr(trl, "__version__", "unknown"))
    if not version.startswith(tuple(f"{v}." for v in SUPPORTED)) and version not in SUPPORTED:
        raise TrlIntegrationError(
            f"TRL {version} is not one this integration knows (tested: {', '.join(SUPPORTED)}): its weight sync "
            "may differ, so nothing was hooked; verify with weight_checker.verify(...) around your own sync"
        )
    args = getattr(trainer, "args", None)
    if not getattr(args, "use_vllm", False):
        raise TrlIntegrationError(
            "the trainer does not generate with vLLM (use_vllm=False): there is no sync to verify"
        )
    mode = getattr(args, "vllm_mode", None)
    if mode != "colocate":
        raise TrlIntegrationError(
            f"vllm_mode={mode!r}: only 'colocate' (an in-process engine) is checked here; in 'server' mode TRL "
            "pushes weights to a vLLM server over NCCL: verify that server with `weight-checker verify --url ...` "
            "or weight_checker.verify(url, ...) around the push"
        )
    for owner, attr in REQUIRED:
        obj: Any = trainer
        for part in owner.split(".")[1:]:
            obj = getattr(obj, part, None)
        if obj is None or not hasattr(obj, attr):
            raise TrlIntegrationError(f"TRL {version}: {owner}.{attr} not found; nothing was hooked")
    vg = trainer.vllm_generation
    tp = getattr(vg, "tensor_parallel_size", 1)
    if tp != 1:
        raise TrlIntegrationError(
            f"vllm_tensor_parallel_size={tp}: each process holds one shard of a colocated engine; only 1 is checked"
        )
    if getattr(vg, "enable_sleep_mode", False):
        raise TrlIntegrationError(
            "vllm_enable_sleep_mode=True: the engine's weights are released between generations, so there is "
            "nothing to checksum before a sync; turn sleep mode off to verify"
        )
    if hasattr(getattr(trainer, "model", None), "peft_config"):
        raise TrlIntegrationError(
            "a PEFT model: TRL merges the adapters into the weights it sends, and computing the expected digests "
            "would merge and unmerge them a second time each step; not supported yet"
        )
    try:
        model_config = vg.llm.llm_engine.vllm_config.model_config
    except AttributeError as e:
        raise TrlIntegrationError(f"the colocated engine's configuration is not where TRL 1.16 keeps it ({e})") from e
    if model_config.quantization is not None or getattr(model_config, "model_impl", "auto") not in ("auto", "vllm"):
        raise TrlIntegrationError(
            f"the engine runs quantization={model_config.quantization!r}, model_impl="
            f"{getattr(model_config, 'model_impl', None)!r}: expected digests are computed for vLLM's own "
            "unquantized model classes only"
        )


def _engine_model(llm: Any) -> dict[str, Any]:
    """The engine arguments ``expected_digests`` needs to build the engine's model."""
    model_config = llm.llm_engine.vllm_config.model_config
    return {
        "model": model_config.model,
        "revision": model_config.revision,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "max_model_len": model_config.max_model_len,
        "trust_remote_code": model_config.trust_remote_code,
        **({"hf_overrides": model_config.hf_overrides} if getattr(model_config, "hf_overrides", None) else {}),
    }


def verify_every_sync(
    trainer: Any, every: int = 1, on_mismatch: str = "raise", *, log: logging.Logger | None = None
) -> SyncVerifier:
    """Verifies the engine after every ``every``-th weight sync of ``trainer``
    (TRL's ``GRPOTrainer``, vLLM in colocate mode). ``on_mismatch``:
    ``"raise"`` (:class:`~weight_checker.WeightMismatchError` stops training)
    or ``"warn"``. Returns the hook (``.results``, ``.remove()``). Raises
    :class:`TrlIntegrationError` at once for a trainer it cannot check."""
    if on_mismatch not in ("raise", "warn"):
        raise TrlIntegrationError(f"on_mismatch must be 'raise' or 'warn', got {on_mismatch!r}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise TrlIntegrationError(f"every must be a positive integer, got {every!r}")
    _check_trainer(trainer)
    vg = trainer.vllm_generation
    hook = SyncVerifier(trainer, every, on_mismatch, vg.sync_weights)
    out = log or logger

    def sync_weights(*args: Any, **kwargs: Any) -> Any:
        hook.syncs += 1
        if (hook.syncs - 1) % every:
            return hook.original(*args, **kwargs)
        return _verified_sync(hook, out, args, kwargs)

    vg.sync_weights = sync_weights
    return hook


class _Tee:
    """TRL's tensors, walked once per sync: each pair ``_iter_named_params``
    yields to the sync is handed to :func:`weight_checker.expected_digests`
    too, reading in a thread of its own, and the sync moves on only once that
    reader has asked for the next pair (is done with this one: a parameter
    gathered under ZeRO-3 is released once the sync moves on). No copy, no
    second gather. Should the reader fail, the sync goes on alone."""

    _END = object()

    def __init__(self, vg: Any, compute: Callable[[Any], Any]):
        self._vg = vg
        self._original = vg._iter_named_params
        self._compute = compute
        self._pairs: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._asked = threading.Semaphore(0)
        self._done = threading.Event()
        self._fed = False
        self._outcome: list[tuple[bool, Any]] = []
        self._thread = threading.Thread(target=self._read, name="weight-checker-expected", daemon=True)

    def __enter__(self) -> _Tee:
        self._thread.start()
        self._vg._iter_named_params = self._iter_named_params
        return self

    def __exit__(self, *exc: object) -> None:
        self._vg.__dict__.pop("_iter_named_params", None)
        self._hand(self._END)  # the sync ran (or failed): the reader ends
        self._thread.join()

    def _read(self) -> None:
        try:
            self._outcome.append((True, self._compute(self._reader_pairs())))
        except BaseException as e:
            self._outcome.append((False, e))
        finally:
            self._done.set()

    def _reader_pairs(self) -> Iterator[tuple[str, Any]]:
        while True:
            item = self._pairs.get()
            if item is self._END:
                return
            yield item
            self._asked.release()  # back for the next pair: done with this one

    def _hand(self, item: Any) -> bool:
        """Gives ``item`` to the reader; ``False`` once the reader is gone."""
        while not self._done.is_set():
            try:
                self._pairs.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _wait_for_reader(self) -> None:
        while not self._done.is_set() and not self._asked.acquire(timeout=0.05):
            pass

    def _iter_named_params(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        feeding = not self._fed  # one walk per sync feeds the expected digests
        self._fed = True
        for name, tensor in self._original(*args, **kwargs):
            handed = feeding and self._hand((name, tensor))
            yield name, tensor
            if handed:
                self._wait_for_reader()

    def expected(self) -> Any:
        """The expected digests, or the reader's error."""
        ok, value = self._outcome[0]
        if not ok:
            raise value
        return value


def _verified_sync(hook: SyncVerifier, log: logging.Logger, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One sync, verified: the engine checksummed before and after it, and
    compared with the expected digests of the tensors it sent. A failure to
    compute those digests (not the engine's) never stops the sync: with
    ``on_mismatch="warn"`` it is logged and the sync stays unverified; with
    ``"raise"`` it is raised once the sync has run."""
    import weight_checker

    trainer = hook.trainer
    vg = trainer.vllm_generation
    step = int(trainer.state.global_step)
    started = time.perf_counter()
    engine = _engine_model(vg.llm)
    synced: list[Any] = []
    timing: dict[str, float] = {}

    def compute(pairs: Any) -> Any:
        begun = time.perf_counter()
        try:
            return weight_checker.expected_digests(engine, pairs)
        finally:
            timing["expected"] = time.perf_counter() - begun

    def sync() -> None:
        begun = time.perf_counter()
        synced.append(hook.original(*args, **kwargs))
        timing["sync"] = time.perf_counter() - begun

    tee = _Tee(vg, compute)

    def transfer() -> None:
        with tee:
            sync()

    held: list[Any] = []

    def expected() -> Any:
        held.append(tee.expected())
        return held[-1]

    try:
        result = weight_checker.verify(vg.llm, transfer=transfer, expected=expected, history=hook.history)
    except weight_checker.VerifyError as e:
        if e.step == "transfer" and e.__cause__ is not None:
            # TRL's own failure, raised as TRL raised it (its own cause kept).
            raise e.__cause__  # noqa: B904
        if e.step != "expected digests" or not synced:
            raise
        # The sync ran; what failed is computing what it should have left.
        hook.unverified += 1
        log.warning("step %d: synced, NOT verified: %s", step, e)
        if hook.on_mismatch == "raise":
            raise
        return synced[0]
    seconds = time.perf_counter() - started
    check = StepCheck(
        step,
        result.match,
        result.key_count,
        dict(result.mismatches),
        seconds,
        timing.get("expected", 0.0),
        timing.get("sync", 0.0),
        result.explanation,
    )
    hook.results.append(check)
    if held and hook.keep_versions:
        hook.history = [(f"step-{step}", held[-1]), *hook.history][: hook.keep_versions]
    metrics = trainer._metrics["train" if getattr(trainer.model, "training", True) else "eval"]
    metrics["weight_check/mismatches"].append(float(len(result.mismatches)))
    metrics["weight_check/seconds"].append(seconds - check.sync_seconds)
    if result.match:
        log.info("verified step %d: %d/%d keys (%.3f s)", step, result.key_count, result.key_count, seconds)
    else:
        error = result.mismatch_error()
        log.warning("step %d: %s", step, error)
        if hook.on_mismatch == "raise":
            raise error
    return synced[0]
