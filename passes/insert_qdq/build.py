"""Emit a `Plan` into a graph: weights, biases and constant operands quantized, one Q/DQ pair per activation group.

Shared by the pass itself and by the latency check (`latency_check.py`), which emits alternative plans into
copies of the graph to time them: the same code builds what is timed and what is written.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from qgraph import GraphHandle
from qgraph.quant.math import QuantSpec, compute_scale_zero_point

from .calib import RangeInfo
from .config import InsertQDQConfig
from .dynamic import DynamicQuantizer
from .emit import ActParams, insert_activation_qdq
from .pairsafe import ChannelCodes
from .units import Plan, Unit
from .weights import Emitter, WeightQuantizer


@dataclass
class Emitted:
    """What emitting a plan created: the emitter (its new nodes), the weight and dynamic quantizers."""

    em: Emitter
    weights: WeightQuantizer
    dynamic: DynamicQuantizer


def activation_params(cfg: InsertQDQConfig, plan: Plan, ranges: dict[str, RangeInfo]) -> dict[str, ActParams]:
    """Scale and zero point of every activation group of ``plan`` from its calibrated range (vectorized)."""
    spec = QuantSpec(dtype=cfg.activations.dtype, symmetric=cfg.activations.symmetric)
    roots = plan.roots
    lo = np.array([ranges[r].rmin for r in roots], np.float64)
    hi = np.array([ranges[r].rmax for r in roots], np.float64)
    scales, zps = compute_scale_zero_point(lo, hi, spec)
    return {
        root: ActParams(float(scales[i]), int(zps[i]), spec.dtype, float(lo[i]), float(hi[i]))
        for i, root in enumerate(roots)
    }


def input_scale(plan: Plan, params: dict[str, ActParams], unit: Unit) -> float | None:
    """The activation scale of ``unit``'s first input (None when it is not quantized)."""
    act = params.get(plan.tensors.get(unit.act_inputs[0], "")) if unit.act_inputs else None
    return act.scale if act is not None else None


def emit_plan(graph: GraphHandle, cfg: InsertQDQConfig, wspec: QuantSpec, plan: Plan,
              params: dict[str, ActParams], codes: dict[str, ChannelCodes] | None = None) -> Emitted:
    """Quantize every unit of ``plan`` in ``graph`` (weights with ``wspec``, activations with ``params``); top-level
    graph only (bodies are the pass's own business). ``codes``: `saturation.channel_codes` of the layer inputs,
    which bound ``saturation: avoid``'s pairs (`pairsafe`)."""
    em = Emitter(graph)
    wq = WeightQuantizer(em, wspec, cfg.weights.format, cfg.activations.dtype, cfg.bias)
    wq.auto_symmetric, wq.asym_gain = cfg.weights.symmetric == "auto", cfg.weights.asymmetric_gain
    dyn = DynamicQuantizer(em, wspec.model_copy(update={"per_channel": cfg.weights.per_channel}))
    dyn.auto_symmetric, dyn.asym_gain = wq.auto_symmetric, wq.asym_gain
    wq.pair_safe = dyn.pair_safe = cfg.saturation == "avoid"
    wq.input_codes = dict(codes or {})
    scale = functools.partial(input_scale, plan, params)
    wq.prepare([(u, scale(u)) for u in plan.units if u.kind == "weighted"])
    for unit in plan.units:
        if unit.kind == "dynamic":
            dyn.unit(unit, graph.graph)
            continue
        if unit.node.op == "Sum":  # two-input Sum (old exporters' residual add): Add has a QLinear kernel
            unit.node.op = "Add"
        wq.unit(unit, scale(unit))
        for i in unit.const_inputs:
            wq.constant_operand(unit.node, i)
    insert_activation_qdq(em, plan, params)
    return Emitted(em, wq, dyn)
