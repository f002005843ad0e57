"""``insert_qdq``: turn a prepared float graph into a QDQ INT8 model onnxruntime fuses into integer kernels."""

from __future__ import annotations

from typing import Any

import numpy as np

from qgraph import GraphHandle, Pass, PassContext, PassError, PassResult, get_pass, register, select
from qgraph.graph import topological_order
from qgraph.pipeline.target import CalibrationSpec
from qgraph.quant.math import QuantDtype, QuantSpec
from qgraph.quant.qdq_graph import is_dq
from qgraph.runtime.compare import ORT_ERRORS
from qgraph.runtime.kernels.cpu import host_cpu
from qgraph.runtime.kernels.measure import target_family

from .bodies import BodiesOutcome, quantize_bodies
from .build import activation_params, emit_plan
from .calib import Calibration, RangeInfo, calibrate, screen
from .choices import auto_decision, auto_summary, fix_bounded, fixed_decision, unclip, unclip_decision
from .config import PRESETS, InsertQDQConfig
from .cpu import for_cpu, resolve_reduce_range, resolve_saturation, saturation_wanted
from .depthwise import candidates, decide_depthwise, depthwise_units
from .details import EarlyStages, InsertQDQDetails, quantized_ops, quantized_units
from .dynamic import DynamicQuantizer
from .emit import ActParams
from .joins import wide_joins
from .latency import LatencyOptions
from .latency_check import Builder, run_check, twin_builder
from .ops import BINARY, UNARY, VARIADIC, WEIGHTED, float32_tensors
from .pairsafe import ChannelCodes, pair_axes
from .placement import Planner
from .presets import CPU_PRESETS, PRESET_CPUS
from .saturation import channel_codes, pair_safe_decisions, saturation_details
from .speed import (
    LatencyOutcome,
    baseline,
    first_sample,
    latency_decision,
    measure_twin,
    name_nodes,
    require_preset,
    sample_shapes,
)
from .through import clip_flat_sides
from .units import Plan, Unit, label
from .weights import Emitter, check_finite_weights

__all__ = ["InsertQDQ", "InsertQDQConfig"]

_WIDE = {QuantDtype.INT4, QuantDtype.UINT4, QuantDtype.INT16, QuantDtype.UINT16}


