"""The explanation's model: what was found per key and in all, previous versions, where expected tensors come from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

#: ``{key: {None: expected tensor, transform: candidate}}``.
Table = Mapping[str, Mapping[str | None, Any]]


class ExpectedTensors(Protocol):
    """Where the expected tensors of some keys come from: for each key,
    ``{None: the tensor the rank must hold, transform: the tensor it would
    hold had the source been transformed first}`` (a transform that does
    not apply is absent). Raises :class:`WeightCheckerError` for keys it
    cannot give (why goes to the explanation's notes).

    Optional: ``with_candidates(keys)``, the expected tensors and the
    candidates it gives at no extra cost in one table (an entry
    :data:`~weight_checker.expected.transforms.DEFERRED` is asked of
    :meth:`tensors` when it is tried); ``refused``, key -> why a key's
    tensor could not be given."""

    def tensors(self, keys: Sequence[str], transforms: Sequence[str]) -> Mapping[str, Mapping[str | None, Any]]: ...


@dataclass
class KeyExplanation:
    """What was found for one mismatched key."""

    key: str
    #: The key's mismatch class (``changed``, ``stale``...).
    cls: str
    #: ``zeros``, ``dtype-roundtrip:float16``, ``version:step-11``,
    #: ``shard-of:tp0``, ``reduced-with:tp1``, ``transposed``, ``mixed`` or ``unknown``.
    cause: str = "unknown"
    #: True where the whole tensor matched the cause (its whole digest, or
    #: every block differs and every block matched it).
    whole: bool = False
    shape: list[int] | None = None
    dtype: str | None = None
    nbytes: int | None = None
    block_bytes: int | None = None
    blocks: int | None = None
    #: Byte ranges ``[start, end)`` whose blocks differ, adjacent ones merged.
    ranges: list[tuple[int, int]] = field(default_factory=list)
    #: ``"rows 2048-4095 of 4096"``: the rows those ranges cover.
    where: str | None = None
    #: cause -> the byte ranges whose blocks match it (``unknown``: none did).
    block_causes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    #: Why something could not be told (no expected tensor...).
    note: str | None = None
    #: How the differing blocks were found: ``"chain states"`` (the engine
    #: continued the states the expected digests recorded: no expected
    #: tensor read) or ``"block digests"`` (both sides hashed the blocks).
    located_by: str | None = None

    def line(self) -> str:
        """One line: the key, its class and cause, where in the tensor."""
        parts = [self.key, self.cls, self.cause]
        if self.whole:
            parts.append("(the whole tensor)")
        elif self.ranges:
            of = f" of {self.nbytes}" if self.nbytes is not None else ""
            spans = ", ".join(f"{a}-{b}" for a, b in self.ranges[:4]) + (" ..." if len(self.ranges) > 4 else "")
            parts.append(f"{self.where or ''} (bytes {spans}{of})".strip())
            if self.cause == "mixed":
                parts.append("; ".join(f"{c}: {_spans(r)}" for c, r in self.block_causes.items()))
        if self.note:
            parts.append(f"[{self.note}]")
        return "  ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "class": self.cls,
            "cause": self.cause,
            "whole": self.whole,
            "shape": self.shape,
            "dtype": self.dtype,
            "nbytes": self.nbytes,
            "block_bytes": self.block_bytes,
            "blocks": self.blocks,
            "ranges": [list(r) for r in self.ranges],
            "where": self.where,
            "block_causes": {c: [list(r) for r in rs] for c, rs in self.block_causes.items()},
            "note": self.note,
            "located_by": self.located_by,
        }


def _spans(ranges: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"bytes {a}-{b}" for a, b in ranges[:3]) + (" ..." if len(ranges) > 3 else "")


@dataclass
class Explanation:
    """The explanations of a failed check's first mismatched keys."""

    keys: dict[str, KeyExplanation] = field(default_factory=dict)
    #: Mismatched keys left unexplained by the limit.
    left_out: int = 0
    #: Why some keys could not be explained further (one line each).
    notes: list[str] = field(default_factory=list)
    #: Seconds spent: the engine's block digests, this side's, in all.
    seconds: dict[str, float] = field(default_factory=dict)

    def causes(self) -> dict[str, str]:
        """key -> cause."""
        return {k: e.cause for k, e in self.keys.items()}

    def lines(self) -> list[str]:
        out = [e.line() for e in self.keys.values()]
        if self.left_out:
            out.append(f"({self.left_out} more mismatched keys not explained: raise the limit to see them)")
        return out + self.notes

    def details(self) -> dict[str, dict[str, Any]]:
        """key -> the report's per-key details (class, cause, where, ranges...)."""
        return {
            k: {
                "class": e.cls,
                "cause": e.cause,
                "where": e.where if not e.whole else "the whole tensor",
                "nbytes": e.nbytes,
                "ranges": [list(r) for r in e.ranges],
                "block_bytes": e.block_bytes,
                "blocks": e.blocks,
                "block_causes": {c: [list(r) for r in rs] for c, rs in e.block_causes.items()},
            }
            for k, e in self.keys.items()
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "keys": [e.to_json() for e in self.keys.values()],
            "left_out": self.left_out,
            "notes": self.notes,
            "seconds": self.seconds,
        }


@dataclass
class Version:
    """A previous version: its label (``step-11``), the digests it expected
    and, where they can still be had, its tensors."""

    label: str
    digests: Mapping[str, str]
    tensors: ExpectedTensors | None = None
