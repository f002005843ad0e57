"""Self-contained HTML building blocks: escaped tables, sections and inline SVG charts.

Pages use no script, no external stylesheet, font or image and no URL at all, so they open offline and make no
network request (SVG is inline HTML5, which needs no namespace URL).
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qgraph.io.outputs import write_atomic

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:2em auto;max-width:1200px;color:#1d232a;
padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;margin-top:1.8em;border-bottom:1px solid #d8dee4}
table{border-collapse:collapse;margin:.6em 0;font-size:13px}
th,td{border:1px solid #d8dee4;padding:3px 8px;text-align:left;vertical-align:top}td.name{min-width:7em}
.scroll{overflow-x:auto;max-width:100%}.scroll table{width:100%}td.num{white-space:nowrap}
.verdict{font-size:1.15em;padding:.7em 1em;border-radius:6px;margin:1em 0}.verdict b{margin-right:.6em}
.verdict.good{background:#eaf7ee}.verdict.borderline{background:#fff6dd}.verdict.poor{background:#fdecea}
.verdict.unmeasured{background:#f3f5f7}
th{background:#f3f5f7}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.bad td{background:#fdecea}tr.warn td{background:#fff6dd}tr.good td{background:#eaf7ee}
pre{background:#f6f8fa;padding:.8em;overflow:auto;font-size:12px}
.muted{color:#67707a}.chart{margin:.6em 0}svg text{font:11px sans-serif;fill:#333}
.kpi{display:inline-block;margin:0 1.5em .5em 0}.kpi b{font-size:1.3em;display:block}
.regions{display:flex;gap:24px;align-items:flex-start;overflow-x:auto}svg.graph{border:1px solid #e4e8ec;flex:none}
#culprits td:last-child{min-width:14em}
"""

BLUE, ORANGE, RED, GREY = "#4c78a8", "#f58518", "#d62728", "#9aa5b1"


def esc(value: Any) -> str:
    """HTML-escaped text of ``value``."""
    return html.escape(str(value), quote=True)


def fmt(value: Any, digits: int = 6) -> str:
    """Compact number formatting: ``digits`` significant digits, ``inf`` for infinities, ``-`` for None."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value + 0.0:.{digits}g}"  # + 0.0 turns -0.0 into 0.0
    return str(value)


#: Width names are shortened to in tables (from the middle: the distinctive tail stays).
NAME_WIDTH = 48


def short_name(name: str, width: int = NAME_WIDTH) -> str:
    """``name`` cut in the middle to ``width`` characters (``/encoder/…/attention/MatMul_1``), never wrapped."""
    if len(name) <= width or width < 8:
        return name
    head = max(width // 3, 3)
    tail = width - head - 1
    return f"{name[:head]}…{name[-tail:]}"


def cell(value: Any, *, exact_note: bool = True, digits: int = 4) -> str:
    """A table cell: numbers with ``digits`` significant digits, ``-`` for None, and an infinite SQNR spelled
    out as ``inf (exact)``: identical values, not a missing measurement."""
    if isinstance(value, float) and math.isinf(value) and value > 0 and exact_note:
        return "inf (exact)"
    return fmt(value, digits)


def _breakable(name: str) -> str:
    """``name`` escaped, with a line-break opportunity after each ``/`` and ``.`` (never inside a word), so a
    table of long node names fits the page instead of scrolling sideways."""
    return "".join(esc(ch) + ("<wbr>" if ch in "/." else "") for ch in name)


def _name_cell(name: str) -> str:
    """A name: shortened from the middle when long (the full name on hover), wrapping only after ``/`` or ``.``."""
    if len(name) <= NAME_WIDTH:
        return f'<td class="name">{_breakable(name)}</td>'
    return f'<td class="name"><span title="{esc(name)}">{_breakable(short_name(name))}</span></td>'


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    table_id: str = "",
    row_classes: Sequence[str] | None = None,
    caption: str = "",
) -> str:
    """An HTML table; numbers are right-aligned, every cell escaped."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{esc(row_classes[i])}"' if row_classes and row_classes[i] else ""
        cells = "".join(
            f'<td class="num">{esc(fmt(c))}</td>' if isinstance(c, (int, float)) and not isinstance(c, bool)
            else _name_cell(c) if isinstance(c, str) and c and not any(ch.isspace() for ch in c)
            else f"<td>{esc(fmt(c))}</td>"
            for c in row
        )
        body.append(f"<tr{cls}>{cells}</tr>")
    ident = f' id="{esc(table_id)}"' if table_id else ""
    cap = f"<caption>{esc(caption)}</caption>" if caption else ""
    return (f'<div class="scroll"><table{ident}>{cap}<thead><tr>{head}</tr></thead><tbody>{"".join(body)}'
            "</tbody></table></div>")


def section(title: str, body: str, section_id: str = "") -> str:
    """A titled section."""
    ident = f' id="{esc(section_id)}"' if section_id else ""
    return f"<section{ident}><h2>{esc(title)}</h2>{body}</section>"


def page(title: str, sections: Sequence[str], subtitle: str = "") -> str:
    """A complete, self-contained HTML document."""
    sub = f'<p class="muted">{esc(subtitle)}</p>' if subtitle else ""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{esc(title)}</title><style>{_CSS}</style></head>"
        f"<body><h1>{esc(title)}</h1>{sub}{''.join(sections)}</body></html>\n"
    )


