"""The package's root exception, the verify workflow's and expected_digests'.

Every exception this package raises in Python derives from
:class:`WeightCheckerError` (also from the built-in type it refines, e.g.
``ValueError`` for bad input); the compiled core's ``SafetensorsError`` and
``DeviceTensorError`` are defined in Rust and derive from ``ValueError`` /
``TypeError`` only."""

from __future__ import annotations

from typing import Any


class WeightCheckerError(Exception):
    """Base class of the package's errors."""


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


class ExpectedDigestsError(WeightCheckerError, ValueError):
    """The expected digests cannot be computed exactly: names the tensor, the
    layer or the reason (an unknown architecture, a quantized model, a tensor
    the model does not have or whose shape disagrees, a truncated file)."""
