"""The rank map for a terminal: a compact grid, one character a cell, a legend, and the patterns."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

from weight_checker.verify.rank_map.grid import Cell, RankLayerMap, cell_char, legend_order, union
from weight_checker.verify.rank_map.labels import MIXED, OK, family, style


def _paint(text: str, ansi: str, color: bool) -> str:
    return f"\x1b[{ansi}m{text}\x1b[0m" if color else text


def render_text(rank_map: RankLayerMap, color: bool = False, width: int = 100) -> str:
    """The map as a compact grid, one character per cell (rank rows, layer
    columns; several layers a column where they do not fit in ``width``), a
    legend, and the patterns; ANSI colours only with ``color``."""
    layer_cols = [c for c in range(len(rank_map.columns)) if rank_map.is_layer(c)]
    before = [c for c in range(len(rank_map.columns)) if not rank_map.is_layer(c) and rank_map.columns[c] == "embed"]
    after = [c for c in range(len(rank_map.columns)) if not rank_map.is_layer(c) and c not in before]
    label_width = max(len(r) for r in rank_map.rows)
    room = max(20, width - label_width - len(before) - len(after) - 6)
    per = max(1, math.ceil(len(layer_cols) / room))
    groups = [layer_cols[i : i + per] for i in range(0, len(layer_cols), per)]
    lines = []
    present: dict[tuple[str, bool], Cell] = {}
    grid: list[str] = []
    for r, name in enumerate(rank_map.rows):
        parts = []
        for block in ([[c] for c in before], groups, [[c] for c in after]):
            if not block:
                continue
            chars: list[tuple[str, str]] = []
            for cols in block:
                merged = _merged(rank_map, r, cols)
                if merged is None:
                    chars.append((" ", ""))
                    continue
                present.setdefault((merged.label, merged.partial), merged)
                chars.append((cell_char(merged), style(merged.label).ansi))
            parts.append(_painted(chars, color))
        grid.append(f"  {name:<{label_width}}  " + " ".join(parts))
    header_parts = []
    if before:
        header_parts.append("".join(rank_map.columns[c][0] for c in before))
    if groups:
        ruler = [" "] * len(groups)
        for i in range(0, len(groups), 10):
            text = rank_map.columns[groups[i][0]]
            if i + len(text) <= len(groups):
                ruler[i : i + len(text)] = list(text)
        header_parts.append("".join(ruler))
    if after:
        header_parts.append("".join(_column_char(rank_map.columns[c]) for c in after))
    lines.append("rank x layer map: " + _legend(present.values(), color))
    lines.append("  " + _columns_note(rank_map, before, layer_cols, after, per))
    lines.append(f"  {'':<{label_width}}  " + " ".join(header_parts))
    lines += grid
    if rank_map.patterns:
        lines.append("patterns:")
        lines += [f"  {p}" for p in rank_map.patterns]
    return "\n".join(lines)


def _painted(chars: Sequence[tuple[str, str]], color: bool) -> str:
    """The characters, each run of one colour painted once."""
    out = []
    for ansi, run in itertools.groupby(chars, key=lambda ch: ch[1]):
        text = "".join(ch for ch, _ in run)
        out.append(_paint(text, ansi, color) if ansi else text)
    return "".join(out)


def _merged(rank_map: RankLayerMap, row: int, cols: Sequence[int]) -> Cell | None:
    """The cell of these columns together (``None``: the rank holds none of them)."""
    found = [cell for c in cols if (cell := rank_map.cells.get((row, c))) is not None]
    return None if not found else found[0] if len(found) == 1 else union(found)


def _column_char(column: str) -> str:
    return {"lm_head": "h"}.get(column, column[0])


def _legend(present: Iterable[Cell], color: bool) -> str:
    """``. ok  S stale  * mixed``: one entry per label family shown."""
    entries: dict[str, str] = {}
    partial = False
    for cell in sorted(present, key=legend_order):
        label = cell.label
        partial |= cell.partial and label != MIXED
        name = label if label in (OK, MIXED) else family(label)
        entries.setdefault(name, f"{_paint(style(label).char, style(label).ansi, color)} {name}")
    return "  ".join(entries.values()) + ("  (lower case: some of the cell's keys)" if partial else "")


def _columns_note(
    rank_map: RankLayerMap, before: Sequence[int], layers: Sequence[int], after: Sequence[int], per: int
) -> str:
    parts = [f"{rank_map.columns[c][0]} {rank_map.columns[c]}" for c in before]
    if layers:
        span = f"layers {rank_map.columns[layers[0]]}-{rank_map.columns[layers[-1]]}"
        parts.append(span + (f" ({per} a column)" if per > 1 else ""))
    parts += [f"{_column_char(rank_map.columns[c])} {rank_map.columns[c]}" for c in after]
    blank = any((r, c) not in rank_map.cells for r in range(len(rank_map.rows)) for c in range(len(rank_map.columns)))
    return "columns: " + ", ".join(parts) + ("; blank: the rank holds none" if blank else "")
