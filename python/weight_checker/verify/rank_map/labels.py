"""The rank map's labels and how each is shown: its grid character, terminal and HTML colours, meaning.

A label is a mismatching key's class (``stale``, ``changed``, ``wrong-shard``,
...) or the likely cause found for it (``zeros``, ``dtype-roundtrip:float16``,
``shard-of:tp1``, ...); labels are opaque strings here, styled by
:data:`STYLES` (by their family, the part before ``:``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OK = "ok"
MIXED = "mixed"


@dataclass(frozen=True)
class LabelStyle:
    """How a label family is shown: its grid character (upper case where
    every key of a cell has it, lower case where some do), its terminal
    colour (an SGR code), its HTML colour, and whether it means the update
    never reached the key (then a rank where every key has it "missed the
    update")."""

    char: str
    ansi: str
    css: str
    meaning: str
    missed: bool = False


#: Every class and cause a label can be, by family (the part before ``:``),
#: in the order a legend lists them: the one place that says how each looks.
STYLES: dict[str, LabelStyle] = {
    "stale": LabelStyle("S", "33", "#f2c94c", "unchanged by the transfer", missed=True),
    "untouched-since-reset": LabelStyle("R", "33", "#f2994a", "still the post-reset digest", missed=True),
    "missing": LabelStyle("M", "34", "#2f80ed", "in the reference only"),
    "unexpected": LabelStyle("X", "36", "#56ccf2", "on the engine only"),
    "wrong-shard": LabelStyle("W", "35", "#bb6bd9", "holds another rank's or key's digest"),
    "changed": LabelStyle("C", "31", "#eb5757", "any other difference"),
    "zeros": LabelStyle("Z", "91", "#9b2226", "all zeros"),
    "dtype-roundtrip": LabelStyle("D", "95", "#e056fd", "the weights through a narrower dtype"),
    "version": LabelStyle("V", "93", "#b7950b", "another step's weights", missed=True),
    "shard-of": LabelStyle("H", "35", "#8e44ad", "another rank's shard"),
    "reduced-with": LabelStyle("A", "35", "#a569bd", "an amax all-reduced with another rank's wrong shard"),
    "transposed": LabelStyle("T", "96", "#16a085", "the weights transposed"),
    "unknown": LabelStyle("U", "37", "#7f8c8d", "no cause found"),
}
#: The cells that are no label: every key matches; keys disagree.
OK_STYLE = LabelStyle(".", "2;32", "#d8f3dc", "every key matches")
MIXED_STYLE = LabelStyle("*", "1", "#34495e", "keys of several labels")
_OTHER_CSS, _OTHER_ANSI = "#95a5a6", "37"


def family(label: str) -> str:
    """A label's family: ``"dtype-roundtrip"`` of ``"dtype-roundtrip:float16"``."""
    return label.partition(":")[0]


def style(label: str) -> LabelStyle:
    """How ``label`` is shown (a label of no known family: its first letter, grey)."""
    if label == OK:
        return OK_STYLE
    if label == MIXED:
        return MIXED_STYLE
    known = STYLES.get(family(label))
    if known is not None:
        return known
    used = {s.char for s in STYLES.values()}
    letters = [c.upper() for c in label if c.isalpha() and c.upper() not in used]
    return LabelStyle(letters[0] if letters else "?", _OTHER_ANSI, _OTHER_CSS, label)


def label_for(klass: str, detail: Mapping[str, Any] | None) -> str:
    """A key's label: the cause its explanation found, else its class (a
    cause ``unknown`` or ``mixed``, blocks of several causes, says less than
    the class, so the class is kept)."""
    cause = detail.get("cause") if detail else None
    return cause if isinstance(cause, str) and cause and cause not in ("unknown", MIXED) else klass


def labels_for(classes: Mapping[str, str], details: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, str]:
    """key -> label of every mismatching key, from key -> class and the
    per-key explanations (see :func:`label_for`)."""
    details = details or {}
    return {k: label_for(c, details.get(k)) for k, c in classes.items()}


def label_order(label: str) -> tuple[int, str]:
    """Where a label sorts: by its family's place in :data:`STYLES` (unknown families after), then by name."""
    order = list(STYLES)
    fam = family(label)
    return (order.index(fam) if fam in order else len(order), label)
