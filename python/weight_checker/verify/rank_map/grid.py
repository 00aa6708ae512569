"""The rank map's data: its cells and the map itself (:class:`RankLayerMap`), and how a cell shows.

A cell is the label its mismatching keys share, :data:`MIXED` where they
differ, :data:`OK` where none mismatches, and absent where the rank holds no
key of that layer (pipeline-parallel ranks hold different layers).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from weight_checker.verify.rank_map.labels import MIXED, OK, STYLES, label_order, style


@dataclass
class Cell:
    """One rank's keys of one layer: how many, how many mismatch, and the
    labels of those (label -> count)."""

    keys: int = 0
    mismatching: int = 0
    labels: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """:data:`OK`, the label every mismatching key shares, or :data:`MIXED`."""
        if not self.labels:
            return OK
        return next(iter(self.labels)) if len(self.labels) == 1 else MIXED

    @property
    def partial(self) -> bool:
        """Some of its keys mismatch, not all."""
        return 0 < self.mismatching < self.keys

    def add(self, other: Cell) -> None:
        self.keys += other.keys
        self.mismatching += other.mismatching
        for label, n in other.labels.items():
            self.labels[label] = self.labels.get(label, 0) + n


@dataclass
class RankLayerMap:
    """A failed check by rank and layer (:func:`weight_checker.verify.rank_map.rank_layer_map`)."""

    #: Row labels (``tp3``, ``dp1 tp0``, ``a:8000 tp0``), in rank order.
    rows: list[str]
    #: Column labels: ``embed``, the layer numbers, ``norm``, ``lm_head``, ``other``, ``draft``.
    columns: list[str]
    #: (row, column) index -> cell; absent where the rank holds no key of that column.
    cells: dict[tuple[int, int], Cell]
    #: key -> label of every mismatching key.
    labels: dict[str, str]
    #: key -> (row, column) of every mismatching key.
    positions: dict[str, tuple[int, int]]
    #: Whether every key was given (cells with no mismatch are then ``ok``).
    complete: bool
    #: One line per pattern that holds exactly (:func:`weight_checker.verify.rank_map.patterns.patterns`).
    patterns: list[str] = field(default_factory=list)

    def cell(self, row: int, column: int) -> Cell | None:
        return self.cells.get((row, column))

    def is_layer(self, column: int) -> bool:
        return self.columns[column].isdigit()

    def to_json(self) -> dict[str, Any]:
        """``{"rows", "columns", "cells", "counts", "complete"}``: ``cells[r][c]``
        the cell's label (``null``: the rank holds no key of that column),
        ``counts[r][c]`` its ``[mismatching, keys]``."""
        cells: list[list[str | None]] = []
        counts: list[list[list[int] | None]] = []
        for r in range(len(self.rows)):
            row = [self.cells.get((r, c)) for c in range(len(self.columns))]
            cells.append([x.label if x else None for x in row])
            counts.append([[x.mismatching, x.keys] if x else None for x in row])
        return {"rows": self.rows, "columns": self.columns, "cells": cells, "counts": counts, "complete": self.complete}


def union(cells: Iterable[Cell]) -> Cell:
    """The cells as one (several layers of a grid column, a rank's row, a column's ranks), labels in legend order."""
    total = Cell()
    for cell in cells:
        total.add(cell)
    total.labels = dict(sorted(total.labels.items(), key=lambda kv: label_order(kv[0])))
    return total


def cell_char(cell: Cell) -> str:
    """The cell's grid character, in the terminal and the page alike (lower case: some of its keys)."""
    c = style(cell.label).char
    return c.lower() if cell.partial and cell.label != MIXED else c


def legend_order(cell: Cell) -> tuple[int, str]:
    """Where a cell's label sits in a legend: ``ok`` first, the families in :data:`STYLES` order, ``mixed`` last."""
    if cell.label == OK:
        return (-1, "")
    if cell.label == MIXED:
        return (len(STYLES) + 1, "")
    return label_order(cell.label)
