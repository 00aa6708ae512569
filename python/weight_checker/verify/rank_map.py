"""Which ranks and layers: a failed check as a rank × layer map, the
patterns that hold in it exactly, and the map rendered for a terminal and as
one self-contained HTML page.

A key is ``dp{d}:pp{p}:pcp{c}:tp{t}:{name}`` (or with ``:ep{e}`` after
``tp``), or in a fleet ``"{engine} {key}"``. Each mismatching key has a
*label*: its mismatch class (``stale``, ``changed``, ``wrong-shard``, ...) or
the likely cause found for it (``zeros``, ``dtype-roundtrip:float16``,
``shard-of:tp1``, ...); labels are opaque strings here, styled by
:data:`STYLES` (by their family, the part before ``:``).

Rows are ranks (the engine and the rank fields that vary between rows, e.g.
``tp3`` or ``dp1 tp0``); columns are layers, read from the parameter name
(``model.layers.17.mlp...`` is layer 17), with ``embed`` before them and
``norm``, ``lm_head``, ``other`` (and ``draft``, the draft model) after.
A cell is the label its mismatching keys share, :data:`MIXED` where they
differ, :data:`OK` where none mismatches, and absent where the rank holds no
key of that layer (pipeline-parallel ranks hold different layers).
"""

from __future__ import annotations

import html
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weight_checker.keys import split_rank

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


# --- keys: rank and layer ----------------------------------------------------------------------

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")
_EMBED = re.compile(r"embed|(?:^|\.)(?:wte|wpe|tok_embeddings)(?:\.|$)")
_NORM = re.compile(r"norm|(?:^|\.)ln_f(?:\.|$)")
_HEAD = re.compile(r"lm_head|(?:^|\.)output(?:\.|$)")
#: Columns that are no layer: their sort rank (layers sit between embed and norm).
_NAMED = {"embed": 0, "norm": 2, "lm_head": 3, "other": 4, "draft": 5}
_DIGITS = re.compile(r"(\d+)")


@dataclass(frozen=True)
class _Name:
    column: str
    order: tuple[int, int]
    param: str  # "k_proj.weight" (a scope's prefix kept: "draft:k_proj.weight")
    module: str  # "k_proj"


def _parse_name(name: str) -> _Name:
    scope, path = "", name
    if name.startswith("draft:"):
        scope, path = "draft:", name[len("draft:") :]
    elif name.startswith("lora:"):
        adapter, _, path = name[len("lora:") :].partition(":")
        scope = f"lora:{adapter}:"
    elif name.startswith("buffer:"):
        scope, path = "buffer:", name[len("buffer:") :]
    m = _LAYER.search(path)
    rest = path[m.end() :] if m else path
    parts = [p for p in rest.split(".") if p] or [path]
    param, module = scope + ".".join(parts[-2:]), scope + parts[max(0, len(parts) - 2)]
    if scope == "draft:":
        column = "draft"
    elif m:
        return _Name(m.group(1), (1, int(m.group(1))), param, module)
    elif _EMBED.search(path):
        column = "embed"
    elif _HEAD.search(path):
        column = "lm_head"
    elif _NORM.search(path):
        column = "norm"
    else:
        column = "other"
    return _Name(column, (_NAMED[column], 0), param, module)


def _natural(text: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(text))


@dataclass(frozen=True)
class _Rank:
    engine: str
    fields: tuple[tuple[str, int], ...]  # (("dp", 0), ("pp", 0), ...)

    def order(self) -> tuple[Any, ...]:
        return (_natural(self.engine), tuple(v for _, v in self.fields), self.fields)


#: A key's rank prefix, as :func:`weight_checker.keys.split_rank` reads it (its fast path).
_RANK = re.compile(r"(dp\d+:pp\d+:pcp\d+:tp\d+(?::ep\d+)?):")


