"""Rendering of the Q/DQ attribution (culprits) and of the evaluation line, for the terminal and HTML."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from qgraph.analysis.diff.attribution import Attribution, share_text
from qgraph.analysis.diff.html import esc, fmt, section, table
from qgraph.analysis.diff.tables import sqnr_cell

_CULPRIT_HEAD = ["#", "Q/DQ pair on", "read by", "scale", "clipped", "Q/DQ SQNR dB", "alone: out SQNR dB",
                 "share of out error", "why"]


def evaluation_line(ev: dict[str, Any]) -> str:
    """``B on deployed kernels (x86-vnni, this host), on DATA: SQNR 40.7 dB, cosine 0.99996; top-1 agreement
    98.9%; metric M: A 0.9889 → B 0.98 (-0.9%)`` (and the same on this host's kernels when B was measured for
    another CPU; the layers whose int16 pair sums saturated)."""
    lines = [_scores(ev, f"B on {ev.get('measured_with', 'this host')}, on {ev['data']}")]
    mismatch = (ev.get("kernels") or {}).get("mismatch")
    if mismatch:
        lines.insert(0, mismatch)
    if ev.get("host"):
        lines.append(_scores({**ev, **ev["host"]}, f"B on {ev['host']['measured_with']} (not the target)"))
    for s in ev.get("saturation", []):
        lines.append(f"int16 saturation in {s['node']}: {100 * s['fraction']:.3g}% of its u8×s8 pair sums (Q/DQ "
                     f"pair {s['activation']} × weight {s['weight']}; {s['channels_at_risk']} of {s['channels']} "
                     "channels can)")
    lines += [f"emulation not exact at {note}" for note in ev.get("emulation_notes", [])]
    return "\n".join(lines)


def _scores(ev: dict[str, Any], head: str) -> str:
    parts = [head]
    if ev.get("sqnr_db") is not None:
        parts.append(f"lowest output SQNR {fmt(ev['sqnr_db'], 4)} dB, cosine {fmt(ev.get('cosine'), 6)}")
    if ev.get("top1_agreement") is not None:
        parts.append(f"top-1 agreement {ev['top1_agreement']:.2%}")
    if ev.get("metric"):
        a, b = ev.get("metric_a"), ev.get("metric_b")
        change = f" ({(b - a) / abs(a):+.2%})" if isinstance(a, float) and isinstance(b, float) and a else ""
        ci = ev.get("metric_b_interval")
        spread = (f", B's {ci['level']:.0%} interval {ci['low']:.4f}-{ci['high']:.4f} over {ci['samples']} samples"
                  if ci else "")
        parts.append(f"metric {ev['metric']}: A {fmt(a, 5)} → B {fmt(b, 5)}{change}{spread}")
    if ev.get("error"):
        parts.append(f"error: {ev['error']}")
    return "; ".join(parts)


def culprit_rows(att: Attribution, top: int) -> list[list[Any]]:
    """Rows of the culprits table, worst first (``-`` where a pair was not measured alone)."""
    rows: list[list[Any]] = []
    for i, c in enumerate(att.culprits[:top], 1):
        d = c.to_dict()
        share = "-" if d["contribution"] is None else share_text(d["contribution"])
        alone = "-" if d["alone_sqnr_db"] is None else sqnr_cell(d["alone_sqnr_db"])
        rows.append([f"{i} {d['kind'][0]}", d["tensor"], d["node"], fmt(d["scale"], 4),
                     f"{d['clip_fraction']:.2%}" + (f" (+{d['flat_clip_fraction']:.2%} flat)" if d["flat_clip_fraction"]
                                                   else ""),
                     sqnr_cell(d["rounding_sqnr_db"]), alone, share, d["reason"]])
    return rows


def print_culprits(console: Console, att: Attribution, top: int = 10) -> None:
    """Print the headline (the pair that costs the most, and why) and the ranked culprits, one short block
    each (readable at any terminal width)."""
    for line in att.not_run:
        console.print(f"not run: {line}", markup=False, highlight=False)
    headline = att.headline()
    if headline is None:
        return
    console.print(Text.assemble(("culprit:", "bold red"), " ", headline))  # one text: wraps as one paragraph
    on = att.measured_on()
    console.print(f"Q/DQ pairs by their share of the output error (top {min(top, len(att.culprits))} of "
                  f"{len(att.culprits)}; {att.samples} sample(s){f'; measured on {on}' if on else ''})", style="bold")
    for i, c in enumerate(att.culprits[:top], 1):
        d = c.to_dict()
        alone = "not measured alone" if d["alone_sqnr_db"] is None else (
            f"alone: output SQNR {fmt(d['alone_sqnr_db'], 4)} dB = {share_text(d['contribution'] or 0.0)} of the "
            "output error")
        console.print(f"{i:>2}. {d['kind']} {d['tensor']} → {d['node']}", markup=False, highlight=False)
        console.print(f"    {d['reason']}", markup=False, highlight=False)
        console.print(f"    scale {fmt(d['scale'], 4)}, zero point {d['zero_point']}, clipped "
                      f"{d['clip_fraction']:.2%}{_flat(d)}, Q/DQ SQNR {fmt(d['rounding_sqnr_db'], 4)} dB; {alone}",
                      style="dim", markup=False, highlight=False)
    for note in att.notes[:3]:
        console.print(f"  note: {note}", markup=False, highlight=False)


def _flat(d: dict[str, Any]) -> str:
    """What a flat side clipped (`qgraph.analysis.diff.flat_sides`): not an error, but worth seeing."""
    f = d.get("flat_clip_fraction") or 0.0
    return f" (+{f:.2%} beyond a flat side of its activation: same output codes, not counted)" if f else ""


def culprits_html(att: Attribution, top: int = 10, context: str = "") -> str:
    """The culprits section: headline and the ranked Q/DQ pairs; ``context`` says against what and on which
    data they were measured, when a reader may compare them with another tool's ranking."""
    headline = att.headline()
    not_run = "".join(f'<p class="muted not-run">not run: {esc(line)}</p>' for line in att.not_run)
    if headline is None:
        return section("Where accuracy was lost: Q/DQ pairs", not_run, "culprits-section") if not_run else ""
    body = (f'<p id="culprit-headline"><b>{esc(headline)}</b></p>' + not_run
            + (f'<p class="muted">{esc(context)}</p>' if context else "")
            + table(_CULPRIT_HEAD, culprit_rows(att, max(top, 20)), table_id="culprits")
            + "".join(f'<p class="muted">{esc(n)}</p>' for n in att.notes[:10])
            + f'<p class="muted">{att.samples} sample(s); {sum(c.output_noise is not None for c in att.culprits)} '
              "pairs measured alone (the reference with only that pair applied); the others are ranked by the "
              f"noise they inject{f'. Output error measured on {esc(att.measured_on())}' if att.measured_on() else ''}"
              ".</p>")
    return section("Where accuracy was lost: Q/DQ pairs", body, "culprits-section")
