"""What a run of the verify workflow found, and the error it raises on request."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weight_checker.classes import class_counts
from weight_checker.errors import WeightCheckerError


class WeightMismatchError(WeightCheckerError):
    """The weights after the transfer differ from the baseline."""

    def __init__(self, mismatches: Mapping[str, str]):
        summary = class_counts(mismatches)
        first = ", ".join(sorted(mismatches)[:5])
        more = " ..." if len(mismatches) > 5 else ""
        super().__init__(f"{len(mismatches)} keys differ from the baseline ({summary}): {first}{more}")
        self.mismatches = dict(mismatches)


@dataclass
class Step:
    name: str
    seconds: float
    ok: bool
    detail: str = ""
    #: ``(engine, seconds)`` of the slowest engine, when the step ran on several.
    slowest: tuple[str, float] | None = None


@dataclass
class VerifyResult:
    """What one run of the workflow found."""

    match: bool = False
    #: key -> class, for every mismatching key (vLLM's union semantics).
    mismatches: dict[str, str] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: How many keys were compared (the baseline's, or the expected ones).
    key_count: int = 0
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
            "steps": [
                {"step": s.name, "ok": s.ok, "seconds": s.seconds, "detail": s.detail}
                | ({"slowest": {"engine": s.slowest[0], "seconds": s.slowest[1]}} if s.slowest else {})
                for s in self.steps
            ],
            "match": self.match,
            "mismatches": sorted(self.mismatches),
            "classes": self.classes(),
            "key_count": self.key_count,
            "warnings": self.warnings,
            **({"details": self.details} if self.details else {}),
            **({"error": self.error} if self.error else {}),
        }