def _split_key(key: str, ranks: dict[tuple[str, str], _Rank] | None = None) -> tuple[_Rank, str]:
    """The key's engine and rank, and its parameter name (``ranks``: the
    ranks parsed so far, by engine and prefix)."""
    engine, rank, name = "", "", key
    m = _RANK.match(key)
    if m is not None:
        rank, name = m.group(1), key[m.end() :]
    elif " " in key:
        head, _, tail = key.rpartition(" ")
        m = _RANK.match(tail)
        if m is not None:
            engine, rank, name = head, m.group(1), tail[m.end() :]
    if not rank and split_rank(key)[0]:  # a form the fast path does not know
        rank, name = split_rank(key)
    cached = ranks.get((engine, rank)) if ranks is not None else None
    if cached is None:
        fields = tuple((f.rstrip("0123456789"), int(f[len(f.rstrip("0123456789")) :])) for f in rank.split(":") if f)
        cached = _Rank(engine, fields)
        if ranks is not None:
            ranks[(engine, rank)] = cached
    return cached, name


def _short_engine(engine: str) -> str:
    return re.sub(r"^https?://", "", engine)


def _row_labels(ranks: Sequence[_Rank]) -> list[str]:
    """Short row labels: the engine where several, and the rank fields that
    vary (``tp`` where none does)."""
    engines = {r.engine for r in ranks}
    names = [n for r in ranks for n, _ in r.fields]
    varying = [n for n in dict.fromkeys(names) if len({dict(r.fields).get(n) for r in ranks}) > 1]
    if not varying and "tp" in names and len(engines) == 1:
        varying = ["tp"]
    labels = []
    for r in ranks:
        values = dict(r.fields)
        parts = [_short_engine(r.engine)] if len(engines) > 1 or (r.engine and not r.fields) else []
        parts += [f"{n}{values[n]}" for n in varying if n in values]
        labels.append(" ".join(parts) or "(all keys)")
    if len(set(labels)) < len(labels):  # keys of both forms, say: the full ranks
        labels = [" ".join([_short_engine(r.engine)] + [f"{n}{v}" for n, v in r.fields]) for r in ranks]
    return labels


# --- the map -----------------------------------------------------------------------------------


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
    """A failed check by rank and layer (:func:`rank_layer_map`)."""

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
    #: One line per pattern that holds exactly (:func:`patterns`).
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


def rank_layer_map(labels: Mapping[str, str], all_keys: Iterable[str] | None = None) -> RankLayerMap:
    """The rank × layer map of these mismatches (key -> label: a class or a
    cause), and its :func:`patterns`. ``all_keys``: every key compared (the
    mismatching ones are added), so that cells with no mismatch show as
    ``ok`` and a pattern over "every key" can be decided; without it only the
    mismatching keys are placed and only what they alone prove is named."""
    keys = set(labels)
    complete = all_keys is not None
    if all_keys is not None:
        keys.update(all_keys)
    names: dict[str, _Name] = {}
    ranks: dict[_Rank, None] = {}
    parsed_ranks: dict[tuple[str, str], _Rank] = {}
    split: dict[str, tuple[_Rank, _Name]] = {}
    for key in keys:
        rank, name = _split_key(key, parsed_ranks)
        parsed = names.get(name)
        if parsed is None:
            parsed = names[name] = _parse_name(name)
        ranks[rank] = None
        split[key] = (rank, parsed)
    rank_order = sorted(ranks, key=_Rank.order)
    row_of = {r: i for i, r in enumerate(rank_order)}
    columns = sorted({n.order: n.column for n in names.values()}.items())
    col_of = {column: i for i, (_, column) in enumerate(columns)}
    cells: dict[tuple[int, int], Cell] = {}
    positions: dict[str, tuple[int, int]] = {}
    for key, (rank, parsed) in split.items():
        at = (row_of[rank], col_of[parsed.column])
        cell = cells.get(at)
        if cell is None:
            cell = cells[at] = Cell()
        cell.keys += 1
        label = labels.get(key)
        if label is not None:
            cell.mismatching += 1
            cell.labels[label] = cell.labels.get(label, 0) + 1
            positions[key] = at
    for cell in cells.values():  # labels in legend order, so a cell's label never depends on key order
        cell.labels = dict(sorted(cell.labels.items(), key=lambda kv: _label_order(kv[0])))
    out = RankLayerMap(
        rows=_row_labels(rank_order),
        columns=[c for _, c in columns],
        cells=cells,
        labels=dict(labels),
        positions=positions,
        complete=complete,
    )
    out.patterns = patterns(out, {k: (row_of[r], n) for k, (r, n) in split.items()})
    return out


