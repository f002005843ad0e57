"""``depthwise: auto``: keep a depthwise Conv float only where its per-tensor input scale measurably costs accuracy
and float does not make the model slower.

**Accuracy criterion** (from the calibration pass that ranges the activations: the per-channel observed
``[lo_c, hi_c]`` of every depthwise input are collected alongside, `calib.calibrate` ``channel_axes``). A depthwise
Conv with weight ``W`` of shape ``[C·m, 1, kh, kw]`` reads input channel ``c`` only in its ``m`` outputs
``o = c·m .. c·m+m−1``. Rounding the input to a grid of step ``Δ`` adds independent noise of variance ``Δ²/12`` per
element, which reaches output ``o`` with variance ``Δ²/12 · Σ_k W_ok²`` (sum over the kernel taps). One per-tensor
range ``R`` gives every channel ``Δ = R / (2^b − 1)``; per-channel ranges ``R_c`` would give ``Δ_c = R_c / (2^b − 1)``.
The output signal is the same either way, so the output SQNR the per-tensor scale loses against ideal per-channel
scales is

    loss_dB = 10 · log10( Σ_c e_c · R² / Σ_c e_c · R_c² ),    e_c = Σ_{o reads c} Σ_k W_ok²

with ``R_c = max(hi_c, 0) − min(lo_c, 0)`` and ``R = max_c hi_c − min_c lo_c`` (asymmetric grids, ranges holding 0),
or ``R_c = 2·max(|lo_c|, |hi_c|)``, ``R = max_c R_c`` (symmetric). 0 dB when all channels share one range;
``10·log10(C)`` when one channel spans the range and the others are ~0. A unit is a candidate when
``loss_dB >= min_loss_db``.

**Latency criterion** (the latency model of `latency.py`/`speed.py`, no second cost model). Starting from the
labels the table-based latency decision gives the plan (`speed.baseline`; all int8 under ``latency: off``; the
table also stands in under ``latency: measure``), candidates are tried in order of decreasing
loss; flipping unit ``i`` to float changes the modelled time by ``local_i(float) − local_i(int8)`` (its own cost
plus its edges with the neighbours' labels: a float depthwise conv between int8 convs costs a DequantizeLinear on
its input and a QuantizeLinear on its output; one after a float producer saves the Q and DQ instead). A flip is
kept while the modelled total stays within ``max_latency_growth`` x the starting total. A candidate stays int8 when
the table cannot price it (a kernel size the table never measured, e.g. PicoDet's 5x5, is priced from the nearest
measured depthwise kernel, scaled by MACs as every table estimate is), or when its input comes from an int8 unit:
onnxruntime quantizes a float Conv that reads a DequantizeLinear itself (WeightBiasQuantization, per-tensor
weights) and fuses it, so it would not run float (measured: a depthwise conv after Conv+Relu, MobileNetV2-style).
When at least one conv went float that the latency decision keeps int8, every float-labelled candidate is fixed
float (as ``depthwise: float`` leaves them: an Add feeding only them stops being integer-fed) and the recipe's own
latency decision runs on that plan, re-labelling their neighbours (e.g. a pointwise conv whose only reader went
float); otherwise the plan is left to the latency decision alone, exactly as with ``depthwise: int8``.
Cost: O(units + edges) after one sort of the candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from qgraph import GraphHandle

from .config import DepthwiseAutoOptions
from .latency import Cost
from .units import is_depthwise

if TYPE_CHECKING:
    import onnx_graphsurgeon as gs

    from .latency import Edge
    from .speed import Priced
    from .units import Unit


def spread_loss(lo: np.ndarray, hi: np.ndarray, w: np.ndarray, symmetric: bool) -> tuple[float, float]:
    """``(loss_dB, spread)`` of one depthwise input (module docs): the SQNR loss of its per-tensor scale and the
    ratio of the widest to the median channel range."""
    lo, hi = np.minimum(lo.astype(np.float64), 0.0), np.maximum(hi.astype(np.float64), 0.0)
    if symmetric:
        rc = 2.0 * np.maximum(-lo, hi)
        r = float(rc.max(initial=0.0))
    else:
        rc = hi - lo
        r = float(hi.max(initial=0.0) - lo.min(initial=0.0))
    c = rc.size
    e = np.square(w.astype(np.float64)).reshape(w.shape[0], -1).sum(axis=1)
    if c == 0 or e.size % c:
        return 0.0, 1.0
    e = e.reshape(c, -1).sum(axis=1)  # outputs c·m .. c·m+m-1 read channel c
    ideal = float(np.sum(e * rc**2))
    median = float(np.median(rc))
    spread = r / median if median > 0 else math.inf
    if ideal <= 0.0 or r <= 0.0:
        return 0.0, spread
    return 10.0 * math.log10(float(np.sum(e)) * r * r / ideal), spread


def depthwise_units(graph: GraphHandle, units: list[Unit]) -> list[Unit]:
    """The weighted units of ``units`` that are depthwise convs."""
    return [u for u in units if u.kind == "weighted" and is_depthwise(u.node, graph.constant_value(u.node.inputs[1]))]


def candidates(graph: GraphHandle, units: list[Unit], channels: dict[str, tuple[np.ndarray, np.ndarray]],
               symmetric: bool) -> list[Candidate]:
    """Every depthwise unit whose input has per-channel ranges, with its loss and spread (`spread_loss`)."""
    out = []
    for u in depthwise_units(graph, units):
        got = channels.get(u.act_inputs[0])
        w = graph.constant_value(u.node.inputs[1])
        if got is not None and w is not None:
            out.append(Candidate(u, _name(u.node), *spread_loss(got[0], got[1], w, symmetric)))
    return out


@dataclass
class DepthwiseOutcome:
    """Depthwise convs kept float (node id -> reason), one decision line per depthwise conv, and the details."""

    float_nodes: dict[int, str] = field(default_factory=dict)
    decisions: list[str] = field(default_factory=list)
    details: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Candidate:
    """A depthwise unit with its measured loss and spread."""

    unit: Unit
    name: str
    loss_db: float
    spread: float


def decide_depthwise(cands: list[Candidate], opts: DepthwiseAutoOptions, priced: Priced | str,
                     labels: list[bool]) -> DepthwiseOutcome:
    """Which ``cands`` stay float (module docs); ``labels``: the latency decision's (True: int8), per priced unit."""
    out = DepthwiseOutcome()
    index = {} if isinstance(priced, str) else {id(u.node): i for i, u in enumerate(priced.units)}
    incident: list[list[Edge]] = [[] for _ in labels]
    if not isinstance(priced, str):
        for e in priced.edges:
            for end in {e.src, e.dst}:
                if end is not None:
                    incident[end].append(e)
    labels, orig = list(labels), labels
    if not isinstance(priced, str):
        costs = list(priced.costs)
        for cand in cands:
            i = index.get(id(cand.unit.node))
            if i is not None and costs[i] is None:
                costs[i] = other_kernel_cost(priced, cand.unit.node)
        priced = replace(priced, costs=costs)
    base = 0.0 if isinstance(priced, str) else _energy(labels, priced)
    total = base
    for cand in sorted(cands, key=lambda c: -c.loss_db):
        measured = f"channel ranges up to {cand.spread:.1f}x the median, per-tensor scale loses {cand.loss_db:.1f} dB"
        i = index.get(id(cand.unit.node))
        keep, why = True, ""
        if cand.loss_db < opts.min_loss_db:  # the common case: details only, counted in the summary
            out.details.append({"node": cand.name, "decision": "int8", "loss_db": round(cand.loss_db, 2),
                                "spread": round(cand.spread, 2), "why": f"below min_loss_db {opts.min_loss_db:g}"})
            continue
        if isinstance(priced, str) or i is None or priced.costs[i] is None:
            why = "the latency table cannot price it"
            why += f" ({priced.split(';')[0]})" if isinstance(priced, str) else ""
        elif not labels[i]:
            keep, why = False, "float for speed too (the latency table)"
        else:
            src = next((e.src for e in incident[i] if e.dst == i and e.src is not None and labels[e.src]), None)
            if src is not None:
                why = (f"its input comes from int8 {_name(priced.units[src].node)}: onnxruntime would quantize a float "
                       "Conv reading a DequantizeLinear itself (per-tensor weights)")
            else:
                delta = _local(i, False, labels, priced, incident) - _local(i, True, labels, priced, incident)
                if total + delta <= base * (1.0 + opts.max_latency_growth):
                    keep, total, labels[i] = False, total + delta, False
                    why = f"modelled latency {delta:+.1f} µs (model {base / 1e3:.2f} -> {total / 1e3:.2f} ms)"
                else:
                    why = (f"float would add {delta:.1f} µs to the modelled {base / 1e3:.2f} ms (over "
                           f"max_latency_growth {opts.max_latency_growth:g})")
        line = f"depthwise auto: {cand.name} kept {'int8' if keep else 'float'}: {measured}; {why}"
        out.decisions.append(line)
        if not keep:  # fixed float (even where the latency decision agrees), as `depthwise: float` would leave it
            out.float_nodes[id(cand.unit.node)] = f"kept float (depthwise: auto): {measured}; {why}"
        out.details.append({"node": cand.name, "decision": "int8" if keep else "float",
                            "loss_db": round(cand.loss_db, 2), "spread": round(cand.spread, 2), "why": why})
    kept = sum(d["decision"] == "float" for d in out.details)
    low = sum(d["why"].startswith("below") for d in out.details)
    flipped = any(i is not None and not labels[i] and orig[i] for i in (index.get(id(c.unit.node)) for c in cands))
    out.decisions.insert(0, f"depthwise auto: {kept} of {len(cands)} depthwise convs float ({low} below "
                         f"min_loss_db {opts.min_loss_db:g} dB stay int8); modelled latency {base / 1e3:.2f} -> "
                         f"{total / 1e3:.2f} ms" + ("" if flipped else "; none beyond the latency decision's: "
                                                    "the plan is left to it"))
    if not flipped:  # nothing to fix: the recipe's latency decision alone gives the same labels
        out.float_nodes.clear()
    return out


