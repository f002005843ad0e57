"""Latency-aware placement: keep a unit float where INT8 would make the model slower on the target runtime.

Every quantizable unit ``u`` has an int8 and a float cost (µs, `qgraph.runtime.latency`: from the shipped per-preset
table, or measured in the graph with ``latency: measure``). Every edge ``p -> c`` (a tensor from unit ``p``,
possibly through data-movement ops, to unit ``c``; ``p`` or ``c`` is "float" outside the units) costs, by labels:

* both int8: the movement ops' int8 time (in onnxruntime's NHWC layout: a channel shuffle is slow there);
* both float: the movement ops' float time;
* float -> int8: float-layout movement (measured float time) + a QuantizeLinear (``q_ns x elements``);
* int8 -> float: the int8 movement (onnxruntime pushes the int8 producer's NHWC layout through it) + a
  DequantizeLinear (``dq_ns x elements``).

The labelling minimizes ``sum_u cost_u(label_u) + sum_e cost_e(label_p, label_c)``: start from each unit's
cheaper label, then sweep the units in graph order setting each to the label with the lower local cost (its own
cost plus its edges given the neighbours' labels) until nothing changes (at most 8 sweeps, each O(units +
edges)); finally each connected component is compared with the same component all float. Forced units (recipe
``latency.force``, or ``latency: off``) and units without a known cost stay int8. So a unit stays int8 only where
int8, conversions included, is not slower; each unit kept float is reported with its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from qgraph import NodeSelector, PassConfig

Label = bool  # True: int8


class LatencyOptions(PassConfig):
    """Whether a unit is quantized also depends on what the target runtime executes faster."""

    mode: Literal["off", "table", "measure"] = Field(
        default="off",
        description="off: quantize every quantizable unit (no latency decision); table: decide per unit from the "
        "shipped per-preset cost table (measured on the host that built it, see benchmarks/build_latency_table.py); "
        "measure: profile the float graph and its all-int8 twin in onnxruntime on this host (bounded by "
        "measure_seconds) and decide from those numbers.",
    )
    force: NodeSelector | None = Field(
        default=None, description="Nodes that stay int8 whatever their cost (e.g. {op_types: [Conv]})."
    )
    table: str | None = Field(
        default=None, description="A cost table file to use instead of the shipped one (same JSON format)."
    )
    measure_seconds: float = Field(
        default=20.0, gt=0, le=600, description="Time budget of the profiling runs in measure mode."
    )
    runs: int = Field(default=10, ge=1, le=200, description="Profiling rounds in measure mode (median per node).")
    check: bool = Field(
        default=False,
        description="When the decision keeps units float, time the model as decided against the same model all "
        "int8 on this host (onnxruntime, one calibration sample) and quantize the float units after all where "
        "all-int8 is faster by more than check_margin (the cost model cannot see a unit's effect on the ops around "
        "it). Host-dependent, so asked for explicitly, like `mode: measure`; skipped when the recipe declares a "
        "target CPU this host is not. false: the modelled decision alone (the same file on any machine).",
    )
    check_margin: float = Field(
        default=0.05, ge=0, le=0.5, description="How much faster (fraction) all-int8 must run to overrule the model."
    )
    check_seconds: float = Field(default=20.0, gt=0, le=600, description="Time budget of the check's timing runs.")


@dataclass
class Cost:
    """A unit's cost in µs and where the numbers come from."""

    int8_us: float
    float_us: float
    source: str


@dataclass
class Edge:
    """A tensor from unit ``src`` to unit ``dst`` (None: a float producer/consumer outside the units)."""

    src: int | None
    dst: int | None
    float_us: float = 0.0  # movement ops on the way, float
    int8_us: float = 0.0  # the same ops on integers (in the int8 region's layout)
    q_us: float = 0.0  # QuantizeLinear of the tensor
    dq_us: float = 0.0  # DequantizeLinear of the tensor

    def cost(self, src: Label, dst: Label) -> float:
        """The edge's cost for the labels at its ends (see module docs)."""
        if src and dst:
            return self.int8_us
        if not src and not dst:
            return self.float_us
        return self.int8_us + self.dq_us if src else self.float_us + self.q_us


@dataclass
class Decision:
    """The label of every unit and, per unit, the local cost of each label at the optimum."""

    int8: list[Label]
    local: list[tuple[float, float]]  # (int8 µs, float µs) including edges, neighbours fixed

    def total(self, costs: list[Cost | None], edges: list[Edge]) -> float:
        """The modelled latency of the whole labelling (µs)."""
        return _energy(self.int8, costs, edges)


def _label(labels: list[Label], i: int | None) -> Label:
    return False if i is None else labels[i]


def _energy(labels: list[Label], costs: list[Cost | None], edges: list[Edge]) -> float:
    total = sum((c.int8_us if labels[i] else c.float_us) for i, c in enumerate(costs) if c is not None)
    return total + sum(e.cost(_label(labels, e.src), _label(labels, e.dst)) for e in edges)


