"""Every exception the package raises in Python, in one place.

Each derives from :class:`WeightCheckerError` and, where it refines one, from
the built-in type a caller would expect (``ValueError`` for a bad value,
``TypeError`` for a bad type), so ``except ValueError`` and
``except weight_checker.WeightCheckerError`` both work. The compiled core's
``SafetensorsError`` and ``DeviceTensorError`` are defined in Rust and derive
from ``ValueError`` only; the public functions that can meet them
(:func:`weight_checker.checkpoint.checksum_checkpoint`) raise
:class:`CheckpointError` with the core's error as the cause.

Every error raised while handling another keeps it as ``__cause__``:
``WEIGHT_CHECKER_DEBUG=1`` makes the CLI print the whole chain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from weight_checker.tally import class_counts


class WeightCheckerError(Exception):
    """Base class of the package's errors."""


class InputError(WeightCheckerError, ValueError):
    """A value the caller passed is not usable: a URL, a key prefix, a tensor
    name given twice, an unknown checksum scope. The message names it."""


class InputTypeError(WeightCheckerError, TypeError):
    """An argument of the wrong type: the message names it and what is expected."""


class SettingsError(WeightCheckerError, ValueError):
    """A ``WEIGHT_CHECKER_*`` environment variable holds a value it does not
    accept: names the variable, the value and the accepted values."""


class DuplicateKeysError(WeightCheckerError, ValueError):
    """Two sources (workers, servers) produced the same key."""

    def __init__(self, keys: list[str], source: object = None):
        where = f" (also from {source})" if source is not None else ""
        super().__init__(f"duplicate keys{where}: {keys[:5]}{' ...' if len(keys) > 5 else ''}")
        self.keys = keys
        self.source = source


class VerifyError(WeightCheckerError):
    """A step of the workflow failed (not a mismatch): names the step and the server."""

    def __init__(self, step: str, server: str | None, message: str):
        where = f" on {server}" if server else ""
        super().__init__(f"step '{step}'{where}: {message}")
        self.step = step
        self.server = server
        self.message = message
        #: The steps so far (a ``VerifyResult``), set by the runner.
        self.result: Any = None


class WeightMismatchError(WeightCheckerError):
    """The weights after the transfer differ from the reference (the baseline
    or the expected digests): counts per class and the first keys."""

    def __init__(
        self,
        mismatches: Mapping[str, str],
        reference: str = "the baseline",
        version_mismatches: Mapping[str, str] | None = None,
        explanation: Any = None,
        patterns: Sequence[str] = (),
        unseen: Sequence[str] = (),
    ):
        parts = []
        if unseen:
            names = sorted({str(k).split("unseen:", 1)[-1] for k in unseen})
            shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
            parts.append(
                f"{len(names)} weight tensor(s) are held outside the model's parameters, so no digest covers "
                f"them: {shown}"
            )
        if mismatches:
            first = ", ".join(sorted(mismatches)[:5])
            more = " ..." if len(mismatches) > 5 else ""
            parts.append(f"{len(mismatches)} keys differ from {reference} ({class_counts(mismatches)}): {first}{more}")
        parts += [f"{engine} {why}" for engine, why in (version_mismatches or {}).items()]
        parts += list(patterns)[:2]
        causes = explanation.causes() if explanation is not None else {}
        if causes:
            parts.append(f"likely causes of the first {len(causes)}: {class_counts(causes)}")
        super().__init__("; ".join(parts))
        self.mismatches = dict(mismatches)
        self.version_mismatches = dict(version_mismatches or {})
        #: Why it failed, where it could be told
        #: (:class:`weight_checker.verify.explain.Explanation`), else ``None``.
        self.explanation = explanation
        #: The patterns of the rank × layer map ("tp3 missed the update ...").
        self.patterns = list(patterns)
        #: ``unseen:`` keys: weights the engine holds where no digest reaches.
        self.unseen = list(unseen)


class UnverifiedWeightsError(WeightMismatchError):
    """Nothing the checksum covers differs, but the engine holds some weights
    outside its parameters (a quantization kernel's packed buffer), so the
    check proves nothing about them: never reported as a match (CLI exit 3).
    A :class:`WeightMismatchError`, so code that stops on a mismatch stops
    here too."""


class UsageError(WeightCheckerError):
    """Bad input to the CLI (a flag, a manifest file): one line on stderr, exit 2."""


class HttpError(WeightCheckerError):
    """A request that failed: connection, HTTP status or a non-JSON answer."""

    def __init__(self, url: str, message: str, status: int | None = None):
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status = status
        self.message = message

    @property
    def unauthorized(self) -> bool:
        return self.status in (401, 403)


class ExpectedDigestsError(WeightCheckerError, ValueError):
    """The expected digests cannot be computed exactly: names the tensor, the
    layer or the reason (an unknown architecture, a quantized model, a tensor
    the model does not have or whose shape disagrees, a truncated file)."""


class CheckpointError(WeightCheckerError, ValueError):
    """A checkpoint that cannot be read: bad path, bad index, bad file."""


class StagingError(WeightCheckerError, RuntimeError):
    """A device-to-host copy failed: names the tensor(s); the copy engine's own
    exception is its ``__cause__`` (re-raising that type with a new message
    would fail for exceptions whose constructor takes other arguments)."""
