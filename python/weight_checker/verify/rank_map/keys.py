"""A key as the rank map reads it: its rank (a row) and its parameter name's layer (a column).

A key is ``dp{d}:pp{p}:pcp{c}:tp{t}:{name}`` (or with ``:ep{e}`` after
``tp``), or in a fleet ``"{engine} {key}"``. Rows are ranks (the engine and
the rank fields that vary between rows, e.g. ``tp3`` or ``dp1 tp0``); columns
are layers, read from the parameter name (``model.layers.17.mlp...`` is layer
17), with ``embed`` before them and ``norm``, ``lm_head``, ``other`` (and
``draft``, the draft model) after.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from weight_checker.keys import split_rank

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")
_EMBED = re.compile(r"embed|(?:^|\.)(?:wte|wpe|tok_embeddings)(?:\.|$)")
_NORM = re.compile(r"norm|(?:^|\.)ln_f(?:\.|$)")
_HEAD = re.compile(r"lm_head|(?:^|\.)output(?:\.|$)")
#: Columns that are no layer: their sort rank (layers sit between embed and norm).
_NAMED = {"embed": 0, "norm": 2, "lm_head": 3, "other": 4, "draft": 5}
_DIGITS = re.compile(r"(\d+)")


@dataclass(frozen=True)
class ParsedName:
    """A parameter name as the map reads it: its column, where that column sorts, its parameter and module."""

    column: str
    order: tuple[int, int]
    param: str  # "k_proj.weight" (a scope's prefix kept: "draft:k_proj.weight")
    module: str  # "k_proj"


def parse_name(name: str) -> ParsedName:
    """The column, parameter and module of a parameter name (a key less its rank)."""
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
        return ParsedName(m.group(1), (1, int(m.group(1))), param, module)
    elif _EMBED.search(path):
        column = "embed"
    elif _HEAD.search(path):
        column = "lm_head"
    elif _NORM.search(path):
        column = "norm"
    else:
        column = "other"
    return ParsedName(column, (_NAMED[column], 0), param, module)


def _natural(text: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(text))


@dataclass(frozen=True)
class Rank:
    """A key's engine (``""`` outside a fleet) and rank fields, a row of the map."""

    engine: str
    fields: tuple[tuple[str, int], ...]  # (("dp", 0), ("pp", 0), ...)

    def order(self) -> tuple[Any, ...]:
        return (_natural(self.engine), tuple(v for _, v in self.fields), self.fields)


#: A key's rank prefix, as :func:`weight_checker.keys.split_rank` reads it (its fast path).
_RANK = re.compile(r"(dp\d+:pp\d+:pcp\d+:tp\d+(?::ep\d+)?):")


def split_key(key: str, ranks: dict[tuple[str, str], Rank] | None = None) -> tuple[Rank, str]:
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
        cached = Rank(engine, fields)
        if ranks is not None:
            ranks[(engine, rank)] = cached
    return cached, name


def _short_engine(engine: str) -> str:
    return re.sub(r"^https?://", "", engine)


def row_labels(ranks: Sequence[Rank]) -> list[str]:
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