def decide(
    costs: list[Cost | None],
    edges: list[Edge],
    forced: set[int],
    requant: dict[int, list[int]] | None = None,
    max_sweeps: int = 8,
) -> Decision:
    """Label every unit int8 (True) or float (False), minimizing the modelled latency (see module docs).

    ``requant`` maps a Conv/Gemm unit to the units producing its input: onnxruntime's WeightBiasQuantization
    quantizes a float Conv/Gemm whose input comes from a DequantizeLinear and whose output leads (through
    Relu/Clip only) to a QuantizeLinear, so such a unit cannot stay float while a producer is int8 and its one
    consumer is int8: either it is int8, or its int8 producers become float too (whichever costs less)."""
    n = len(costs)
    fixed = set(forced) | {i for i, c in enumerate(costs) if c is None}
    labels = [i in fixed or (c is not None and c.int8_us <= c.float_us) for i, c in enumerate(costs)]
    incident: list[list[Edge]] = [[] for _ in range(n)]
    for e in edges:
        for end in {e.src, e.dst}:
            if end is not None:
                incident[end].append(e)

    def local(i: int, label: Label) -> float:
        c = costs[i]
        own = 0.0 if c is None else (c.int8_us if label else c.float_us)
        saved = labels[i]
        labels[i] = label
        own += sum(e.cost(_label(labels, e.src), _label(labels, e.dst)) for e in incident[i])
        labels[i] = saved
        return own

    def sweep() -> bool:
        moved = False
        for i in range(n):
            if i in fixed:
                continue
            best = local(i, True) <= local(i, False)
            moved |= best != labels[i]
            labels[i] = best
        return moved

    for _ in range(max_sweeps):
        if not sweep():
            break
    if _all_float_components(labels, costs, edges, fixed):
        for _ in range(max_sweeps):
            if not sweep():
                break
    if requant:
        labels = _honour_requantization(labels, requant, costs, incident, fixed, max_sweeps)
    return Decision(labels, [(local(i, True), local(i, False)) for i in range(n)])


def _honour_requantization(labels: list[Label], requant: dict[int, list[int]], costs: list[Cost | None],
                           incident: list[list[Edge]], fixed: set[int], max_sweeps: int) -> list[Label]:
    """Resolve float units onnxruntime would quantize anyway (see `decide`): O(sweeps x requant edges)."""

    def energy(units: set[int]) -> float:
        seen: dict[int, Edge] = {id(e): e for i in units for e in incident[i]}
        own = sum((c.int8_us if labels[i] else c.float_us) for i in units if (c := costs[i]) is not None)
        return own + sum(e.cost(_label(labels, e.src), _label(labels, e.dst)) for e in seen.values())

    def requantized(i: int) -> bool:
        outs = [e for e in incident[i] if e.src == i]
        to_q = len(outs) == 1 and outs[0].dst is not None and labels[outs[0].dst]
        return to_q and any(labels[s] for s in requant[i])

    for _ in range(max_sweeps):
        moved = False
        for i in requant:
            if labels[i] or not requantized(i):
                continue
            sources = {s for s in requant[i] if labels[s]}
            units = {i} | sources
            saved = list(labels)
            labels[i] = True
            as_int8 = energy(units)
            labels[i] = False
            for s in sources:
                labels[s] = False
            upstream_float = energy(units) if not sources & fixed else float("inf")
            if as_int8 <= upstream_float:
                labels = saved
                labels[i] = True
            moved = True
        if not moved:
            break
    return labels


def _all_float_components(labels: list[Label], costs: list[Cost | None], edges: list[Edge], fixed: set[int]) -> bool:
    """Set every connected component (units joined by edges) whose free units are cheaper all float to float; one
    pass over units and edges accumulates each component's energy now and with its free units float."""
    comp = _components(len(labels), edges)
    trial = [labels[i] and i in fixed for i in range(len(labels))]
    now: dict[int, float] = {}
    alt: dict[int, float] = {}
    for i, c in enumerate(costs):
        if c is not None:
            now[comp[i]] = now.get(comp[i], 0.0) + (c.int8_us if labels[i] else c.float_us)
            alt[comp[i]] = alt.get(comp[i], 0.0) + (c.int8_us if trial[i] else c.float_us)
    for e in edges:
        k = comp[e.src] if e.src is not None else comp[e.dst] if e.dst is not None else -1
        now[k] = now.get(k, 0.0) + e.cost(_label(labels, e.src), _label(labels, e.dst))
        alt[k] = alt.get(k, 0.0) + e.cost(_label(trial, e.src), _label(trial, e.dst))
    flip = {k for k in now if alt.get(k, 0.0) < now[k]}
    for i in range(len(labels)):
        if comp[i] in flip and i not in fixed:
            labels[i] = False
    return bool(flip)


def _components(n: int, edges: list[Edge]) -> list[int]:
    """Component id of every unit (union-find over the edges between two units)."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for e in edges:
        if e.src is not None and e.dst is not None:
            parent[find(e.src)] = find(e.dst)
    return [find(i) for i in range(n)]