def other_kernel_cost(priced: Priced, node: gs.Node) -> Cost | None:
    """A depthwise conv whose kernel size the table never measured (e.g. 5x5), priced from the measured depthwise
    kernel nearest in size, scaled by MACs like any table estimate (`qgraph.runtime.latency.LatencyTable.estimate`)."""
    m = priced.model
    sig = m.signature(node) if m.table is not None else None
    if sig is None or m.table is None:
        return None
    kind, bucket, work = sig
    area = math.prod(int(k) for k in kind.rsplit("/", 1)[-1].split("x"))
    known = {e.kind for e in m.table.presets[m.preset or ""].entries if e.kind.startswith("Conv/depthwise/")}
    for other in sorted(known, key=lambda k: abs(math.log(math.prod(int(x) for x in k.rsplit("/", 1)[-1].split("x"))
                                                             / area))):
        est = m.table.estimate(m.preset or "", other, bucket, work)
        if est is not None:
            return Cost(est[1], est[0], f"table: {est[2]}, scaled by MACs to {kind}")
    return None


def _name(node: gs.Node) -> str:
    return str(node.name) if node.name else f"{node.op}({node.outputs[0].name if node.outputs else ''})"


def _edge_cost(e: Edge, labels: list[bool]) -> float:
    return e.cost(False if e.src is None else labels[e.src], False if e.dst is None else labels[e.dst])


def _energy(labels: list[bool], priced: Priced) -> float:
    own = sum((c.int8_us if labels[i] else c.float_us) for i, c in enumerate(priced.costs) if c is not None)
    return own + sum(_edge_cost(e, labels) for e in priced.edges)


def _local(i: int, label: bool, labels: list[bool], priced: Priced, incident: list[list[Edge]]) -> float:
    """Unit ``i``'s own cost with ``label`` plus its edges' costs, the neighbours' labels fixed."""
    saved, labels[i] = labels[i], label
    c = priced.costs[i]
    own = 0.0 if c is None else (c.int8_us if label else c.float_us)
    own += sum(_edge_cost(e, labels) for e in incident[i])
    labels[i] = saved
    return own