def _label_order(label: str) -> tuple[int, str]:
    order = list(STYLES)
    fam = family(label)
    return (order.index(fam) if fam in order else len(order), label)


# --- patterns ----------------------------------------------------------------------------------


def _counts(labels: Iterable[str]) -> str:
    """``"150 stale, 10 missing"``."""
    n: dict[str, int] = {}
    for label in labels:
        n[label] = n.get(label, 0) + 1
    return ", ".join(f"{c} {label}" for label, c in sorted(n.items(), key=lambda kv: _label_order(kv[0])))


def _list(names: Sequence[str], limit: int = 8) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[: limit - 2])} and {len(names) - limit + 2} more"


def _layers(first: str, last: str) -> str:
    return f"layer {first}" if first == last else f"layers {first}-{last}"


def patterns(rank_map: RankLayerMap, parsed: Mapping[str, tuple[int, _Name]] | None = None) -> list[str]:
    """The patterns that hold exactly in ``rank_map``, one line each, in a
    fixed order (never a guess; none where none holds):

    - every key of every rank mismatches (``every key stale on every rank:
      the update reached no rank``), and then nothing else;
    - ranks where every key mismatches (``tp3 missed the update (every layer
      stale)``);
    - the mismatches lie on some ranks only (``only tp3 differs (12 of its
      160 keys)``), where the line above does not already say so;
    - runs of layers where every key of every rank holding them mismatches
      (``layers 40-79 stale on every rank``), and such non-layer columns
      (``lm_head stale on every rank``) where nothing else is named;
    - one parameter kind is all that differs (``only `k_proj` differs on
      every rank (640 stale)``);
    - the same parameters differ on every rank, where nothing above
      places them.

    ``parsed``: key -> (row, parsed name) of every key (the map's own,
    given by :func:`rank_layer_map`); without it only the kind is named."""
    labels = rank_map.labels
    if not labels:
        return []
    if not rank_map.complete or parsed is None:
        kind = _kind_line(labels, None, len(rank_map.rows))
        return [kind] if kind else []
    nrows, many = len(rank_map.rows), len(rank_map.rows) > 1
    by_row: dict[int, Cell] = {}
    by_column: dict[int, list[Cell]] = {}
    layered_rows: set[int] = set()
    for (r, c), cell in sorted(rank_map.cells.items()):
        by_row.setdefault(r, Cell()).add(cell)
        by_column.setdefault(c, []).append(cell)
        if rank_map.is_layer(c):
            layered_rows.add(r)
    full_rows = [r for r in range(nrows) if by_row[r].mismatching == by_row[r].keys]
    where = " on every rank" if many else ""
    # Every key of every rank: nothing else to say.
    if len(full_rows) == nrows:
        label = _union(by_row.values()).label
        if label == MIXED:
            return [f"every key differs{where} ({_counts(labels.values())})"]
        if style(label).missed:
            return [f"every key {label}{where}: the update reached " + ("no rank" if many else "none of them")]
        return [f"every key {label}{where}"]
    out: list[str] = []
    # Ranks where every key mismatches.
    grouped: dict[str, list[int]] = {}
    for r in full_rows:
        label = by_row[r].label
        if label == MIXED:
            row_labels = [lab for key, lab in labels.items() if rank_map.positions[key][0] == r]
            out.append(f"{rank_map.rows[r]}: every key differs ({_counts(row_labels)})")
        else:
            grouped.setdefault(label, []).append(r)
    for label, rows in sorted(grouped.items(), key=lambda kv: (kv[1][0], kv[0])):
        names = _list([rank_map.rows[r] for r in rows])
        unit = "layer" if all(r in layered_rows for r in rows) else "key"
        if style(label).missed:
            out.append(f"{names} missed the update (every {unit} {label})")
        else:
            out.append(f"{names}: every {unit} {label}")
    # The mismatches lie on some ranks only.
    differing = [r for r in range(nrows) if by_row[r].mismatching]
    if many and len(differing) < nrows and differing != full_rows:
        held = sum(by_row[r].keys for r in differing)
        mismatching = sum(by_row[r].mismatching for r in differing)
        verb, whose = ("differs", "its") if len(differing) == 1 else ("differ", "their")
        names = _list([rank_map.rows[r] for r in differing])
        out.append(f"only {names} {verb} ({mismatching} of {whose} {held} keys)")
    # Runs of layers (and named columns) where every key of every rank holding them mismatches.
    runs: list[tuple[int, int, str, bool]] = []
    named: list[str] = []
    for c in range(len(rank_map.columns)):
        holders = by_column.get(c, [])
        if not holders or any(cell.mismatching < cell.keys for cell in holders):
            continue
        state = (_union(holders).label, len(holders) == nrows)
        if not rank_map.is_layer(c):
            named.append(_column_line(rank_map.columns[c], state, many))
        elif runs and runs[-1][1] == c - 1 and runs[-1][2:] == state:
            runs[-1] = (runs[-1][0], c, *state)
        else:
            runs.append((c, c, *state))
    for first, last, label, everywhere in runs:
        span = _layers(rank_map.columns[first], rank_map.columns[last])
        out.append(_column_line(span, (label, everywhere), many))
    kind = _kind_line(labels, parsed, nrows)
    if kind:
        out.append(kind)
    if named and not full_rows and not kind:
        out += named
    # The same parameters differ on every rank, where nothing above places them.
    if many and len(differing) == nrows and not runs and not kind:
        holding: dict[str, set[int]] = {}
        failing: dict[str, set[int]] = {}
        seen: dict[tuple[str, str], _Rank] = {}
        for key, (r, _) in parsed.items():
            name = _split_key(key, seen)[1]
            holding.setdefault(name, set()).add(r)
            if key in labels:
                failing.setdefault(name, set()).add(r)
        if all(holding[n] == rows for n, rows in failing.items()):
            everywhere = all(len(rows) == nrows for rows in failing.values())
            whose = "" if everywhere else " holding them"
            out.append(f"the same {len(failing)} parameters differ on every rank{whose} ({_counts(labels.values())})")
    return out


