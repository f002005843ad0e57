"""The report's first screen: is this model good enough, and if not, what to change.

The verdict, from the run's final check against the float model (`qgraph.analysis.fidelity`):

- with a metric (``--metric``, or top-1 agreement for class scores): **good** when it drops at most 1% relative
  to float, **borderline** up to 3%, else **poor**;
- without one, by the lowest output SQNR: **good** at 30 dB or more, **borderline** from 20 dB (close to float
  numerically, but judge it by your task metric), else **poor**;
- a non-finite output or metric is **poor**: nothing was measured that could say otherwise.

Below it, the Q/DQ pairs that cost the most output error (`qgraph.analysis.diff.culprits`), each with the node
that reads it, and the remedy as a recipe patch: those nodes back to float (``float_fallback``), ready for
``qgraph run RECIPE MODEL --patch fix.yaml``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from qgraph.analysis.diff.attribution import Attribution, share_text
from qgraph.analysis.diff.html import esc, fmt

#: Relative metric drops (float → INT8) of a good and of a borderline model.
GOOD_DROP, BORDERLINE_DROP = 0.01, 0.03
#: Lowest output SQNR (dB) of a good and of a borderline model when no metric is known.
GOOD_SQNR_DB, BORDERLINE_SQNR_DB = 30.0, 20.0
#: Culprits the remedy returns to float.
REMEDY_TOP = 3


@dataclass(frozen=True)
class Verdict:
    """The answer of the first screen: ``level`` (good, borderline, poor, unmeasured) and the sentence why."""

    level: str
    reason: str


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def verdict(check: dict[str, Any] | None, fidelity: list[dict[str, Any]]) -> Verdict:
    """The verdict for the final model (module docs); ``unmeasured`` when no data reached the check."""
    outputs = (check or {}).get("outputs") or [r for r in fidelity if r.get("stage") == "final" and "error" not in r]
    if not outputs:
        return Verdict("unmeasured", "no data measured the final model: give --eval-data (held-out samples) to "
                                     "know whether it is good enough.")
    sqnrs = [o.get("sqnr_db") for o in outputs]
    if not all(_finite(s) or s in ("inf", math.inf) for s in sqnrs):
        return Verdict("poor", "an output is not finite (NaN/Inf) or could not be compared: nothing says it is fine.")
    lowest = min(math.inf if s in ("inf", math.inf) else float(s) for s in sqnrs)
    float_metric = (check or {}).get("float_metric")
    metrics = [o.get("metric") for o in outputs if o.get("metric") is not None]
    if metrics and float_metric is not None:
        return _by_metric(float(metrics[0]), float(float_metric), lowest)
    top1 = [o.get("top1_agreement") for o in outputs if o.get("top1_agreement") is not None]
    if top1:
        return _by_metric(float(min(top1)), 1.0, lowest, name="top-1 agreement with float")
    level = "good" if lowest >= GOOD_SQNR_DB else "borderline" if lowest >= BORDERLINE_SQNR_DB else "poor"
    return Verdict(level, f"lowest output SQNR {fmt(lowest, 3)} dB against float (good ≥ {GOOD_SQNR_DB:g} dB, "
                          f"borderline ≥ {BORDERLINE_SQNR_DB:g} dB); judge it by your task metric with --metric.")


def _by_metric(value: float, reference: float, lowest_db: float, name: str = "metric") -> Verdict:
    if not (math.isfinite(value) and math.isfinite(reference)):
        return Verdict("poor", f"the {name} is not finite ({value} vs float {reference}).")
    drop = (reference - value) / abs(reference) if reference else reference - value
    level = "good" if drop <= GOOD_DROP else "borderline" if drop <= BORDERLINE_DROP else "poor"
    against = "" if name != "metric" else f" vs float {fmt(reference, 4)}"
    return Verdict(level, f"{name} {fmt(value, 4)}{against} ({-drop:+.2%}; good within {GOOD_DROP:.0%}, "
                          f"borderline within {BORDERLINE_DROP:.0%}); lowest output SQNR {fmt(lowest_db, 3)} dB.")


def remedy_nodes(att: Attribution | None, top: int = REMEDY_TOP) -> list[str]:
    """The nodes reading the ``top`` worst Q/DQ pairs (distinct, worst first): what the remedy returns to float."""
    nodes: list[str] = []
    for c in (att.culprits if att is not None else []):
        if c.point.node not in nodes:
            nodes.append(c.point.node)
        if len(nodes) == top:
            break
    return nodes


def remedy_patch(nodes: list[str]) -> str:
    """A recipe patch returning ``nodes`` to float (``qgraph run RECIPE MODEL --patch FILE``)."""
    names = ", ".join(json.dumps(n) for n in nodes)
    return ("# qgraph run RECIPE MODEL --patch fix.yaml -o OUT.onnx: these nodes back to float\n"
            "name: fix\npasses:\n  - pass: float_fallback\n"
            f"    nodes: {{names: [{names}]}}\n")


def first_screen_html(check: dict[str, Any] | None, fidelity: list[dict[str, Any]],
                      att: Attribution | None) -> str:
    """The verdict, what it was measured on, the top culprits and the remedy patch (HTML)."""
    v = verdict(check, fidelity)
    data = (check or {}).get("data")
    held_out = (check or {}).get("held_out")
    # the page's subtitle names the data; a verdict on calibration data says so where it is read
    caveat = "" if held_out or data is None else ('<div class="muted">measured on calibration data, not held-out: '
                                                  "give --eval-data for a verdict that holds</div>")
    body = [f'<div id="verdict" class="verdict {esc(v.level)}"><b>{esc(v.level.upper())}</b> {esc(v.reason)}'
            f"{caveat}</div>"]
    if att is not None and att.culprits and v.level != "good":
        rows = []
        for c in att.culprits[:REMEDY_TOP]:
            share = "-" if c.contribution is None else share_text(c.contribution)
            rows.append(f"<li><b>{esc(c.point.kind)} {esc(c.point.tensor)}</b> (read by {esc(c.point.node)}): "
                        f"{esc(c.reason)}; {esc(share)} of the output error</li>")
        body.append(f"<p>What to change: the Q/DQ pairs that cost the most</p><ol id=\"top-culprits\">{''.join(rows)}"
                    f"</ol><p>Their readers back to float, as a recipe patch (or tune the ranges: "
                    f"<code>tune_ranges</code>; or a search for the fewest nodes: <code>qgraph sensitivity FLOAT "
                    f"INT8 --eval-data DATA --target sqnr:30 --patch fix.yaml</code>):</p>"
                    f'<pre id="remedy">{esc(remedy_patch(remedy_nodes(att)))}</pre>')
    elif att is not None and att.culprits:
        c = att.culprits[0]
        body.append(f"<p>The largest remaining error: the Q/DQ pair on {esc(c.point.kind)} {esc(c.point.tensor)} "
                    f"(read by {esc(c.point.node)}). Nothing needs to change.</p>")
    return f'<section id="first-screen">{"".join(body)}</section>'


def culprits_context(data: str) -> str:
    """Against what and on which data the report ranks its culprits: `qgraph diff` measures against the model it
    is given, on its own data, so its ranking can differ and the report says why."""
    return (f"Measured against the float model the quantizing pass received, with its weights, on {data}. "
            "`qgraph diff FLOAT INT8 --eval-data DATA` measures against the model you give it, on that data: its "
            "ranking can differ where the data or the reference weights differ.")
