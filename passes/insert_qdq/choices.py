"""Range choices made after calibration: known ranges of bounded ops, unclipped inputs, the report of ``method: auto``.

Unclipped inputs (``activations.unclipped``, a node selector): every quantized tensor a selected node reads gets
its observed ``[min, max]`` whatever the method chose (a clipped range is a bet that the lost tails are noise; for a
transformer's outlier features they are the signal).

Known ranges (``activations.fixed_ranges``): a quantized tensor produced by Sigmoid, Softmax, HardSigmoid
(``[0, 1]``) or Tanh (``[-1, 1]``) gets the range :func:`qgraph.calibrate.bounded_range` gives: the analytic bound
on each side the data come within a factor 2 of, and never less than the observed extremes (their large values
are the signal: confident scores, open gates). Hand overrides from a ranges file are left alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

from qgraph import GraphHandle
from qgraph.calibrate import TensorCalibration, bounded_range

from .calib import RangeInfo
from .units import Plan

#: How many tensors the report lists where ``auto``'s choice mattered most.
TOP = 5


def fix_bounded(
    graph: GraphHandle, ranges: dict[str, RangeInfo], overridden: set[str]
) -> tuple[dict[str, RangeInfo], dict[str, dict[str, Any]]]:
    """Ranges with the bounded ops' outputs fixed (module docstring), and ``tensor -> what changed``."""
    out = dict(ranges)
    changed: dict[str, dict[str, Any]] = {}
    for name, r in ranges.items():
        node = graph.index.producer.get(name)
        if node is None or name in overridden:
            continue
        fixed = bounded_range(node.op, (r.observed_min, r.observed_max), (r.rmin, r.rmax))
        if fixed is None or fixed == (r.rmin, r.rmax):
            continue
        out[name] = replace(r, rmin=fixed[0], rmax=fixed[1])
        changed[name] = {"op": node.op, "range": list(fixed), "calibrated": [r.rmin, r.rmax],
                         "observed": [r.observed_min, r.observed_max]}
    return out, changed


def fixed_decision(changed: dict[str, dict[str, Any]]) -> str:
    """One line for the decisions: how many bounded outputs got which range, with a few examples."""
    ops = Counter(c["op"] for c in changed.values())
    shown = "; ".join(
        f"{n} ({c['op']}): [{c['range'][0]:g}, {c['range'][1]:g}], calibrated [{c['calibrated'][0]:.3g}, "
        f"{c['calibrated'][1]:.3g}], observed [{c['observed'][0]:.3g}, {c['observed'][1]:.3g}]"
        for n, c in list(changed.items())[:3]
    )
    more = f" (+{len(changed) - 3} more in details)" if len(changed) > 3 else ""
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted(ops.items()))
    return (f"fixed ranges: {len(changed)} outputs of bounded ops ({kinds}) use their analytic bound where the data "
            f"reach half of it and are never clipped below the observed extremes: {shown}{more} "
            "(activations.fixed_ranges: false keeps the calibrated ranges)")


def auto_summary(measured: dict[str, TensorCalibration]) -> dict[str, Any] | None:
    """``method: auto``: tensors per winning method, and those where the choice mattered most (gain over minmax)."""
    chosen = {n: t.choice for n, t in measured.items() if t.choice is not None}
    if not chosen:
        return None
    ranked = sorted(chosen.items(), key=lambda kv: -kv[1].gain_db)[:TOP]
    return {
        "methods": dict(Counter(c.winner for c in chosen.values()).most_common()),
        "mattered_most": [
            {"tensor": n, "method": c.winner, "gain_db": round(c.gain_db, 2),
             "errors": {k: float(f"{v:.4g}") for k, v in c.errors.items()}}
            for n, c in ranked
        ],
    }


def auto_decision(summary: dict[str, Any]) -> str:
    """One line for the decisions: counts per method, and the largest gains over minmax."""
    counts = ", ".join(f"{m} for {k}" for m, k in summary["methods"].items())
    top = "; ".join(f"{r['tensor']}: {r['method']} {r['gain_db']:+.1f} dB" for r in summary["mattered_most"][:3]
                    if r["gain_db"] > 0)
    return (f"calibration method auto chose {counts} tensor(s) by the smallest expected quantization error"
            + (f"; largest gains over minmax: {top}" if top else ""))


def unclip(
    plan: Plan, ranges: dict[str, RangeInfo], readers: set[int], overridden: set[str]
) -> tuple[dict[str, RangeInfo], dict[str, dict[str, Any]]]:
    """Ranges where every group read by a node in ``readers`` (ids) spans its observed extremes, and ``root -> what
    changed`` (hand overrides from a ranges file are left alone). O(quantized tensors)."""
    out = dict(ranges)
    changed: dict[str, dict[str, Any]] = {}
    for tensor, root in plan.tensors.items():
        r = ranges.get(root)
        if r is None or root in changed or root in overridden or not plan.readers.get(tensor, set()) & readers:
            continue
        lo, hi = min(r.rmin, r.observed_min), max(r.rmax, r.observed_max)
        if (lo, hi) == (r.rmin, r.rmax):
            continue
        out[root] = replace(r, rmin=lo, rmax=hi)
        changed[root] = {"range": [lo, hi], "calibrated": [r.rmin, r.rmax]}
    return out, changed


def unclip_decision(changed: dict[str, dict[str, Any]]) -> str:
    """One line for the decisions: how many inputs were widened back to their observed range, with examples."""
    shown = "; ".join(f"{n}: [{c['range'][0]:.3g}, {c['range'][1]:.3g}] (calibrated [{c['calibrated'][0]:.3g}, "
                      f"{c['calibrated'][1]:.3g}])" for n, c in list(changed.items())[:3])
    more = f" (+{len(changed) - 3} more in details)" if len(changed) > 3 else ""
    return (f"unclipped: {len(changed)} input(s) of the activations.unclipped nodes keep their observed range: "
            f"{shown}{more}")
