"""The rank map as one self-contained HTML page: verdict, patterns, coloured grid, keys and block ranges."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from weight_checker.verify.rank_map.grid import Cell, RankLayerMap, cell_char, legend_order
from weight_checker.verify.rank_map.labels import OK, style

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
                f'title="{_esc(tip)}">{"" if label == OK else _esc(cell_char(cell))}</td>'
            )
        out.append("</tr>")
    out.append("</table>")
    legend = []
    for label, _ in sorted(seen.items(), key=lambda kv: legend_order(kv[1])):
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
