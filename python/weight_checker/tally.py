"""How every report words a count of keys per class ("2 changed, 1 stale").

It sits on the bottom floor, beside :mod:`.errors`, whose mismatch error words
its message with it: :mod:`.verify.classes` decides the classes, this only
counts them."""

from __future__ import annotations

from collections.abc import Mapping


def class_counts(classes: Mapping[str, str]) -> str:
    """``"2 changed, 1 stale"``: how many mismatching keys each class has,
    from ``key -> class``; the one wording of every report."""
    counts: dict[str, int] = {}
    for c in classes.values():
        counts[c] = counts.get(c, 0) + 1
    return ", ".join(f"{n} {c}" for c, n in sorted(counts.items()))
