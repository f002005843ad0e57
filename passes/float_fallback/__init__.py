"""The ``float_fallback`` pass: keep selected nodes of a QDQ model in float, by hand or to meet a target.

Manual::

    - pass: float_fallback
      nodes:
        op_types: [Softmax, LayerNormalization]
        names: [classifier]

Automatic (ranks every quantized node from one run, then falls back ranked prefixes until the target holds,
in few full evaluations; see `qgraph.analysis.sensitivity.search`)::

    - pass: float_fallback
      auto:
        target: cosine:0.99          # or sqnr:30, or mypkg.metrics:top1>=float-0.5%
        data: eval.npz               # default: the recipe's calibration data
        reference: model_float.onnx  # default: this model with every Q/DQ removed
        max_nodes: 8
        executor: {kind: ray}        # measure candidates as Ray tasks (pip install 'qgraph[ray]')
        cost: latency                # default: buy the error where it costs least latency; error: by error only

With ``cost: latency`` the ranked prefixes follow output error bought per added latency (the cost table of
``insert_qdq``; a node next to float nodes costs less than an isolated one, which adds a DQ and a Q; see
`qgraph.analysis.sensitivity.cost`), and the summary gives the chosen model's modelled latency and, with
``latency_rounds`` (default 5), its latency measured in onnxruntime against the float and the INT8 model.
After ``insert_qdq`` in the same recipe, the search compares with the recipe's float model and the nodes that
go back to float get their float weights back.

Nodes inside If/Loop bodies: names in ``nodes.names`` are found there too, and auto mode's candidates include
the quantized nodes of every body (``auto.bodies``, default on; each measured exactly once for the ranking, since
onnxruntime returns no tensor from a body): a model whose compute sits in branches chosen at run time keeps its
control flow (`qgraph.remedy.apply`). ``to: a16w8`` gives the chosen nodes 16-bit activations instead of float
(`qgraph.remedy.widen`, for NPUs); ``to: a16w16`` 16-bit weights too, re-quantized from the float reference.

For an NPU (no cheap float path), 16-bit activations instead of float::

    - pass: float_fallback
      to: a16w8
      auto: {target: "sqnr:30", latency_rounds: 0}

Works on any QDQ model (onnxruntime's ``quantize_static``, qgraph's ``insert_qdq``, other tools): quantized
nodes are found structurally (`qdq_edit`). Dynamically quantized MatMuls (``DynamicQuantizeLinear`` +
``MatMulInteger``, ``com.microsoft.DynamicQuantizeMatMul`` / ``MatMulIntegerToFloat``: the ``transformer-ort-*``
recipes, ``quantize_dynamic``) go back to float the same way (`qgraph.remedy.dynamic`), chosen by the float model's
MatMul name, the integer node's name, op type or regex, and ranked by auto mode from the same one run (by error
alone: the cost table has no run-time quantization); the summary says whose weights they got.
``qgraph sensitivity`` runs the automatic mode from the command line and writes its decision as a patch with a
manual ``nodes: {names: [...]}`` entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import onnx

from qgraph import GraphHandle, Pass, PassContext, PassError, PassResult, load_model, register, select
from qgraph.analysis.sensitivity.targets import Target, parse_target
from qgraph.graph.names import unscoped
from qgraph.pipeline.target import CalibrationSpec
from qgraph.quant.dynamic_graph import (
    DYNAMIC_OPS,
    DynamicUnit,
    dynamic_units,
    has_dynamic_units,
    origin_name,
    unit_aliases,
    units_by_name,
)
from qgraph.quant.qdq_graph import is_qdq
from qgraph.quant.reference_weights import ReferenceWeights
from qgraph.remedy.fallback import PASS_NAME
from qgraph.runtime.streaming import check_recurrence

from .config import AutoFallbackConfig, FloatFallbackConfig
from .costs import fallback_costs
from .details import FloatFallbackDetails
from .parts import scored_parts
from .record import apply_and_record
from .strip import compare_with, recipe_reference

__all__ = ["AutoFallbackConfig", "FloatFallback", "FloatFallbackConfig", "measured_latency_check"]


@register
class FloatFallback(Pass[FloatFallbackConfig]):
    """Keep selected nodes of a QDQ or dynamically quantized model in float: remove the Q/DQ feeding and leaving
    them (or the run-time quantization of a dynamic MatMul, `qgraph.remedy.dynamic`), and only those.

    Rewrite, for a selected node n: ``DQ(Q(x)) → n`` becomes ``x → n`` (weights stored as integers become a
    float constant ``(w_q - zero_point) * scale``); ``n → Q → DQ → graph output`` becomes ``n → graph output``.
    Quantized neighbours keep their own Q/DQ (a shared pair is left in place for them), so they stay
    quantized and bit-identical. After a quantizing pass of the same recipe, weights and biases stored as
    integers take their values from the float reference (`PassContext.float_reference`), else ``DQ(w_q)``.
    A Relu a quantizer folded into a bypassed Q (zero point at the integer
    minimum) is restored.

    ``to: a16w8`` keeps the chosen nodes quantized with 16-bit activations instead (`qgraph.remedy.widen`; for NPUs),
    ``to: a16w16`` with 16-bit weights too (`qgraph.remedy.widen_weights`).
    Nodes inside If/Loop bodies are reached by name and by auto mode (`qgraph.remedy.apply`); the control flow stays.
    """

    name = PASS_NAME
    config_class = FloatFallbackConfig
    preserves_float = False
    quantizes = True  # its skip reasons say why a node stayed float
    # After insert_qdq in one recipe: nodes going back to float get their float weights back, and auto mode
    # compares with the true float model (weight rounding and bias correction included).
    needs_float_reference = True
    pause_gc = False  # auto mode builds a model and a session per evaluation: let their garbage go

    def requires(self, graph: GraphHandle, ctx: PassContext) -> None:
        """Fail before any rewrite when the model has no Q/DQ, a selector criterion matches nothing or auto mode
        lacks data."""
        if not any(is_qdq(n) or n.op in DYNAMIC_OPS for g in graph.scopes() for n in g.nodes):
            raise PassError("float_fallback: the model has no QuantizeLinear/DequantizeLinear and no dynamically "
                            "quantized MatMul (MatMulInteger, DynamicQuantizeMatMul, MatMulIntegerToFloat), so no "
                            "node to return to float or widen: run it after insert_qdq in the recipe, or on a "
                            "quantized model.")
        if self.config.to != "float" and ctx.target.runtime == "tensorrt":
            raise PassError(f"float_fallback: to: {self.config.to} writes 16-bit Q/DQ, which TensorRT does not read "
                            "(its Q/DQ are 8-bit and FP8): use to: float (TensorRT runs those layers in fp16/fp32).")
        if self.config.nodes is not None:
            self._selected(graph)
        why = self.missing_data(ctx.calibration) if ctx.calibration_data is None else None
        if why is not None:
            raise PassError(f"float_fallback: {why}")

    def missing_data(self, calibration: CalibrationSpec) -> str | None:
        """Auto mode measures candidates on ``auto.data``, else on the calibration data."""
        if self.config.auto is None or self.config.auto.data is not None:
            return None
        return ("auto mode needs evaluation data: set `auto.data` or the recipe's `calibration.data`, or give "
                "--calibration-data DATA.")

    def _selected(self, graph: GraphHandle) -> tuple[list[Any], list[DynamicUnit], list[str]]:
        """The selected top-graph nodes, the selected dynamically quantized MatMuls (by the MatMul's name or op type,
        or their integer node's), and the selected names of nodes inside If/Loop bodies."""
        selector = self.config.nodes
        assert selector is not None
        units = dynamic_units(graph)
        sel = select(graph, selector, unit_aliases(units))
        chosen = {id(n) for n in sel.nodes}
        units = [u for u in units if id(u.anchor) in chosen]
        anchors = {id(u.anchor) for u in units}
        inner = {m for g in graph.subgraphs() for n in g.nodes for m in (n.name, origin_name(n.name))}
        # a name as insert_qdq and inspect print it (``If_0.then_branch/<node>``) or as the node's own name
        in_bodies = [n for n in selector.names if n not in graph.index.by_name and unscoped(n) in inner]
        found_inside = {f"names: {n!r} matched no node" for n in in_bodies}
        unmatched = [u for u in sel.unmatched if u not in found_inside]
        if unmatched:
            raise PassError(
                f"float_fallback: the selector ({selector.describe()}) has criteria that match nothing: "
                f"{'; '.join(unmatched)}. Fix the names/patterns (list nodes with `qgraph inspect --json`)."
            )
        return [n for n in sel.nodes if id(n) not in anchors], units, [unscoped(n) for n in in_bodies]

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Fall back the selected nodes, then (auto mode) the nodes the search picks."""
        details: FloatFallbackDetails = {}
        res = PassResult(details=details)  # filled in as the nodes are handled (details.py says why a TypedDict)
        floats = recipe_reference(graph, ctx)
        weights = ReferenceWeights(floats, ctx.float_reference_weights) if floats is not None else None
        if weights is None and self.config.float_weights is not None:
            weights = ReferenceWeights(load_model(self.config.float_weights), checked=True)
            res.notes.append(f"weights of the chosen nodes from {self.config.float_weights} (float_weights)")
        if self.config.nodes is not None:
            nodes, units, inner = self._selected(graph)
            res.matched = len(nodes) + len(units) + len(inner)
            selector = self.config.nodes
            ops = {n.name: n.op for n in nodes} | {u.name: u.op for u in units}
            apply_and_record(graph, nodes, self.config.to, weights, (res, details),
                             lambda name: f"selected: {selector.criterion(name, ops.get(name, ''))}", inner, units)
        if self.config.auto is not None:
            self._auto(graph, ctx, (res, details), floats, weights)
        res.rewritten = len(details.get("fallen_back", [])) + len(details.get("widened", []))
        if not res.rewritten:
            res.notes.append("no node went back to float" if self.config.to == "float" else "no node was widened")
        return res

    def _auto(self, graph: GraphHandle, ctx: PassContext, out: tuple[PassResult, FloatFallbackDetails],
              floats: onnx.ModelProto | None, weights: ReferenceWeights | None) -> None:
        from qgraph.analysis.sensitivity.options import SearchOptions
        from qgraph.analysis.sensitivity.search import auto_fallback

        res, details = out

        auto = self.config.auto
        assert auto is not None
        data = auto.data if auto.data is not None else ctx.calibration_data
        if data is None:
            raise PassError("float_fallback: auto mode needs evaluation data (auto.data or calibration data).")
        qdq = graph.to_onnx()
        reference, in_bodies = compare_with(qdq, auto.reference, floats, ctx, res)
        if auto.recurrent is not None:
            check_recurrence(auto.recurrent, reference, "float_fallback auto")
            res.notes.append("auto: the score is measured streamed (each model fed its own state; `recurrent`)")
        if in_bodies and auto.bodies:
            res.decisions.append(f"auto: {in_bodies} quantized node(s) inside If/Loop bodies are candidates too: each "
                                 "measured exactly (one evaluation) for the ranking, ordered by error")
        elif in_bodies:
            res.notes.append(f"auto: {in_bodies} quantized node(s) inside If/Loop bodies are measured but not "
                             "candidates (auto.bodies: false): they stay quantized")
        if has_dynamic_units(graph):
            # The cost table prices Q/DQ conversions at float/int8 boundaries; a dynamic MatMul quantizes its own
            # input at run time, so that model does not describe what falling it back costs.
            costs, rank_by = None, "error"
            res.decide("auto: dynamically quantized MatMuls are ranked by output error alone (the cost table "
                       "models static Q/DQ boundaries, not run-time quantization)")
        else:
            costs, rank_by = fallback_costs(auto, ctx, res), auto.cost
        if self.config.to != "float":
            # The cost table knows float and int8 kernels only: an NPU's 16-bit layer cost is not in it.
            costs, rank_by = None, "error"
            what = "weights stay 8-bit" if self.config.to == "a16w8" else "and 16-bit weights"
            res.decisions.append(f"auto: to {self.config.to}: nodes ranked by output error (the cost table has no "
                                 f"16-bit costs); each chosen node gets 16-bit activations, {what}")
        target = _target(auto, reference)
        parts = scored_parts(auto, reference, target, res, details)
        result = auto_fallback(reference, qdq, data, target, SearchOptions(
            candidates=auto.candidates, max_nodes=auto.max_nodes, max_time=auto.max_time, jobs=auto.jobs,
            samples=auto.samples, exact_top=auto.exact_top, progress=_stage_progress(ctx), executor=auto.executor,
            float_weights=weights, costs=costs, latency_rounds=auto.latency_rounds, max_latency=auto.max_latency,
            rank_by=rank_by, recurrence=auto.recurrent, remedy=self.config.to,
            in_bodies=bool(in_bodies) and auto.bodies, parts=parts, kernels=ctx.kernels,
        ))
        details["auto"] = {k: v for k, v in result.to_dict().items() if k != "sensitivity"}
        res.decisions.append("auto: " + result.message())
        slower = measured_latency_check(result.latency, auto.max_latency)
        if slower is not None:
            res.decide(f"auto: {slower}", attention=True)
        if result.data_limit is not None:
            res.decisions.append(f"auto: {result.data_limit}")
        res.notes.extend(f"auto: {n}" for n in result.notes)
        if not result.target_met:
            res.unmet = (
                f"float_fallback auto: {result.target.describe()} not met (search stopped: {result.stop_reason}); "
                f"the best model found ({len(result.nodes)} node(s) {result.became}, score {result.score:.6g}) was "
                "kept"
            )
        candidates = result.sensitivity.candidates if result.sensitivity is not None else 0
        if result.nodes and candidates and len(result.nodes) >= candidates:
            res.decisions.append(f"auto: every one of the {candidates} candidate(s) was needed: no quantized node "
                                 f"is left {'in int8' if self.config.to == 'float' else 'at 8 bits'} among them "
                                 "(a lower target, `outputs`-specific metric or tune_ranges first may keep some)")
        if result.nodes:
            top = graph.index.by_name
            by_unit = units_by_name(dynamic_units(graph))
            units = [by_unit[n] for n in result.nodes if n in by_unit]
            chosen = [top[n] for n in result.nodes if n in top and n not in by_unit]
            order = {name: i for i, name in enumerate(result.nodes)}
            verdict = "met" if result.target_met else "NOT met"
            apply_and_record(graph, chosen, self.config.to, weights, out,
                             lambda name: f"auto: #{order.get(name, 0) + 1} of the {len(result.nodes)} node(s) "
                                          f"chosen, ranked by {rank_by}; target {result.target.describe()} {verdict}, "
                                          f"score {result.score:.4g}",
                             [n for n in result.nodes if n not in top and n not in by_unit], units)
            res.matched += len(result.nodes)


def _target(auto: AutoFallbackConfig, reference: onnx.ModelProto) -> Target:
    """The parsed target, scoring only ``auto.outputs`` when given (names checked against the model)."""
    target = parse_target(auto.target)
    if not auto.outputs:
        return target
    known = [o.name for o in reference.graph.output]
    missing = [o for o in auto.outputs if o not in known]
    if missing:
        raise PassError(f"float_fallback: auto.outputs names {missing}, which the model does not produce; its outputs "
                        f"are {known}.")
    if target.kind == "metric":
        raise PassError("float_fallback: auto.outputs selects outputs for cosine/sqnr targets; a metric target gets "
                        "every output (select inside the metric).")
    return replace(target, outputs=tuple(auto.outputs))


def _stage_progress(ctx: PassContext) -> Callable[[str, int, int | None], None] | None:
    """Each stage of the automatic search (ranking, exact, search, confirmation) as its own progress task."""
    reporters: dict[str, Callable[[int, int | None], None] | None] = {}

    def report(stage: str, done: int, total: int | None) -> None:
        if stage not in reporters:
            reporters[stage] = ctx.progress(f"auto {stage}")
        fn = reporters[stage]
        if fn is not None:
            fn(done, total)

    return report if ctx.progress("auto") is not None else None


def measured_latency_check(latency: Mapping[str, float], max_latency: float | None) -> str | None:
    """What the measured latency of the chosen model contradicts, or None.

    The search bounds the *modelled* latency (the cost table prices each node alone); on a real model the float
    nodes and their Q/DQ boundaries can cost more than the table says, and only the timing after the search shows
    it. So the measured ratio is checked against ``max_latency`` (or, without one, against float itself), and the
    sentence says by how much the table was off and which bound would have held."""
    measured, modelled = latency.get("measured_chosen"), latency.get("modelled_chosen_ratio")
    bound = 1.0 if max_latency is None else max_latency
    if measured is None or not math.isfinite(measured) or measured <= bound:
        return None
    what = f"max_latency {max_latency:g}x" if max_latency is not None else "float's own latency"
    text = f"the chosen model is {measured:.2f}x the float reference as measured here, beyond {what}"
    if modelled is None or not math.isfinite(modelled) or modelled <= 0:
        return text + " (timed with onnxruntime after the search; no cost table modelled it)"
    return (f"{text}; the cost table modelled {modelled:.2f}x, so it underprices this model's float nodes by "
            f"{measured / modelled:.2f}x: max_latency {bound * modelled / measured:.2g} would bound what is "
            "measured here (timings on a loaded machine move; `latency_rounds` sets the rounds)")