def _union(cells: Iterable[Cell]) -> Cell:
    total = Cell()
    for cell in cells:
        total.add(cell)
    total.labels = dict(sorted(total.labels.items(), key=lambda kv: _label_order(kv[0])))
    return total


def _column_line(span: str, state: tuple[str, bool], many: bool) -> str:
    label, everywhere = state
    what = "differ" if label == MIXED else label
    if not many:
        return f"{span} {what}"
    return f"{span} {what} on every rank" + ("" if everywhere else " holding them")


def _kind_line(labels: Mapping[str, str], parsed: Mapping[str, tuple[int, _Name]] | None, nrows: int) -> str:
    """``only `k_proj` differs ...`` where every mismatching key is of one
    module (one or some of its parameters), and the model has other ones."""
    of = {k: (parsed[k][1] if parsed is not None else _parse_name(_split_key(k)[1])) for k in labels}
    modules = {n.module for n in of.values()}
    if len(modules) != 1:
        return ""
    module = modules.pop()
    params = {n.param for n in of.values()}
    if parsed is None:
        return f"only {_kind_name(module, params, None)} {'differs' if len(params) == 1 else 'differ'}"
    all_params = {n.param for _, n in parsed.values() if n.module == module}
    kind_keys = [k for k, (_, n) in parsed.items() if n.param in params]
    if len(kind_keys) == len(parsed):
        return ""  # the model has nothing else: "only" would say nothing
    shown = _kind_name(module, params, all_params)
    verb = "differs" if shown.count("`") == 2 else "differ"
    counts = _counts(labels.values())
    if len(kind_keys) > len(labels):
        return f"only {shown} {verb} ({len(labels)} of its {len(kind_keys)} keys: {counts})"
    holders = {r for k, (r, _) in parsed.items() if k in labels}
    where = "" if nrows == 1 else " on every rank" if len(holders) == nrows else " on every rank holding it"
    return f"only {shown} {verb}{where} ({counts})"