@register
class InsertQDQ(Pass[InsertQDQConfig]):
    """Insert QuantizeLinear/DequantizeLinear pairs (static, calibrated) or dynamic MatMul quantization.

    Rewrite: ``x -> Conv(W, B) -> Relu -> y`` becomes ``x -> Q -> DQ -> Conv(DQ(W/q), DQ(B/q)) -> Relu -> Q -> DQ
    -> y`` with ``W/q = round(W / s_w)`` per output channel, ``B/q = round(B / (s_x s_w))`` (int32), and
    activation scales from calibration; onnxruntime fuses each group into QLinearConv/QGemm/QLinearAdd...
    Placement, presets, outlier screening and saturation analysis are described in the submodules.
    """

    name = "insert_qdq"
    config_class = InsertQDQConfig
    preserves_float = False
    quantizes = True  # its skip reasons say why a node stayed float

    @classmethod
    def help_text(cls) -> str:
        """The docstring plus every preset and why it chooses what it does."""
        presets = "\n\n".join(f"preset {p.name}: {p.why}" for p in PRESETS.values())
        return super().help_text() + "\n\n" + presets

    # ------------------------------------------------------------------ validation
    def made_for_cpu(self) -> str | None:
        """The family of the preset's CPU (ort-x86-vnni: x86-vnni, ...), None for other presets."""
        return PRESET_CPUS.get(self.config.preset or "")

    def requires(self, graph: GraphHandle, ctx: PassContext) -> None:
        """Opset rules and data availability, before anything is written."""
        cfg, opset = self.config, graph.opset
        need, what = required_opset(cfg)
        if opset < need and cfg.opset == "keep":
            raise PassError(
                f"insert_qdq: {what} needs opset >= {need} but the model has opset {opset} and the recipe says "
                f"`opset: keep`. Remove it (insert_qdq then raises the opset itself) or add `- pass: raise_opset` "
                f"with `opset: {need}` before insert_qdq."
            )
        require_preset(cfg.latency, cfg.preset)
        if cfg.mode == "dynamic" and cfg.activations.dtype != QuantDtype.UINT8:
            raise PassError(
                "insert_qdq: dynamic mode quantizes activations to uint8 (DynamicQuantizeLinear); "
                "set activations.dtype: uint8"
            )
        why = self.missing_data(ctx.calibration) if ctx.calibration_data is None else None
        if why is not None:
            raise PassError(f"insert_qdq: {why}")

    def missing_data(self, calibration: CalibrationSpec) -> str | None:
        """Static mode needs data for the activation ranges, unless the recipe gives a ranges file."""
        if self.config.mode != "static" or calibration.ranges:
            return None
        return ("static quantization needs calibration data for activation ranges. Run `qgraph run RECIPE MODEL "
                "--calibration-data DATA` (.npz with one array per input, a folder, or module:function), give "
                "`calibration.ranges` in the recipe, or use `mode: dynamic`.")

    # ------------------------------------------------------------------ run
    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Plan, calibrate, screen outliers, quantize weights/biases, insert activation Q/DQ (the pipeline pauses the
        cyclic GC around every pass: it made this pass super-linear on 100k-node graphs)."""
        if self.config.preset in CPU_PRESETS:  # the preset of the target's CPU, known only now (`cpu: host`)
            family = target_family(ctx.target.cpu) or ctx.kernel_choice.kernels.host.family
            resolved, why = for_cpu(self.config, family)
            out = ctx.run_pass(InsertQDQ(resolved), graph)
            out.decisions.insert(0, why if target_family(ctx.target.cpu) else
                                 f"{why} (this host's: the recipe declares no target.cpu)")
            return out
        res = PassResult()
        self._early = EarlyStages()  # what depthwise: auto and latency report while re-planning
        cfg = self._reach_opset(graph, ctx, res)
        in_bodies = BodiesOutcome()
        if cfg.mode == "static" and cfg.subgraphs == "static":
            in_bodies = quantize_bodies(self, graph, ctx, res)
        with ctx.float_preserving(graph):
            graph.toposort()
        cpu = ctx.target.cpu_info()
        reduce_range, rr_why = resolve_reduce_range(cfg, cpu)
        if cfg.weights.reduce_range == "auto":
            res.decisions.append(rr_why)
        saturation, sat_why = resolve_saturation(cfg, cpu, target_family(ctx.target.cpu))
        if sat_why:
            res.decisions.append(sat_why)
        sat_at = len(res.decisions)  # the per-layer outcome is shown right after, before the longer lists
        cfg = cfg.model_copy(update={"saturation": saturation})
        wspec = weight_spec(cfg, reduce_range)
        selection = select(graph, cfg.nodes)
        res.unmatched += in_bodies.unmatched_everywhere(selection.unmatched)
        ops = set(cfg.op_types)
        selected = {id(n) for n in selection.nodes if n.op in ops}
        res.matched = len(selected)
        floats = float32_tensors(graph.index.nodes, graph.graph.inputs)
        plan = Planner(graph, cfg, selected, floats).plan()
        check_finite_weights(graph, plan.units)  # before calibration, which would only see NaN activations
        params: dict[str, ActParams] = {}
        ranges: dict[str, RangeInfo] = {}
        forbidden: dict[str, str] = {}
        calib_details: dict[str, Any] = {}
        codes: dict[str, ChannelCodes] = {}
        pairs = pair_axes(plan.units) if saturation == "avoid" and cfg.saturation_codes == "calibrated" else {}
        if cfg.mode == "static" and plan.roots:
            ranges, calib_details, cal = self._calibrate(graph, ctx, plan, res, pairs)
            plan, forbidden = self._replan(graph, ctx, plan, (selected, floats, wspec), ranges, cal, res)
            ranges = clip_flat_sides(graph, plan, ranges, cal.overridden, cfg.activations, calib_details, res)
            params = activation_params(cfg, plan, ranges)
            codes = channel_codes(plan, params, cal.channels_on(pairs))
        before = len(graph.graph.nodes)
        built = emit_plan(graph, cfg, wspec, plan, params, codes)
        em, wq, dyn = built.em, built.weights, built.dynamic
        sub_units, sub_skips = self._subgraphs(graph, em, dyn, ops)
        graph.changed()
        dead = set(dyn.replaced)
        for node in graph.index.nodes:  # Constant nodes whose weights were replaced by integer initializers
            if node.op == "Constant" and not any(graph.consumers(t) or graph.is_graph_output(t) for t in node.outputs):
                dead.add(id(node))
        if dead:
            graph.graph.nodes = [n for n in graph.graph.nodes if id(n) not in dead]
        graph.toposort()
        for node, why in plan.skipped + sub_skips:
            res.skip(node, why)
        self._refuse_unsupported(res)
        res.rewritten = len(plan.units) + len(plan.movement) + sub_units + in_bodies.quantized
        res.nodes_added = len(em.new_nodes)
        res.nodes_removed = max(0, before + len(em.new_nodes) - len(graph.graph.nodes))
        if wq.adjusted:
            res.notes.append(f"weight scales raised so int32 biases fit: {', '.join(wq.adjusted)}")
        sat = saturation_details(plan, params, wq.weights, codes) if (wspec.dtype == QuantDtype.INT8
                                                                       and saturation_wanted(cfg, cpu)) else None
        res.details = InsertQDQDetails(
            depthwise_auto=self._early.depthwise_auto, latency=self._early.latency, preset=self.config.preset,
            why=PRESETS[self.config.preset].why if self.config.preset else "", mode=self.config.mode,
            reduce_range=rr_why, cpu="not declared (target.cpu: any)" if cpu is None else cpu.describe(),
            quantized=quantized_units(plan), quantized_ops=quantized_ops(plan),
            integer_data_movement=[label(n) for n in plan.movement], quantized_tensors=len(plan.tensors),
            calibrated_tensors=len(params), excluded_tensors=forbidden, asymmetric_weights=wq.asymmetric,
            subgraph_nodes_quantized=sub_units, subgraph_nodes_quantized_static=in_bodies.quantized,
            calibration={"method": cfg.activations.method, **calib_details} if calib_details else None,
            saturation=sat,
            pair_safe=pair_safe_decisions([*wq.rescaled, *dyn.rescaled], res, cfg.saturation == "avoid", sat_at,
                                          calibrated=bool(codes)))
        return res

    def _calibrate(
        self, graph: GraphHandle, ctx: PassContext, plan: Plan, res: PassResult, pairs: dict[str, int]
    ) -> tuple[dict[str, RangeInfo], dict[str, Any], Calibration]:
        """Calibrated ranges with the unclipped inputs' observed ranges and the bounded ops' known ranges applied;
        decisions, the calibration details, and the calibration (per-tensor results, hand overrides, per-channel
        ranges of depthwise inputs for ``depthwise: auto`` and of ``pairs``' tensors on their axes)."""
        dw = depthwise_units(graph, plan.units) if self.config.depthwise == "auto" else []
        axes = {**pairs, **{u.act_inputs[0]: 1 for u in dw}}
        cal = calibrate(graph, ctx, plan.roots, self.config, axes)
        res.notes += cal.notes
        res.calibration_seconds = cal.seconds
        details = dict(cal.fragile)
        auto = auto_summary(cal.measured)
        if auto is not None:
            details["auto"] = auto
            res.decisions.append(auto_decision(auto))
        ranges = cal.ranges
        if self.config.activations.unclipped is not None:
            selection = select(graph, self.config.activations.unclipped)
            res.unmatched += selection.unmatched
            ranges, unclipped = unclip(plan, ranges, {id(n) for n in selection.nodes}, cal.overridden)
            if unclipped:
                details["unclipped"] = unclipped
                res.decisions.append(unclip_decision(unclipped))
        if self.config.activations.fixed_ranges:
            ranges, fixed = fix_bounded(graph, ranges, cal.overridden)
            if fixed:
                details["fixed_ranges"] = fixed
                res.decisions.append(fixed_decision(fixed))
        return ranges, details, cal

    def _replan(self, graph: GraphHandle, ctx: PassContext, plan: Plan, base: tuple[set[int], set[str], QuantSpec],
                ranges: dict[str, RangeInfo], cal: Calibration, res: PassResult) -> tuple[Plan, dict[str, str]]:
        """The plan after calibration, with its outlier-screened tensors: outliers, wide joins, float depthwise
        convs and units slower in int8 kept float, each decision re-planning once (``base``: selected node ids and
        float32 tensors, weight spec)."""
        cfg, (selected, floats, wspec) = self.config, base
        forbidden = screen(ranges, cfg)
        joins = wide_joins(plan, ranges, cfg)
        res.decisions += list(joins.values())
        if forbidden or joins:
            plan = Planner(graph, cfg, selected, floats, forbidden, joins).plan()
        dw = self._depthwise(graph, ctx, plan, cal.channels, res)
        if dw:  # the latency decision then re-labels the neighbours of the float depthwise convs
            plan = Planner(graph, cfg, selected, floats, forbidden, {**joins, **dw}).plan()
        decided = self._latency(graph, ctx, plan, res)
        slow = decided.float_nodes
        if slow and cfg.latency.check:
            build = twin_builder(graph, cfg, wspec, (selected, floats), (forbidden, {**joins, **dw}), ranges)
            slow = self._check(ctx, decided, build, res)
        if slow:
            plan = Planner(graph, cfg, selected, floats, forbidden, {**joins, **dw, **slow}).plan()
        return plan, forbidden

    def _check(self, ctx: PassContext, out: LatencyOutcome, build: Builder, res: PassResult) -> dict[int, str]:
        """The latency decision timed on the whole model (`latency_check.py`), unless the recipe declares a target
        CPU this host is not (another architecture, or without the target's VNNI/AVX2: its timings would decide for
        the wrong machine)."""
        host, target = host_cpu(), ctx.target.cpu_info()
        if target is not None and target.source == "declared" and (
                (target.arch, target.vnni, target.avx2) != (host.arch, host.vnni, host.avx2)):
            res.decisions.append(f"latency check skipped: the recipe targets {ctx.target.cpu} and this host is "
                                 f"{host.describe()}; the modelled decision stands")
            return out.float_nodes
        checked = run_check(out, build, ctx, self.config.latency)
        for text in checked.decisions:  # the check overruling the cost model is shown first in the summary
            res.decide(text, attention=checked.float_nodes != out.float_nodes)
        if checked.details and self._early.latency is not None:
            self._early.latency["check"] = checked.details
        return checked.float_nodes

    def _latency(self, graph: GraphHandle, ctx: PassContext, plan: Plan, res: PassResult) -> LatencyOutcome:
        """Units to keep float because int8 would be slower (`latency.py`), measured on an all-int8 twin of the
        graph (``latency: measure``: quantized by this pass with ``latency: off``) or from the cost table."""
        cfg = self.config
        measured = None
        if cfg.latency.mode == "off":
            return LatencyOutcome()
        if cfg.latency.mode == "measure":
            twin = GraphHandle(name_nodes(graph.to_onnx()))
            InsertQDQ(cfg.model_copy(update={"latency": LatencyOptions()})).run(twin, ctx)
            try:
                measured = measure_twin(graph, twin.to_onnx(), cfg.latency, first_sample(ctx))
            except ORT_ERRORS as exc:
                reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
                res.decide(f"latency: measure could not run the model in onnxruntime on this host ({reason}); the "
                           "shipped cost table decides instead (give calibration data of the size the model runs "
                           "at, or use `latency: {mode: table}`)", attention=True)
            if measured is not None:
                host, target = host_cpu(), ctx.target.cpu_info()
                where = f"latency: measured on this host ({host.describe()})"
                if target is not None and target.arch != host.arch and target.source == "declared":
                    where += (f", but the recipe targets {ctx.target.cpu}: these float/int8 choices are this "
                              "host's; run qgraph on the target machine for its own")
                res.decisions.append(where)
        shapes, why = sample_shapes(graph, ctx)
        if why:
            res.decisions.append(why)
        out = latency_decision(graph, plan, cfg.latency, cfg.preset, measured, shapes)
        res.decisions += out.decisions
        res.notes += out.notes
        if out.details:
            self._early.latency = out.details
        return out

    def _depthwise(self, graph: GraphHandle, ctx: PassContext, plan: Plan,
                   channels: dict[str, tuple[np.ndarray, np.ndarray]], res: PassResult) -> dict[int, str]:
        """Depthwise convs ``depthwise: auto`` keeps float (`depthwise.py`), priced with the cost table and the
        labels the latency decision would give the plan (every unit int8 under ``latency: off``)."""
        cfg = self.config
        cands = candidates(graph, plan.units, channels, cfg.activations.symmetric) if cfg.depthwise == "auto" else []
        if not cands:
            return {}
        priced, labels = baseline(graph, plan, cfg.latency, cfg.preset, sample_shapes(graph, ctx)[0])
        out = decide_depthwise(cands, cfg.depthwise_auto, priced, labels)
        res.decisions += out.decisions
        self._early.depthwise_auto = out.details
        return out.float_nodes

    def _reach_opset(self, graph: GraphHandle, ctx: PassContext, res: PassResult) -> InsertQDQConfig:
        """Raise the model's opset when the options need it (a decision), or fall back to per-tensor weights
        where raising is impossible; returns the config to run with."""
        cfg = self.config
        need, what = required_opset(cfg)
        before = graph.opset
        if before >= need:
            return cfg
        try:
            ctx.run_pass(get_pass("raise_opset")(opset=need), graph)
        except PassError as exc:
            reason = exc.message.splitlines()[0]
            per_tensor = cfg.model_copy(update={"weights": cfg.weights.model_copy(update={"per_channel": False})})
            if required_opset(per_tensor)[0] > max(before, 10) or need != 13:
                raise PassError(f"insert_qdq: {what} needs opset >= {need}, and the model cannot be raised from opset "
                                f"{before}: {reason}") from exc
            res.decide(f"per-tensor weights: per-channel needs opset 13 and raising opset {before} -> 13 is "
                       f"impossible ({reason})", attention=True)
            return per_tensor
        res.decisions.append(f"opset raised {before} -> {need}: {what} needs opset >= {need} (set `opset: keep` "
                             "to refuse instead)")
        return cfg

    def _subgraphs(
        self, graph: GraphHandle, em: Emitter, dyn: DynamicQuantizer, ops: set[str]
    ) -> tuple[int, list[tuple[str, str]]]:
        done, skips = 0, []
        for sub in list(graph.subgraphs()):
            for node in list(sub.nodes):
                if node.op not in ops or node.op not in WEIGHTED | BINARY | VARIADIC | UNARY:
                    continue
                if any(t.inputs and is_dq(t.inputs[0]) for t in node.inputs):
                    continue  # quantized statically with its body (subgraphs: static)
                w = graph.constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
                x_const = graph.constant_value(node.inputs[0]) is not None
                dynamic_ok = node.op in ("MatMul", "Gemm") and w is not None and not x_const and w.ndim == 2
                if node.op == "Gemm" and int(node.attrs.get("transA", 0)):
                    dynamic_ok = False
                if self.config.subgraphs != "skip" and dynamic_ok:
                    dyn.unit(Unit(node, "dynamic", [node.inputs[0].name], 1), sub)
                    done += 1
                else:
                    skips.append(
                        (
                            label(node),
                            "inside an If/Loop/Scan body no calibration sample reaches (or subgraphs: "
                            f"{self.config.subgraphs}): only MatMul/Gemm with constant weights are quantized there, "
                            "dynamically",
                        )
                    )
            kept = [n for n in sub.nodes if id(n) not in dyn.replaced]
            sub.nodes = topological_order(kept) or kept  # iterative Kahn (graphsurgeon's sort recurses)
        return done, skips

    def _refuse_unsupported(self, res: PassResult) -> None:
        if self.config.unsupported != "error":
            return
        bad = [s for s in res.skipped if not s.reason.startswith("already quantized")]
        if bad:
            listed = "; ".join(f"{s.node}: {s.reason}" for s in bad[:8])
            raise PassError(
                f"insert_qdq: {len(bad)} selected node(s) cannot be quantized ({listed}). Exclude them with "
                "`nodes: {exclude: {names: [...]}}` or set `unsupported: float`."
            )


def weight_spec(cfg: InsertQDQConfig, reduce_range: bool) -> QuantSpec:
    """How the options quantize weights (``reduce_range`` resolved for the target CPU)."""
    return QuantSpec(dtype=cfg.weights.dtype, symmetric=cfg.weights.symmetric is not False,
                     narrow_range=cfg.weights.narrow_range, reduce_range=reduce_range)

def required_opset(cfg: InsertQDQConfig) -> tuple[int, str]:
    """The lowest default-domain opset the options need, and which option needs it."""
    if any(d in _WIDE for d in (cfg.weights.dtype, cfg.activations.dtype)):
        wide = sorted({d.value for d in (cfg.weights.dtype, cfg.activations.dtype) if d in _WIDE})
        return 21, f"{'/'.join(wide)} quantization"
    if cfg.weights.per_channel and cfg.mode == "static":
        return 13, "per-channel weight quantization (the DequantizeLinear axis attribute)"
    if cfg.mode == "dynamic":
        return 11, "dynamic quantization (DynamicQuantizeLinear)"
    return 10, "QuantizeLinear/DequantizeLinear"