def layer_chart(
    labels: Sequence[str],
    values: Sequence[float],
    *,
    colors: Sequence[str] | None = None,
    title: str = "SQNR per layer (dB), topological order",
    chart_id: str = "layer-chart",
    y_label: str = "SQNR (dB)",
    x_label: str = "tensors in topological order",
    reference: float | None = None,
    max_bars: int = 1500,
    width: int = 1100,
    height: int = 260,
) -> str:
    """Vertical bars per layer (inf drawn at the top, marked ``∞``); above ``max_bars`` buckets keep their minimum."""
    n = len(values)
    if n == 0:
        return '<p class="muted">no layers to chart</p>'
    idx = list(range(n))
    if n > max_bars:
        step = math.ceil(n / max_bars)
        idx = [min(range(s, min(s + step, n)), key=lambda i: values[i]) for s in range(0, n, step)]
    finite = [values[i] for i in idx if math.isfinite(values[i])]
    ticks = nice_ticks(min(0.0, min(finite, default=0.0)), max(max(finite, default=10.0), reference or 0.0, 10.0))
    bottom, top = ticks[0], ticks[-1]
    left, right, upper, lower = 62, 10, 24, 28
    pw, ph = width - left - right, height - upper - lower
    bw = pw / len(idx)

    def y(v: float) -> float:
        v = top if v == math.inf else (bottom if v == -math.inf else v)
        return upper + ph * (top - v) / (top - bottom)

    parts = [f'<svg id="{esc(chart_id)}" class="chart" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{esc(title)}">',
             f'<text x="{left}" y="14">{esc(title)}</text>']
    for v in ticks:
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e5e8eb"/>'
                     f'<text x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end">{fmt(v)}</text>')
    zero = y(0.0)
    for j, i in enumerate(idx):
        v = values[i]
        yy = y(v)
        color = colors[i] if colors else BLUE
        h = abs(zero - yy)
        parts.append(f'<rect x="{left + j * bw:.2f}" y="{min(yy, zero):.1f}" width="{max(bw * 0.85, 0.5):.2f}" '
                     f'height="{max(h, 0.5):.1f}" fill="{color}"><title>{esc(labels[i])}: {esc(fmt(v))} dB'
                     "</title></rect>")
    if reference is not None and bottom < reference < top:
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(reference):.1f}" y2="{y(reference):.1f}" '
                     f'stroke="{RED}" stroke-dasharray="4 3"/><text x="{width - right}" y="{y(reference) - 3:.1f}" '
                     f'text-anchor="end">{esc(fmt(reference))} dB</text>')
    parts.append(f'<text x="{left}" y="{height - 8}">first layer</text>'
                 f'<text class="axis-x" x="{left + pw / 2:.0f}" y="{height - 8}" text-anchor="middle">'
                 f'{esc(x_label)}</text>'
                 f'<text x="{width - right}" y="{height - 8}" text-anchor="end">last layer ({n} tensors)</text>'
                 f'<text class="axis-y" transform="translate(14,{upper + ph / 2:.0f}) rotate(-90)" '
                 f'text-anchor="middle">{esc(y_label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (steps of 1, 2 or 5 × 10^k) covering ``[lo, hi]``, first and last included."""
    span = max(hi - lo, 1e-9)
    raw = span / count
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1.0, 2.0, 5.0, 10.0) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks = [start]
    while ticks[-1] < hi - 1e-12:
        ticks.append(ticks[-1] + step)
    return [round(t, 10) for t in ticks]


def histogram_chart(
    ops: Sequence[str], before: Sequence[int], after: Sequence[int], *, chart_id: str = "op-chart", width: int = 720
) -> str:
    """Horizontal paired bars (before grey, after blue) per op type."""
    if not ops:
        return '<p class="muted">no ops</p>'
    row, left, right = 18, 170, 60
    height = row * len(ops) + 30
    top = max([*before, *after, 1])
    scale = (width - left - right) / top
    parts = [f'<svg id="{esc(chart_id)}" class="chart" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="op histogram before and after">',
             f'<rect x="{left}" y="4" width="10" height="8" fill="{GREY}"/><text x="{left + 14}" y="12">before</text>'
             f'<rect x="{left + 70}" y="4" width="10" height="8" fill="{BLUE}"/>'
             f'<text x="{left + 84}" y="12">after</text>']
    for i, op in enumerate(ops):
        y0 = 20 + i * row
        parts.append(f'<text x="{left - 6}" y="{y0 + 12}" text-anchor="end">{esc(op)}</text>')
        parts.append(f'<rect x="{left}" y="{y0 + 2}" width="{before[i] * scale:.1f}" height="6" fill="{GREY}">'
                     f"<title>{esc(op)} before: {before[i]}</title></rect>")
        parts.append(f'<rect x="{left}" y="{y0 + 9}" width="{after[i] * scale:.1f}" height="6" fill="{BLUE}">'
                     f"<title>{esc(op)} after: {after[i]}</title></rect>")
        parts.append(f'<text x="{left + max(before[i], after[i]) * scale + 4:.1f}" y="{y0 + 13}">'
                     f"{before[i]} → {after[i]}</text>")
    parts.append("</svg>")
    return "".join(parts)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically (see `qgraph.io.outputs.write_atomic`)."""
    return write_atomic(path, text)
