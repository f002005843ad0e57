"""Ranges of tensors read only by an activation, clipped where it is flat (``activations.through_activation``).

The math is :mod:`qgraph.calibrate.transfer`; here is which tensors qualify. A quantized tensor qualifies when it is
its own parameter group (no Concat/Split shares its scale), is no graph output, and every reader belongs to one
activation of it: a single Sigmoid/Tanh/HardSigmoid/HardSwish/Relu/LeakyRelu/Clip (constant bounds), or the SiLU
pair ``s = Sigmoid(x)``, ``Mul(x, s)`` with ``s`` read by that Mul only (how PyTorch exports ``nn.SiLU``), and the
activation's output is quantized too. Every reader then sees ``x`` only through the activation, and what it sees is
rounded to that output's grid, so clipping where the activation is within a quarter of a code of its limit changes
no code. An activation that is exactly constant beyond a bound (HardSwish below -3, Relu below 0, Clip and
HardSigmoid beyond theirs) qualifies with a float output too: clipping there changes nothing at all. PicoDet's
pointwise convolutions before HardSwish and a float depthwise convolution (18 tensors clipped instead of 3, e.g.
[-10.9, 5.11] -> [-3.03, 5.11]): detection F1 against float 0.980 -> 1.000, mAP@0.5:0.95 0.927 -> 1.000 (both CPUs,
held-out pages).
A detector's final score Sigmoid whose output stays float is left alone: there a clipped logit is a visible score
error. Decided on the final plan, after the joins, depthwise and latency decisions; any calibration method. Hand
overrides from a ranges file are left alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from qgraph import GraphHandle, PassResult
from qgraph.calibrate.transfer import ThroughChoice, Transfer, clip_flat
from qgraph.quant.math import QuantSpec, compute_scale_zero_point

from .calib import RangeInfo
from .config import ActivationOptions
from .units import Plan

#: How many tensors the decision line names.
SHOWN = 3
_SINGLE = ("Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Relu", "LeakyRelu", "Clip")
#: Activations exactly constant beyond a bound (HardSwish below -3, Relu below 0, Clip and HardSigmoid beyond theirs):
#: clipping there changes nothing even where their output stays float (a float depthwise convolution reads it).
_EXACTLY_FLAT = ("HardSigmoid", "HardSwish", "Relu", "Clip")


@dataclass(frozen=True)
class Reading:
    """The activation reading a tensor: its kind, its quantized output and, for SiLU, its Sigmoid gate when that
    is quantized too (None otherwise)."""

    transfer: Transfer
    output: str
    gate: str | None = None


def reading_activation(graph: GraphHandle, tensor: str, quantized: dict[str, str]) -> Reading | None:
    """The activation every reader of ``tensor`` belongs to (module docstring), when that activation's output is
    quantized too (a tensor in ``quantized``): only then is "half a code of its output grid" free. Else None."""
    if graph.is_graph_output(tensor):
        return None
    readers = graph.consumers(tensor)
    if len(readers) == 1 and readers[0].op in _SINGLE and _first_input(readers[0]) == tensor:
        out = readers[0].outputs[0].name if readers[0].outputs else ""
        transfer = _single(graph, readers[0]) if out in quantized or readers[0].op in _EXACTLY_FLAT else None
        return Reading(transfer, out) if transfer is not None else None
    if len(readers) == 2:
        sig = next((r for r in readers if r.op == "Sigmoid"), None)
        mul = next((r for r in readers if r.op == "Mul"), None)
        if sig is None or mul is None or not sig.outputs or not mul.outputs or mul.outputs[0].name not in quantized:
            return None
        gate = sig.outputs[0].name
        names = sorted(t.name for t in mul.inputs)
        if names == sorted([tensor, gate]) and not graph.is_graph_output(gate) and _only_reader(graph, gate, mul):
            return Reading(Transfer("SiLU"), mul.outputs[0].name, gate if gate in quantized else None)
    return None


def _only_reader(graph: GraphHandle, tensor: str, node: gs.Node) -> bool:
    readers = graph.consumers(tensor)
    return len(readers) == 1 and readers[0] is node  # identity: graphsurgeon's Node.__eq__ compares whole nodes


def _first_input(node: gs.Node) -> str | None:
    return node.inputs[0].name if node.inputs else None


def _single(graph: GraphHandle, node: gs.Node) -> Transfer | None:
    attrs = node.attrs
    if node.op == "HardSigmoid":
        return Transfer("HardSigmoid", alpha=float(attrs.get("alpha", 0.2)), beta=float(attrs.get("beta", 0.5)))
    if node.op == "LeakyRelu":
        return Transfer("LeakyRelu", alpha=float(attrs.get("alpha", 0.01)))
    if node.op != "Clip":
        return Transfer(node.op)
    if "min" in attrs or "max" in attrs:  # opset < 11
        return Transfer("Clip", low=float(attrs.get("min", -np.inf)), high=float(attrs.get("max", np.inf)))
    bounds: list[float | None] = []
    for i in (1, 2):
        t = node.inputs[i] if len(node.inputs) > i else None
        if t is None or not t.name:
            bounds.append(None)
            continue
        value = graph.constant_value(t)
        if value is None or np.asarray(value).size != 1:
            return None  # bounds computed at run time: nothing to say about the range
        bounds.append(float(np.asarray(value).reshape(())))
    low, high = bounds
    return Transfer("Clip", low=-np.inf if low is None else low, high=np.inf if high is None else high)


def through_activations(
    graph: GraphHandle, plan: Plan, ranges: dict[str, RangeInfo], spec: QuantSpec, overridden: set[str],
) -> tuple[dict[str, RangeInfo], dict[str, ThroughChoice]]:
    """Ranges with the qualifying tensors clipped where their activation is flat to within a quarter of a code of the
    grid its output is quantized to (:func:`qgraph.calibrate.transfer.clip_flat`), and the changed choices by tensor.
    O(quantized tensors)."""
    members = Counter(plan.tensors.values())
    out = dict(ranges)
    chosen: dict[str, ThroughChoice] = {}
    for root, r in ranges.items():
        if members.get(root, 0) != 1 or plan.tensors.get(root) != root or root in overridden:
            continue
        reading = reading_activation(graph, root, plan.tensors)
        if reading is None:
            continue
        # an exactly flat activation with a float output: its bounds need no output grid (any grid will do)
        grid = _grid(ranges, plan.tensors[reading.output], spec) if reading.output in plan.tensors else (1.0, 0.0)
        gate = _grid(ranges, plan.tensors[reading.gate], spec) if reading.gate is not None else None
        choice = clip_flat((r.rmin, r.rmax), reading.transfer, spec, grid, gate)
        if choice.changed:
            out[root] = replace(r, rmin=choice.range[0], rmax=choice.range[1])
            chosen[root] = choice
    return out, chosen


def _grid(ranges: dict[str, RangeInfo], root: str, spec: QuantSpec) -> tuple[float, float]:
    """The (scale, zero point) insert_qdq will give a group's range on ``spec``'s grid."""
    r = ranges[root]
    scale, zp = compute_scale_zero_point(r.rmin, r.rmax, spec)
    return float(np.asarray(scale).ravel()[0]), float(np.asarray(zp).ravel()[0])


def through_details(chosen: dict[str, ThroughChoice]) -> dict[str, Any]:
    """JSON-ready ``tensor -> {activation, range, calibrated, finer}`` (how many times finer the step got)."""
    return {n: {"activation": c.transfer.describe(), "range": list(c.range), "calibrated": list(c.calibrated),
                "finer": round(c.finer, 3)} for n, c in chosen.items()}


def through_decision(chosen: dict[str, ThroughChoice]) -> str | None:
    """One line for the decisions: how many ranges were clipped before which activation, the largest clips."""
    if not chosen:
        return None
    kinds = ", ".join(f"{k} x{v}" for k, v in Counter(c.transfer.describe() for c in chosen.values()).most_common())
    top = sorted(chosen.items(), key=lambda kv: -kv[1].finer)[:SHOWN]
    shown = "; ".join(f"{n}: [{c.calibrated[0]:.3g}, {c.calibrated[1]:.3g}] -> [{c.range[0]:.3g}, {c.range[1]:.3g}] "
                      f"(step {c.finer:.1f}x finer)" for n, c in top)
    more = f" (+{len(chosen) - SHOWN} more in details)" if len(chosen) > SHOWN else ""
    return (f"through_activation: {len(chosen)} tensor(s) read only by an activation ({kinds}) are clipped where it "
            f"is within a quarter code of its limit: {shown}{more} (activations.through_activation: false keeps the "
            "calibrated ranges)")


def clip_flat_sides(graph: GraphHandle, plan: Plan, ranges: dict[str, RangeInfo], overridden: set[str],
                    options: ActivationOptions, details: dict[str, Any], res: PassResult) -> dict[str, RangeInfo]:
    """`through_activations` when ``options.through_activation`` is on, run on the final plan (which activations'
    outputs stay integer is known only after the joins, depthwise and latency decisions): the new ranges, the choices
    in ``details`` and the decision beside the calibration's other range decisions (the summary shows three)."""
    if not options.through_activation:
        return ranges
    spec = QuantSpec(dtype=options.dtype, symmetric=options.symmetric)
    ranges, chosen = through_activations(graph, plan, ranges, spec, overridden)
    if chosen:
        details["through_activation"] = through_details(chosen)
        at = next((i + 1 for i, d in enumerate(res.decisions) if d.startswith("calibration method")), 0)
        res.decisions.insert(at, str(through_decision(chosen)))
    return ranges