def _kind_name(module: str, params: set[str], all_params: set[str] | None) -> str:
    """```k_proj``` where these are all the module's parameters, else the parameters."""
    if all_params is not None and params == all_params:
        return f"`{module}`"
    return ", ".join(f"`{p}`" for p in sorted(params))


# --- rendering: the terminal -------------------------------------------------------------------


def _char(cell: Cell) -> str:
    c = style(cell.label).char
    return c.lower() if cell.partial and cell.label != MIXED else c


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
                chars.append((_char(merged), style(merged.label).ansi))
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
    return None if not found else found[0] if len(found) == 1 else _union(found)


def _column_char(column: str) -> str:
    return {"lm_head": "h"}.get(column, column[0])


def _legend(present: Iterable[Cell], color: bool) -> str:
    """``. ok  S stale  * mixed``: one entry per label family shown."""
    entries: dict[str, str] = {}
    partial = False
    for cell in sorted(present, key=_legend_order):
        label = cell.label
        partial |= cell.partial and label != MIXED
        name = label if label in (OK, MIXED) else family(label)
        entries.setdefault(name, f"{_paint(style(label).char, style(label).ansi, color)} {name}")
    return "  ".join(entries.values()) + ("  (lower case: some of the cell's keys)" if partial else "")


def _legend_order(cell: Cell) -> tuple[int, str]:
    if cell.label == OK:
        return (-1, "")
    if cell.label == MIXED:
        return (len(STYLES) + 1, "")
    return _label_order(cell.label)


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


# --- rendering: HTML ---------------------------------------------------------------------------

_CSS = """
body { font: 14px/1.4 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px; color: #1b1f23; }
h1 { font-size: 20px; margin: 0 0 8px; } h2 { font-size: 16px; margin: 24px 0 8px; }
.verdict { font-family: monospace; font-size: 15px; padding: 8px 12px; border-radius: 4px; display: inline-block; }
.verdict.bad { background: #fdecea; color: #8a1c1c; } .verdict.good { background: #e6f4ea; color: #1e5631; }
ul.patterns { font-size: 15px; font-weight: 600; } ul.notes { color: #6a5d00; }
table.map { border-collapse: separate; border-spacing: 1px; font-family: monospace; font-size: 10px; }
table.map th { font-weight: normal; color: #555; padding: 0 2px; }
table.map th.col { writing-mode: vertical-rl; transform: rotate(180deg); height: 44px; text-align: left; }
table.map th.row { text-align: right; padding-right: 6px; white-space: nowrap; font-size: 12px; }
table.map td { width: 15px; min-width: 15px; height: 18px; text-align: center; padding: 0; font-weight: bold; }
table.map td.none { background: repeating-linear-gradient(45deg, #fafafa, #fafafa 2px, #eee 2px, #eee 4px); }
table.map td.partial { opacity: 0.6; }
.legend span.sw { display: inline-block; width: 12px; height: 12px; vertical-align: middle; margin: 0 4px 0 14px; }
.legend small.note { margin-left: 14px; }
table.keys { border-collapse: collapse; font-size: 12px; }
table.keys th, table.keys td { border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }
table.keys td.key { font-family: monospace; }
.bar { position: relative; width: 240px; height: 10px; background: #d8f3dc; border: 1px solid #bbb; }
.bar span { position: absolute; top: 0; height: 100%; }
"""


