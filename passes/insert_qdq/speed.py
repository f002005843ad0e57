"""Glue between a `Plan` and the latency decision (`latency.py`): unit costs, edges, and the report.

Costs per unit: measured (``latency: measure``: the unit's node plus the nodes it absorbed, as onnxruntime
profiled them in the float graph and in its all-int8 twin) or estimated from the cost table by the unit node's
`qgraph.runtime.latency.op_signature`; a unit the table has no kind for keeps int8 (today's behaviour) and is listed.
Edges follow each unit's activation inputs back through data-movement ops to the unit producing them (one
bounded walk per input, O(graph)); a unit whose output also feeds a float op gets an edge to "float".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from qgraph import GraphHandle, PassContext, PassError, select
from qgraph.data import batched
from qgraph.graph import Inferred, named_model, tensor_shape
from qgraph.runtime.latency import SHIPPED_TABLE, LatencyTable, load_latency_table, op_signature

from .latency import Cost, Decision, Edge, LatencyOptions, decide
from .ops import MOVEMENT
from .units import Plan, Unit, label

#: The cost table shipped with the pass (built by benchmarks/build_latency_table.py).
_MAX_WALK = 32  # movement ops between two units (a channel shuffle is 3)


@dataclass
class Measured:
    """Per node name: float and int8 kernel µs (profiles), and the per-element Q/DQ costs (ns)."""

    float_us: dict[str, float]
    int8_us: dict[str, float]
    q_ns: float
    dq_ns: float


@dataclass
class LatencyOutcome:
    """What the decision keeps float (node id -> reason), the summary line and the per-unit details."""

    float_nodes: dict[int, str] = field(default_factory=dict)
    decisions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    priced: Priced | None = None  # the costs the decision was made with, and its labels (True: int8)
    labels: list[bool] | None = None


class CostModel:
    """Unit and movement-node costs from a measurement and/or the table of ``preset``."""

    def __init__(self, graph: GraphHandle, preset: str | None, table: LatencyTable | None, measured: Measured | None,
                 shapes: Inferred | None = None):
        self.g, self.preset, self.table, self.measured = graph, preset, table, measured
        self.shapes = graph.shapes() if shapes is None else shapes
        pt = table.presets.get(preset or "") if table is not None else None
        if measured is not None:
            self.q_ns, self.dq_ns = measured.q_ns, measured.dq_ns
        elif pt is not None:
            self.q_ns, self.dq_ns = pt.quantize_ns, pt.dequantize_ns
        else:
            self.q_ns = self.dq_ns = 0.0

    def elements(self, t: gs.Tensor) -> int:
        """Number of elements of ``t`` (0 when unknown: no conversion cost is charged then)."""
        shape = tensor_shape(t, self.shapes)
        if not shape or any(d is None for d in shape):
            return 0
        n = 1
        for d in shape:
            n *= int(d or 0)
        return n

    def signature(self, node: gs.Node) -> tuple[str, str, float] | None:
        """`qgraph.runtime.latency.op_signature` of ``node`` from the inferred shapes and its constant weight."""
        w = node.inputs[1] if node.op in ("Conv", "ConvTranspose", "Gemm", "MatMul") and len(node.inputs) > 1 else None
        wv = self.g.constant_value(w) if w is not None and w.name else None
        return op_signature(node.op, node.attrs, tensor_shape(node.outputs[0], self.shapes),
                            None if wv is None else tuple(wv.shape))

    def node(self, node: gs.Node, nodes: list[gs.Node]) -> Cost | None:
        """Cost of ``node`` with the ``nodes`` fused into it (measured when profiled, else from the table)."""
        m = self.measured
        if m is not None:
            f, q = _attributed(m.float_us, nodes), _attributed(m.int8_us, nodes)
            if f is not None and q is not None:
                return Cost(q, f, "measured")
        sig = self.signature(node) if self.table is not None else None
        if sig is None or self.table is None:
            return None
        est = self.table.estimate(self.preset or "", *sig)
        return None if est is None else Cost(est[1], est[0], f"table: {est[2]}")


def _attributed(profile: dict[str, float], nodes: list[gs.Node]) -> float | None:
    """Kernel time of ``nodes`` in ``profile``: by node name, else by output tensor name (onnxruntime names some
    fused kernels after their output, e.g. NCHWc Conv+Relu); None when no node was found."""
    total, found = 0.0, False
    for n in nodes:
        key = label(n)
        if key not in profile and n.outputs and n.outputs[0].name in profile:
            key = n.outputs[0].name
        if key in profile:
            total, found = total + profile[key], True
    return total if found else None


#: Float ops whose kernel speed depends on the memory layout onnxruntime gives them: an int8 Conv after one (run
#: in NHWC) makes the layout optimizer move transposes through it. On YOLOv8n the DFL's Softmax(axis=1) runs in
#: 4.6-5.2 ms before a float Conv and 0.55 ms before an int8 one, an effect no per-unit cost can hold.
LAYOUT_SENSITIVE = frozenset({"Softmax", "LogSoftmax", "Hardmax"})


def _blind(graph: GraphHandle, units: list[Unit]) -> dict[int, str]:
    """Conv units whose input comes (through data-movement ops) from a `LAYOUT_SENSITIVE` float op: the cost model
    cannot see what their label does to it, so they keep int8 like units of unknown cost (O(units x walk))."""
    idx, out = graph.index, {}
    for i, u in enumerate(units):
        if u.node.op != "Conv" or not u.act_inputs:
            continue
        cur, steps = u.act_inputs[0], 0
        while steps < _MAX_WALK:
            prod = idx.producer.get(cur)
            if prod is None or not prod.inputs:
                break
            if prod.op in LAYOUT_SENSITIVE:
                out[i] = (f"fed by {prod.op} {label(prod)!r}, whose speed depends on the layout an int8 Conv gives it "
                          "(not in the cost table): kept int8")
                break
            if prod.op not in MOVEMENT:
                break
            cur, steps = prod.inputs[0].name, steps + 1
    return out


def _edges(
    graph: GraphHandle, units: list[Unit], model: CostModel
) -> tuple[list[Edge], dict[int, list[int]]]:
    """The edges between units (see module docs) and, per Conv/ConvTranspose/Gemm unit, the units producing its
    input (what onnxruntime's WeightBiasQuantization looks at, `latency.decide`)."""
    idx = graph.index
    requant: dict[int, list[int]] = {}
    unit_of = {u.output: i for i, u in enumerate(units) if u.output}
    unit_nodes = {id(u.node) for u in units}
    edges: list[Edge] = []
    for i, u in enumerate(units):
        for t in u.act_inputs:
            moved: list[gs.Node] = []
            cur = t
            while cur not in unit_of and len(moved) < _MAX_WALK:
                prod = idx.producer.get(cur)
                if prod is None or prod.op not in MOVEMENT or not prod.inputs:
                    break
                moved.append(prod)
                cur = prod.inputs[0].name
            n = model.elements(idx.tensors[t]) if t in idx.tensors else 0
            e = Edge(unit_of.get(cur), i, q_us=model.q_ns * n / 1e3, dq_us=model.dq_ns * n / 1e3)
            for mv in moved:
                c = model.node(mv, [mv])
                if c is not None:
                    e.float_us += c.float_us
                    e.int8_us += c.int8_us
            edges.append(e)
            if u.node.op in ("Conv", "ConvTranspose", "Gemm") and e.src is not None:
                requant.setdefault(i, []).append(e.src)
        out = u.output
        cons = idx.consumers.get(out or "", [])
        if out and (out in idx.graph_outputs or any(id(c) not in unit_nodes and c.op not in MOVEMENT for c in cons)):
            n = model.elements(idx.tensors[out])
            edges.append(Edge(i, None, q_us=model.q_ns * n / 1e3, dq_us=model.dq_ns * n / 1e3))
    return edges, requant


@dataclass
class Priced:
    """The plan's non-dynamic units with their costs (None: unknown), the edges between them, the Conv/Gemm units'
    producers (`latency.decide`'s ``requant``) and the units the recipe forces int8."""

    units: list[Unit]
    costs: list[Cost | None]
    edges: list[Edge]
    requant: dict[int, list[int]]
    forced: set[int]
    model: CostModel
    blind: dict[int, str] = field(default_factory=dict)  # units kept int8: a neighbour's cost depends on them
    #: Set when another preset's costs stand in for this one's (`COST_PROXIES`): the decision line says so.
    proxy: str = ""


#: Presets priced with another preset's costs when the table has none of their own, and why that stands in.
COST_PROXIES: dict[str, tuple[str, str]] = {
    "ort-x86-avx2": ("ort-x86-vnni", "no AVX2 costs are shipped; int8 is relatively slower on AVX2, so a close call "
                     "may be faster float there: build AVX2 costs with benchmarks/build_latency_table.py"),
}


def price(graph: GraphHandle, plan: Plan, opts: LatencyOptions, preset: str | None, measured: Measured | None,
          shapes: Inferred | None = None) -> Priced | str:
    """Cost every unit of ``plan`` and its edges (module docs), or why it cannot (the table has no such preset)."""
    table = load_latency_table(opts.table or SHIPPED_TABLE)
    proxy = ""
    if measured is None and preset not in table.presets and preset in COST_PROXIES \
            and COST_PROXIES[preset][0] in table.presets:
        stand_in, why = COST_PROXIES[preset]
        proxy = f"latency (table): the {stand_in} costs stand in for {preset} ({why})"
        preset = stand_in
    if measured is None and preset not in table.presets:
        return (f"latency: table has no costs for preset {preset!r} (it has {sorted(table.presets)}); every unit "
                "stays int8. Build one with benchmarks/build_latency_table.py or use `latency: {mode: measure}`.")
    units = [u for u in plan.units if u.kind != "dynamic"]
    model = CostModel(graph, preset, table, measured, shapes)
    costs = [model.node(u.node, [u.node, *u.absorbed]) for u in units]
    edges, requant = _edges(graph, units, model)
    forced: set[int] = set()
    if opts.force is not None:
        chosen = {id(n) for n in select(graph, opts.force).nodes}
        forced = {i for i, u in enumerate(units) if id(u.node) in chosen}
    blind = _blind(graph, units)
    return Priced(units, costs, edges, requant, forced | set(blind), model, blind, proxy)


def latency_decision(
    graph: GraphHandle, plan: Plan, opts: LatencyOptions, preset: str | None, measured: Measured | None,
    shapes: Inferred | None = None,
) -> LatencyOutcome:
    """Decide which units stay float for speed (see `latency.py`); ``measured`` is None in table mode;
    ``shapes``: tensor shapes to cost with (default: the graph's own, `GraphHandle.shapes`)."""
    out = LatencyOutcome()
    p = price(graph, plan, opts, preset, measured, shapes)
    if isinstance(p, str):
        out.notes.append(p)
        return out
    d = decide(p.costs, p.edges, p.forced, p.requant)
    if p.proxy:
        out.decisions.append(p.proxy)
    _report(out, p, d, opts.mode if measured is not None else "table")
    out.priced, out.labels = p, list(d.int8)
    return out


def baseline(graph: GraphHandle, plan: Plan, opts: LatencyOptions, preset: str | None,
             shapes: Inferred | None) -> tuple[Priced | str, list[bool]]:
    """Table costs of ``plan`` and the labels the latency decision gives them (``latency: off``: every unit int8;
    ``measure``: the table stands in, no profiling), for a choice made before the reported decision
    (`depthwise.py`); a string says why nothing could be priced."""
    table = LatencyOptions(mode="table", table=opts.table, force=opts.force)
    out = LatencyOutcome() if opts.mode == "off" else latency_decision(graph, plan, table, preset, None, shapes)
    priced = out.priced or price(graph, plan, table, preset, None, shapes)
    return priced, out.labels or [True] * (0 if isinstance(priced, str) else len(priced.units))


def _report(out: LatencyOutcome, p: Priced, d: Decision, mode: str) -> None:
    units, costs, edges, forced, model = p.units, p.costs, p.edges, p.forced, p.model
    rows = []
    for i, u in enumerate(units):
        c = costs[i]
        q, f = d.local[i]
        rows.append({"node": label(u.node), "op": u.node.op, "decision": "int8" if d.int8[i] else "float",
                     "int8_us": None if c is None else round(c.int8_us, 2),
                     "float_us": None if c is None else round(c.float_us, 2),
                     "int8_with_conversions_us": round(q, 2), "float_with_conversions_us": round(f, 2),
                     "source": "unknown (kept int8)" if c is None else c.source, "forced": i in forced,
                     **({"blind": p.blind[i]} if i in p.blind else {})})
        if not d.int8[i] and c is not None:
            out.float_nodes[id(u.node)] = (
                f"kept float for speed ({mode}): int8 {q:.0f} µs vs float {f:.0f} µs with its Q/DQ conversions and "
                f"data movement (op alone: int8 {c.int8_us:.0f} µs, float {c.float_us:.0f} µs; {c.source})")
    all_int8 = Decision([True] * len(units), []).total(costs, edges)
    all_float = Decision([False] * len(units), []).total(costs, edges)
    chosen = d.total(costs, edges)
    kept = len(out.float_nodes)
    unknown = sum(c is None for c in costs)
    out.decisions.append(
        f"latency ({mode}): {kept} of {len(units)} quantizable units kept float for speed; modelled time all-int8 "
        f"{all_int8 / 1e3:.2f} ms -> chosen {chosen / 1e3:.2f} ms (all float {all_float / 1e3:.2f} ms)"
        + (f"; {unknown} units without a known cost stay int8" if unknown else "")
        + "".join(f"; {label(units[i].node)} {why}" for i, why in sorted(p.blind.items())[:3]))
    out.details = {"mode": mode, "quantize_ns_per_element": model.q_ns, "dequantize_ns_per_element": model.dq_ns,
                   "modelled_all_int8_us": round(all_int8, 1), "modelled_chosen_us": round(chosen, 1),
                   "modelled_all_float_us": round(all_float, 1), "units": rows}


def require_preset(opts: LatencyOptions, preset: str | None) -> None:
    """``latency: table`` looks costs up by preset: without one (and without a custom table) it cannot decide."""
    if opts.mode == "table" and preset is None:
        raise PassError("insert_qdq: `latency: {mode: table}` looks costs up by preset; set `preset:` or use "
                        "`latency: {mode: measure}` (or `off`).")


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every node named by qgraph's rule (`qgraph.graph.naming`, the names `label` gives) so
    profiles can be attributed (a model exported from a `GraphHandle` already is)."""
    return named_model(model)[0]


def first_sample(ctx: PassContext) -> dict[str, np.ndarray] | None:
    """The first calibration sample (batch of one), or None without calibration data."""
    if ctx.calibration_data is None:
        return None
    return next(iter(batched(ctx.calibration_data, 1)), None)


def sample_shapes(graph: GraphHandle, ctx: PassContext) -> tuple[Inferred | None, str | None]:
    """Tensor shapes for the cost model when the graph has inputs of no fixed size: inferred with the inputs
    of the first calibration sample (the sizes the model will be calibrated, and presumably run, at), and the
    decision saying so. ``(None, None)`` when every input is static or there is no calibration data (units
    without a known size then have no cost and stay int8, as before)."""
    dynamic = graph.dynamic_inputs()
    first = first_sample(ctx) if dynamic else None
    if first is None:
        return None, None
    dims = {name: tuple(int(d) for d in np.shape(first[name])) for name in dynamic if name in first}
    if not dims:
        return None, None
    shown = ", ".join(f"{k} {list(v)}" for k, v in dims.items())
    return graph.shapes_for(dims), (
        f"latency: {'input' if len(dims) == 1 else 'inputs'} {', '.join(dims)} "
        f"{'has' if len(dims) == 1 else 'have'} dynamic dimensions; units are costed at the first calibration "
        f"sample's shapes ({shown})"
    )


def measure_twin(graph: GraphHandle, twin: onnx.ModelProto, opts: LatencyOptions,
                 sample: dict[str, np.ndarray] | None = None) -> Measured:
    """Profile the float ``graph`` (nodes named as `name_nodes` does) and its all-int8 ``twin`` alternately in
    onnxruntime (bounded by ``opts.measure_seconds``), plus this host's Q/DQ costs. On ``sample`` (the first
    calibration sample: the sizes the model runs at) when it feeds every input; else on seeded random inputs, whose
    dynamic dimensions are 1 (a detector's ``[1, 3, H, W]`` image would then be 1x1)."""
    from qgraph.runtime.compare import random_feeds
    from qgraph.runtime.latency import element_costs, profile_kernels

    model = name_nodes(graph.to_onnx())
    names = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    if sample is not None and all(n in sample for n in names):
        feeds = {n: np.asarray(sample[n]) for n in names}
    else:
        feeds = random_feeds(model, 1)[0]
    prof = profile_kernels({"float": model, "int8": twin}, feeds, runs=opts.runs,
                           budget_seconds=opts.measure_seconds)
    q_ns, dq_ns = element_costs()
    return Measured(prof["float"], prof["int8"], q_ns, dq_ns)
