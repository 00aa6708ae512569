"""The patterns that hold exactly in a rank map, one line each (``tp3 missed the update``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from weight_checker.verify.rank_map.grid import Cell, RankLayerMap, union
from weight_checker.verify.rank_map.keys import ParsedName, Rank, parse_name, split_key
from weight_checker.verify.rank_map.labels import MIXED, label_order, style


def _counts(labels: Iterable[str]) -> str:
    """``"150 stale, 10 missing"``."""
    n: dict[str, int] = {}
    for label in labels:
        n[label] = n.get(label, 0) + 1
    return ", ".join(f"{c} {label}" for label, c in sorted(n.items(), key=lambda kv: label_order(kv[0])))


def _list(names: Sequence[str], limit: int = 8) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[: limit - 2])} and {len(names) - limit + 2} more"


def _layers(first: str, last: str) -> str:
    return f"layer {first}" if first == last else f"layers {first}-{last}"


def patterns(rank_map: RankLayerMap, parsed: Mapping[str, tuple[int, ParsedName]] | None = None) -> list[str]:
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
    given by :func:`weight_checker.verify.rank_map.rank_layer_map`); without it only the kind is named."""
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
        label = union(by_row.values()).label
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
        state = (union(holders).label, len(holders) == nrows)
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
        seen: dict[tuple[str, str], Rank] = {}
        for key, (r, _) in parsed.items():
            name = split_key(key, seen)[1]
            holding.setdefault(name, set()).add(r)
            if key in labels:
                failing.setdefault(name, set()).add(r)
        if all(holding[n] == rows for n, rows in failing.items()):
            everywhere = all(len(rows) == nrows for rows in failing.values())
            whose = "" if everywhere else " holding them"
            out.append(f"the same {len(failing)} parameters differ on every rank{whose} ({_counts(labels.values())})")
    return out


def _column_line(span: str, state: tuple[str, bool], many: bool) -> str:
    label, everywhere = state
    what = "differ" if label == MIXED else label
    if not many:
        return f"{span} {what}"
    return f"{span} {what} on every rank" + ("" if everywhere else " holding them")


def _kind_line(labels: Mapping[str, str], parsed: Mapping[str, tuple[int, ParsedName]] | None, nrows: int) -> str:
    """``only `k_proj` differs ...`` where every mismatching key is of one
    module (one or some of its parameters), and the model has other ones."""
    of = {k: (parsed[k][1] if parsed is not None else parse_name(split_key(k)[1])) for k in labels}
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
