"""Which ranks and layers: a failed check as a rank × layer map, built from its keys, and where to take it from.

:func:`rank_layer_map` builds the map and its :func:`patterns`; every name
of the map is taken from here. Its parts lie beside it, each in its room:
:mod:`.labels` (a key's label and how it is shown),
:mod:`.keys` (a key's rank and layer), :mod:`.grid` (the
cells and :class:`RankLayerMap`), :mod:`.patterns` (the patterns
that hold in it exactly), and the map rendered for a terminal
(:mod:`.text`) and as one self-contained HTML page
(:mod:`.html`).

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

from collections.abc import Iterable, Mapping

from weight_checker.verify.rank_map.grid import Cell, RankLayerMap
from weight_checker.verify.rank_map.html import render_html
from weight_checker.verify.rank_map.keys import ParsedName, Rank, parse_name, row_labels, split_key
from weight_checker.verify.rank_map.labels import (
    MIXED,
    MIXED_STYLE,
    OK,
    OK_STYLE,
    STYLES,
    LabelStyle,
    family,
    label_for,
    label_order,
    labels_for,
    style,
)
from weight_checker.verify.rank_map.patterns import patterns
from weight_checker.verify.rank_map.text import render_text

#: The map's names, as callers have always taken them from this module.
__all__ = [
    "MIXED",
    "MIXED_STYLE",
    "OK",
    "OK_STYLE",
    "STYLES",
    "Cell",
    "LabelStyle",
    "RankLayerMap",
    "family",
    "label_for",
    "labels_for",
    "patterns",
    "rank_layer_map",
    "render_html",
    "render_text",
    "style",
]


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
    names: dict[str, ParsedName] = {}
    ranks: dict[Rank, None] = {}
    parsed_ranks: dict[tuple[str, str], Rank] = {}
    split: dict[str, tuple[Rank, ParsedName]] = {}
    for key in keys:
        rank, name = split_key(key, parsed_ranks)
        parsed = names.get(name)
        if parsed is None:
            parsed = names[name] = parse_name(name)
        ranks[rank] = None
        split[key] = (rank, parsed)
    rank_order = sorted(ranks, key=Rank.order)
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
        cell.labels = dict(sorted(cell.labels.items(), key=lambda kv: label_order(kv[0])))
    out = RankLayerMap(
        rows=row_labels(rank_order),
        columns=[c for _, c in columns],
        cells=cells,
        labels=dict(labels),
        positions=positions,
        complete=complete,
    )
    out.patterns = patterns(out, {k: (row_of[r], n) for k, (r, n) in split.items()})
    return out
