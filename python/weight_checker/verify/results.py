"""What a run of the verify workflow found, and the error it raises on request."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weight_checker.errors import UnverifiedWeightsError, WeightMismatchError
from weight_checker.verify.engine_digests import Layout, display_key

if TYPE_CHECKING:
    from weight_checker.verify.explain.model import Explanation
    from weight_checker.verify.rank_map import RankLayerMap


def any_version(versions: dict[str, dict[str, str | None]]) -> bool:
    return any(v is not None for seen in versions.values() for v in seen.values())


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
    #: key -> class, for every mismatching key (vLLM's union semantics); in a
    #: fleet the key is shown as ``"{engine} {key}"`` (see ``by_engine``).
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
    #: How the engines' digests related (``single``, ``merge``, ``fleet``).
    layout: Layout | None = None
    #: engine -> key -> class: the same mismatches, kept by engine.
    by_engine: dict[str, dict[str, str]] = field(default_factory=dict)
    #: What the digests were compared with: ``"the baseline"`` or
    #: ``"the expected digests"``.
    reference: str = "the baseline"
    #: engine -> {"before": version, "after": version}: the weight version
    #: each engine claimed (``None`` where it reports none).
    weight_versions: dict[str, dict[str, str | None]] = field(default_factory=dict)
    #: engine -> why its claimed weight version does not match the weights
    #: it holds (with expected digests that carry a ``weight_version``).
    version_mismatches: dict[str, str] = field(default_factory=dict)
    #: engine -> rank -> slot -> adapter name, where adapters were in scope.
    lora_slots: dict[str, Any] = field(default_factory=dict)
    #: Every key compared, shown as in ``mismatches``; kept only where some
    #: key differs (what :meth:`rank_map` places).
    compared_keys: list[str] = field(default_factory=list, repr=False)
    #: Why the check failed, where it could be told: where in each of the
    #: first mismatched tensors, and the likely cause
    #: (:mod:`weight_checker.verify.explain`); ``None`` on a match.
    explanation: Explanation | None = None
    #: ``unseen:`` keys (shown as in ``mismatches``): weights an engine holds
    #: outside its parameters, which no digest covers
    #: (:mod:`weight_checker.hashing.unseen`). Any makes the verdict
    #: ``unverified``, never a match.
    unseen: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """``"match"``, ``"mismatch"`` (some key or weight version differs),
        ``"unverified"`` (nothing differs, but some weights no digest covers)
        or ``"error"`` (the run failed or was interrupted before a verdict)."""
        if self.error is not None and not self.key_count:
            return "error"
        if self.mismatches or self.version_mismatches:
            return "mismatch"
        if self.unseen:
            return "unverified"
        return "match" if self.match else "mismatch"

    def class_by_explanation(self) -> None:
        """A ``changed`` key that its explanation proves ``wrong-shard``
        (every differing block is another rank's:
        :func:`~weight_checker.verify.classes.partial_wrong_shards`) is
        classed so, here and in ``by_engine``, with what it holds in
        ``details``."""
        if self.explanation is None:
            return
        from weight_checker.verify.classes import partial_wrong_shards

        for shown, detail in partial_wrong_shards(self.explanation.keys).items():
            self.explanation.keys[shown].cls = "wrong-shard"
            if shown in self.mismatches:
                self.mismatches[shown] = "wrong-shard"
                self.details[shown] = detail
            for engine, classes in self.by_engine.items():
                for key in classes:
                    if shown in (key, display_key(engine, key)):
                        classes[key] = "wrong-shard"

    def raise_for_mismatch(self) -> None:
        """:class:`WeightMismatchError` (counts per class, first keys) if any
        key differs, or an engine's weight version does not match its weights."""
        if self.mismatches or self.version_mismatches or self.unseen:
            raise self.mismatch_error()

    def mismatch_error(self) -> WeightMismatchError:
        """The :class:`WeightMismatchError` of this result: counts per class,
        the first keys, the map's patterns and the explanation's causes."""
        explanation = self.explanation
        rank_map = self.rank_map(explanation.details() if explanation is not None else None)
        kind = UnverifiedWeightsError if self.verdict == "unverified" else WeightMismatchError
        return kind(
            self.mismatches,
            self.reference,
            self.version_mismatches,
            explanation=explanation,
            patterns=rank_map.patterns if rank_map is not None else (),
            unseen=self.unseen,
        )

    def classes(self) -> dict[str, list[str]]:
        """class -> sorted keys."""
        out: dict[str, list[str]] = {}
        for k in sorted(self.mismatches):
            out.setdefault(self.mismatches[k], []).append(k)
        return out

    def rank_map(self, details: Mapping[str, Mapping[str, Any]] | None = None) -> RankLayerMap | None:
        """The mismatches by rank and layer, with the patterns that hold in
        them (``.patterns``); ``None`` on a match. ``details``: key -> what
        an explanation found (its ``cause`` labels the key instead of its
        class); see :func:`weight_checker.verify.rank_map.rank_layer_map`."""
        if not self.mismatches:
            return None
        from weight_checker.verify.rank_map import labels_for, rank_layer_map

        return rank_layer_map(labels_for(self.mismatches, details), self.compared_keys or None)

    def to_json(self) -> dict[str, Any]:
        explanation = self.explanation
        rank_map = self.rank_map(explanation.details() if explanation is not None else None)
        return {
            "servers": self.servers,
            "steps": [
                {"step": s.name, "ok": s.ok, "seconds": s.seconds, "detail": s.detail}
                | ({"slowest": {"engine": s.slowest[0], "seconds": s.slowest[1]}} if s.slowest else {})
                for s in self.steps
            ],
            "match": self.match,
            "verdict": self.verdict,
            "mismatches": sorted(self.mismatches),
            "classes": self.classes(),
            "key_count": self.key_count,
            "reference": self.reference,
            "layout": self.layout,
            "warnings": self.warnings,
            **({"details": self.details} if self.details else {}),
            **({"by_engine": self.by_engine} if self.layout == "fleet" else {}),
            **({"weight_versions": self.weight_versions} if any_version(self.weight_versions) else {}),
            **({"version_mismatches": self.version_mismatches} if self.version_mismatches else {}),
            **({"lora_slots": self.lora_slots} if self.lora_slots else {}),
            **({"error": self.error} if self.error else {}),
            **({"unseen": sorted(self.unseen)} if self.unseen else {}),
            **({"map": rank_map.to_json(), "patterns": rank_map.patterns} if rank_map is not None else {}),
            **({"explanation": explanation.to_json()} if explanation is not None else {}),
        }
