"""Joins that keep their ranges: a Concat quantized in integer gives all its inputs the output's one scale.

When the inputs' calibrated ranges differ by ``ratio``, the narrowest input keeps only ``8 - log2(ratio)`` of its
bits (class scores in [0, 1] concatenated with box coordinates in [0, 320]: every score rounds to 0 or 1/255 of
the box range, the classic "INT8 detector finds nothing"). Such a Concat stays float: each input keeps its own
Q/DQ and scale (written by the op that produces it), and the join itself only moves data. The decision is taken
after calibration, from the measured ranges, and reported per node with the numbers.

Add and Mul joins need no such decision: onnxruntime's QLinearAdd/QLinearMul take a scale and zero point per input
(``A_scale``, ``B_scale``), so a narrow input (a gate in [0, 0.01], a small residual branch) keeps its own grid next
to a wide one; only the output is requantized, which the float op's result would need anyway. Measured in
``tests/passes/test_insert_qdq_joins.py``: the fused kernels run with input scales 57x (Add) and 23,000x (Mul)
apart, and the gated output keeps 34.7 dB SQNR.
"""

from __future__ import annotations

import math

from .calib import RangeInfo
from .config import InsertQDQConfig
from .units import Plan, label


def wide_joins(plan: Plan, ranges: dict[str, RangeInfo], cfg: InsertQDQConfig) -> dict[int, str]:
    """``id(node) -> decision`` for every quantized Concat whose input ranges differ by more than allowed."""
    if not cfg.joins.keep_float:
        return {}
    out: dict[int, str] = {}
    for unit in plan.units:
        if unit.kind != "variadic":
            continue
        spans: list[tuple[float, str, RangeInfo]] = []
        for t in unit.act_inputs:
            r = ranges.get(plan.tensors.get(t, t))
            if r is not None and r.rmax - r.rmin > 0:
                spans.append((r.rmax - r.rmin, t, r))
        if len(spans) < 2:
            continue
        wide, narrow = max(spans, key=lambda s: s[0]), min(spans, key=lambda s: s[0])
        ratio = wide[0] / narrow[0]
        if ratio <= cfg.joins.max_range_ratio:
            continue
        left = max(0.0, 8.0 - math.log2(ratio))
        out[id(unit.node)] = (
            f"{label(unit.node)} left float: its inputs' ranges differ {ratio:.0f}x ({wide[1]} "
            f"[{wide[2].rmin:.3g}, {wide[2].rmax:.3g}] vs {narrow[1]} [{narrow[2].rmin:.3g}, {narrow[2].rmax:.3g}]); "
            f"one shared scale would leave the narrowest input {left:.1f} of its 8 bits "
            f"(joins.max_range_ratio {cfg.joins.max_range_ratio:g}; its inputs keep their own scales)"
        )
    return out
