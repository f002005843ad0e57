"""``latency.check``: time the latency decision on the whole model before believing it.

The cost model (`latency.py`) prices units and the conversions between them; it cannot see what a unit's label
does to ops outside the units. On YOLOv8n the table keeps the DFL's 1x1 Conv float (2.8 µs float against 152 µs
int8 with the QuantizeLinear of its input), and onnxruntime then runs the Softmax before it in a transposed
layout, 4-5 ms of a 16 ms model; with the Conv int8 its layout optimizer removes the transposes. So when the
decision keeps units float, the pass builds the model as decided and the model with every unit int8 (the same
`build.emit_plan` on copies of the graph, with the calibrated ranges), times both on this host, and:

* all-int8 not faster by more than ``check_margin``: the decision stands (confirmed, with both times);
* otherwise, with one float region (units joined by float-to-float edges): every unit is int8 after all;
* with several: each region (least modelled saving first) is tried int8 against the current choice and kept
  int8 where that is faster by the margin, within ``check_seconds``; the result is compared with all-int8 once
  more.

Each trial is one graph copy plus emission (O(graph)) and a few dozen runs; the number of trials is bounded by
the time budget. The times are this host's: the decisions say so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import onnx

from qgraph import GraphHandle, PassContext
from qgraph.data import batched
from qgraph.errors import QGraphError
from qgraph.quant.math import QuantSpec
from qgraph.runtime.compare import random_feeds
from qgraph.runtime.kernels.cpu import host_cpu
from qgraph.runtime.latency import time_models

from .build import activation_params, emit_plan
from .calib import RangeInfo
from .config import InsertQDQConfig
from .latency import LatencyOptions
from .placement import Planner
from .speed import LatencyOutcome
from .units import label

#: Builds the model with the given units (node id -> why) kept float, every other unit int8 (serialized).
Builder = Callable[[dict[int, str]], bytes]
# : Times serialized models within a budget (s): median ms per label (`qgraph.runtime.latency.time_models` on one
# sample).
Timer = Callable[[Mapping[str, bytes], float], dict[str, float]]


@dataclass
class Region:
    """Float units joined by float-to-float edges, and the time the cost model says keeping them float saves."""

    nodes: dict[int, str]
    names: list[str]
    saving_us: float


@dataclass
class CheckOutcome:
    """The units that stay float after the check, its decisions and its trials (for the report)."""

    float_nodes: dict[int, str]
    decisions: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


def float_regions(out: LatencyOutcome) -> list[Region]:
    """The decision's float units grouped into regions (union-find over float-to-float edges), O(units + edges)."""
    p, labels = out.priced, out.labels
    if p is None or labels is None:
        return []
    parent = list(range(len(p.units)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for e in p.edges:
        if e.src is not None and e.dst is not None and not labels[e.src] and not labels[e.dst]:
            parent[find(e.src)] = find(e.dst)
    groups: dict[int, list[int]] = {}
    for i, u in enumerate(p.units):
        if id(u.node) in out.float_nodes:
            groups.setdefault(find(i), []).append(i)
    regions = []
    for members in groups.values():
        saving = 0.0
        for i in members:
            c = p.costs[i]
            saving += 0.0 if c is None else c.int8_us - c.float_us
        nodes = {id(p.units[i].node): out.float_nodes[id(p.units[i].node)] for i in members}
        regions.append(Region(nodes, [label(p.units[i].node) for i in members], saving))
    return sorted(regions, key=lambda r: r.saving_us)


def _merge(regions: list[Region]) -> dict[int, str]:
    return {k: v for r in regions for k, v in r.nodes.items()}


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def check_decision(regions: list[Region], build: Builder, timer: Timer, opts: LatencyOptions,
                   host: str) -> CheckOutcome:
    """Time the decision (``regions`` kept float) against all-int8 and settle it (module docs)."""
    margin, start = opts.check_margin, time.perf_counter()
    units = sum(len(r.names) for r in regions)
    all_int8 = build({})
    decided = build(_merge(regions))
    times = timer({"decided": decided, "int8": all_int8}, opts.check_seconds / 4)
    decided_ms, int8_ms = times["decided"], times["int8"]
    trials: list[dict[str, Any]] = [
        {"float_units": units, "ms": round(decided_ms, 3), "all_int8_ms": round(int8_ms, 3)}]
    where = f"latency check on this host ({host})"
    if int8_ms >= decided_ms * (1 - margin):
        return CheckOutcome(_merge(regions), [
            f"{where}: the model as decided ({units} unit(s) float) runs {decided_ms:.2f} ms, all-int8 "
            f"{int8_ms:.2f} ms: the decision stands"], {"trials": trials, "result": "confirmed"})
    kept: list[Region] = []  # one region: all-int8 is the only other choice, and it was just measured faster
    if len(regions) > 1:
        kept, current = list(regions), decided
        for r in list(regions):
            if time.perf_counter() - start > opts.check_seconds:
                trials.append({"stopped": f"check_seconds ({opts.check_seconds:g} s) spent"})
                break
            trial = [k for k in kept if k is not r]
            candidate = build(_merge(trial))
            t = timer({"current": current, "candidate": candidate}, opts.check_seconds / 8)
            faster = t["candidate"] < t["current"] * (1 - margin)
            trials.append({"region": r.names, "float_ms": round(t["current"], 3), "int8_ms": round(t["candidate"], 3),
                           "quantized": faster})
            if faster:
                kept, current = trial, candidate
        if kept:
            t = timer({"current": current, "int8": all_int8}, opts.check_seconds / 8)
            if t["int8"] < t["current"] * (1 - margin):
                kept = []
    freed = [n for r in regions if r not in kept for n in r.names]
    left = sum(len(r.names) for r in kept)
    return CheckOutcome(_merge(kept), [
        f"{where}: the model as decided ({units} unit(s) float) runs {decided_ms:.2f} ms, all-int8 {int8_ms:.2f} "
        f"ms ({(1 - int8_ms / decided_ms) * 100:.0f}% faster, beyond the {margin:.0%} margin): {len(freed)} unit(s) "
        f"quantized after all ({_shown(freed)}); {left} stay float for speed (`latency: {{check: false}}` keeps the "
        "modelled decision)"], {"trials": trials, "result": "changed", "quantized_after_check": freed})


def twin_builder(graph: GraphHandle, cfg: InsertQDQConfig, wspec: QuantSpec, selection: tuple[set[int], set[str]],
                 planned: tuple[dict[str, str], dict[int, str]], ranges: dict[str, RangeInfo]) -> Builder:
    """A `Builder` emitting into copies of ``graph`` (still float): ``selection`` is the selected node ids and the
    float32 tensors, ``planned`` the tensors and nodes kept float before the latency decision (outliers, wide
    joins, depthwise); node ids are mapped to the copy by name (names are unique, `qgraph.graph.naming`)."""
    snapshot = graph.to_onnx()
    names = {id(n): label(n) for n in graph.index.nodes}
    selected, floats = selection
    forbidden, kept = planned

    def build(float_nodes: dict[int, str]) -> bytes:
        twin = GraphHandle(snapshot)
        ids = {label(n): id(n) for n in twin.index.nodes}

        def remap(d: dict[int, str]) -> dict[int, str]:
            return {ids[names[k]]: v for k, v in d.items() if names.get(k) in ids}

        sel = set(remap(dict.fromkeys(selected, "")))
        plan = Planner(twin, cfg, sel, floats, forbidden, remap({**kept, **float_nodes})).plan()
        emit_plan(twin, cfg, wspec, plan, activation_params(cfg, plan, ranges))
        twin.changed()
        return bytes(twin.to_onnx().SerializeToString())

    return build


def run_check(out: LatencyOutcome, build: Builder, ctx: PassContext, opts: LatencyOptions) -> CheckOutcome:
    """`check_decision` on the first calibration sample (seeded random inputs without data), or the decision
    unchanged with a note when a twin cannot be built or run."""
    feeds = next(iter(batched(ctx.calibration_data, 1)), None) if ctx.calibration_data is not None else None
    try:
        if feeds is None:
            feeds = random_feeds(onnx.load_from_string(build({})), 1)[0]
        sample = dict(feeds)

        def timer(models: Mapping[str, bytes], budget: float) -> dict[str, float]:
            return time_models(models, sample, budget_seconds=budget)

        return check_decision(float_regions(out), build, timer, opts, host_cpu().describe())
    except (QGraphError, KeyError, RuntimeError, ValueError) as exc:  # onnxruntime raises RuntimeError subclasses
        return CheckOutcome(dict(out.float_nodes), [
            f"latency check skipped: the twins could not be built or timed ({type(exc).__name__}: "
            f"{str(exc)[:200]}); the modelled decision stands"])