def _ink(css: str) -> str:
    """Dark text on a light background, white on a dark one."""
    r, g, b = (int(css[i : i + 2], 16) for i in (1, 3, 5))
    return "#1b1f23" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "#ffffff"


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def render_html(
    rank_map: RankLayerMap | None,
    details: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    title: str = "weight-checker: why a check failed",
    verdict: str = "",
    notes: Sequence[str] = (),
    max_keys: int = 5000,
) -> str:
    """One self-contained HTML page (inline CSS, no script, nothing fetched):
    the verdict, the patterns, the map as a coloured grid with a legend, the
    per-key table and the block ranges. ``rank_map`` ``None``: a match (the
    verdict alone). ``details``: key -> what the explanation found, each
    field optional: ``class``, ``cause``, ``where`` (``"rows 2048-4095 of
    4096"``), ``ranges`` (``[start, end)`` byte ranges that differ),
    ``block_bytes``, ``blocks``, ``block_causes`` (cause -> byte ranges).
    Every string is escaped."""
    details = details or {}
    good = rank_map is None or not rank_map.labels
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_esc(title)}</h1>",
    ]
    if verdict:
        out.append(f'<div class="verdict {"good" if good else "bad"}">{_esc(verdict)}</div>')
    if notes:
        out.append('<ul class="notes">' + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul>")
    if rank_map is not None and rank_map.labels:
        if rank_map.patterns:
            out.append("<h2>Patterns</h2>")
            out.append('<ul class="patterns">' + "".join(f"<li>{_esc(p)}</li>" for p in rank_map.patterns) + "</ul>")
        out += _html_map(rank_map)
        out += _html_blocks(rank_map, details, max_keys)
        out += _html_keys(rank_map, details, max_keys)
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _html_map(rank_map: RankLayerMap) -> list[str]:
    out = ["<h2>Rank × layer map</h2>", '<table class="map"><tr><th></th>']
    for col in rank_map.columns:
        out.append(f'<th class="col" title="{_esc(col)}">{_esc(col)}</th>')
    out.append("</tr>")
    seen: dict[str, Cell] = {}
    partial = absent = False
    for r, row in enumerate(rank_map.rows):
        out.append(f'<tr><th class="row">{_esc(row)}</th>')
        for c, col in enumerate(rank_map.columns):
            cell = rank_map.cells.get((r, c))
            where = f"{row} · {'layer ' + col if rank_map.is_layer(c) else col}"
            if cell is None:
                absent = True
                out.append(f'<td class="none" title="{_esc(where)}: no key"></td>')
                continue
            label = cell.label
            seen.setdefault(label, cell)
            partial |= cell.partial
            what = ", ".join(f"{n} {lab}" for lab, n in cell.labels.items()) or "ok"
            tip = f"{where}: {cell.mismatching} of {cell.keys} keys differ ({what})" if cell.labels else f"{where}: ok"
            cls = "ok" if label == OK else "bad partial" if cell.partial else "bad"
            css = style(label).css
            out.append(
                f'<td class="{cls}" data-label="{_esc(label)}" style="background:{css};color:{_ink(css)}" '
                f'title="{_esc(tip)}">{"" if label == OK else _esc(_char(cell))}</td>'
            )
        out.append("</tr>")
    out.append("</table>")
    legend = []
    for label, _ in sorted(seen.items(), key=lambda kv: _legend_order(kv[1])):
        s = style(label)
        legend.append(
            f'<span class="sw" style="background:{s.css}"></span><b>{_esc(s.char)}</b> {_esc(label)}'
            f" <small>({_esc(s.meaning)})</small>"
        )
    if partial:
        legend.append('<small class="note">faded, lower case: some of the cell\'s keys</small>')
    if absent:
        legend.append('<span class="sw" style="background:#eee"></span> the rank holds no key of it')
    out.append(f'<p class="legend">{"".join(legend)}</p>')
    return out


def _sorted_keys(rank_map: RankLayerMap) -> list[str]:
    return sorted(rank_map.labels, key=lambda k: (rank_map.positions.get(k, (0, 0)), k))


def _num(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _ranges_text(ranges: Any) -> str:
    try:
        return " ".join(f"[{_bytes(s)}, {_bytes(e)})" for s, e in ranges)
    except (TypeError, ValueError):
        return str(ranges)


def _html_keys(rank_map: RankLayerMap, details: Mapping[str, Mapping[str, Any]], max_keys: int) -> list[str]:
    keys = _sorted_keys(rank_map)
    out = [
        f"<h2>Keys that differ ({len(keys)})</h2>",
        '<table class="keys"><tr><th>key</th><th>class</th><th>cause</th><th>where</th><th>bytes that differ</th></tr>',
    ]
    for key in keys[:max_keys]:
        d = details.get(key, {})
        klass = d.get("class") or rank_map.labels[key]
        cause = d.get("cause") or ""
        ranges = _ranges_text(d["ranges"]) if d.get("ranges") else ""
        out.append(
            f'<tr><td class="key">{_esc(key)}</td><td>{_esc(klass)}</td><td>{_esc(cause)}</td>'
            f"<td>{_esc(d.get('where') or '')}</td><td>{_esc(ranges)}</td></tr>"
        )
    out.append("</table>")
    if len(keys) > max_keys:
        out.append(f"<p>... and {len(keys) - max_keys} more (<code>--json</code> lists every key)</p>")
    return out


def _html_blocks(rank_map: RankLayerMap, details: Mapping[str, Mapping[str, Any]], max_keys: int) -> list[str]:
    keys = [
        k for k in _sorted_keys(rank_map) if _pairs(details.get(k, {}).get("ranges")) or _causes(details.get(k, {}))
    ]
    if not keys:
        return []
    out = [
        "<h2>Block ranges</h2>",
        '<table class="keys"><tr><th>key</th><th>blocks</th><th>where</th>'
        "<th>in the tensor (green: blocks that match)</th><th>byte ranges</th></tr>",
    ]
    for key in keys[:max_keys]:
        d = details[key]
        spans = _causes(d) or [(s, e, rank_map.labels[key]) for s, e in _pairs(d.get("ranges"))]
        size = _size(d, spans)
        blocks, block_bytes = d.get("blocks"), d.get("block_bytes")
        about = f"{_num(blocks)} of {_bytes(block_bytes)}" if blocks is not None and block_bytes is not None else ""
        bar = "".join(
            f'<span style="left:{100 * s / size:.3f}%;width:{max(0.4, 100 * (e - s) / size):.3f}%;'
            f'background:{style(lab).css}" title="{_esc(lab)}: [{_num(s)}, {_num(e)})"></span>'
            for s, e, lab in spans
            if size
        )
        listed = "; ".join(f"{lab}: [{_bytes(s)}, {_bytes(e)})" for s, e, lab in spans)
        out.append(
            f'<tr><td class="key">{_esc(key)}</td><td>{_esc(about)}</td><td>{_esc(d.get("where") or "")}</td>'
            f'<td><div class="bar">{bar}</div></td><td>{_esc(listed)}</td></tr>'
        )
    out.append("</table>")
    return out


def _causes(detail: Mapping[str, Any]) -> list[tuple[int, int, str]]:
    """``(start, end, cause)`` of each byte range a cause was found for."""
    causes = detail.get("block_causes")
    if not isinstance(causes, Mapping):
        return []
    return sorted((s, e, str(cause)) for cause, ranges in causes.items() for s, e in _pairs(ranges))


def _bytes(n: Any) -> str:
    """``4 MiB``, ``512 KiB`` where exact, else the bytes."""
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if n % size == 0:
                return f"{n // size:,} {unit}"
    return _num(n)


def _pairs(ranges: Any) -> list[tuple[int, int]]:
    out = []
    for item in ranges or ():
        try:
            s, e = item
            out.append((int(s), int(e)))
        except (TypeError, ValueError):
            continue
    return out


def _size(detail: Mapping[str, Any], spans: Sequence[tuple[int, int, str]]) -> int:
    blocks, block_bytes, nbytes = detail.get("blocks"), detail.get("block_bytes"), detail.get("nbytes")
    ends = max((e for _, e, _ in spans), default=0)
    if isinstance(nbytes, int) and nbytes > 0:
        return max(nbytes, ends)
    if isinstance(blocks, int) and isinstance(block_bytes, int):
        return max(blocks * block_bytes, ends)
    return ends
