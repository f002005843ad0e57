"""The ``tune_ranges`` pass: per activation Q/DQ pair, the range that gives the best *model output*, searched on
calibration data after ``insert_qdq``.

Calibration methods (``minmax``, ``mse``, ``auto``...) choose each range from its own tensor: the least expected
rounding + clipping error *of that tensor*. Where the model weighs small values more than large ones (quiet
frequency bins of a spectrum that the next layer amplifies, the few chunks of a speech detector whose
probability is near 0.5), a narrower range than the tensor-optimal one is much better for the output. This pass
measures that directly. For each activation ``QuantizeLinear → DequantizeLinear`` pair with a per-tensor scale
``s`` (top graph in graph order, then the pairs inside If/Loop bodies: the model keeps its control flow), it
tries ``s · f`` for each ``f`` in ``factors`` (``f < 1`` clips the largest values and gives the rest finer steps;
zero points are kept) and keeps the best by::

    score = min over graph outputs o of SQNR_o = 10 log10(Σ y_o² / Σ (ŷ_o - y_o)²)      (dB)

(an output that a final Concat joins from different tensors, a detector's boxes and class scores, counts as one
output per part, `qgraph.runtime.output_parts`; ``output_parts: false`` scores it whole) where ``y`` are the float
reference's outputs (`PassContext.float_reference`: the model before ``insert_qdq``)
and ``ŷ`` the quantized model's, on at most ``samples`` calibration samples. This is coordinate descent: each
pair is tuned with the earlier pairs' choices in place; a factor is kept only when it gains more than
``min_gain_db``; with ``sweeps`` > 1 the pairs are visited again (every factor and 1, so an early narrowing can
be undone once later pairs changed). The int32 biases of the layers reading a re-scaled pair are re-quantized
to the new input scale (``b_q' = round(b_q / f)`` with bias scale ``s_x f s_w``), so onnxruntime's fused
QLinearConv/QGemm see consistent scales. Cost: one evaluation per (pair, factor, sweep); ``time_budget_s``
stops between pairs (pairs not reached keep their range, reported). The score is measured on calibration data:
check it on held-out data. Not a fixed point: a second run re-measures and may narrow again.

Recurrent models (``recurrent: {state_inputs: {state: stateN}}``): the score is measured *streamed*
(`qgraph.runtime.streaming.OutputScore`): calibration samples in order form sequences (restarting where the data's state
is not the float model's previous state, or every ``sequence_length`` samples), and the float reference and each
candidate are fed their own previous state outputs, so the error a range causes through the state counts. Same
cost: one run per sample per evaluation.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from pydantic import Field, field_validator

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassDetails, PassError, PassResult, register
from qgraph.data import Feed
from qgraph.graph.names import GraphOutputName
from qgraph.metrics import builtin_metric, is_builtin
from qgraph.pipeline.target import CalibrationSpec
from qgraph.quant.layers import find_layers
from qgraph.quant.qdq_graph import is_dq, is_q, qparams
from qgraph.runtime.compare import make_session
from qgraph.runtime.evaluation import load_metric
from qgraph.runtime.output_parts import OutputParts, find_output_parts
from qgraph.runtime.streaming import OutputScore, Recurrence, check_recurrence

if TYPE_CHECKING:
    from qgraph.runtime.kernels.measure import Kernels

__all__ = ["TuneRanges", "TuneRangesConfig"]

NAME = "tune_ranges"


@dataclass(frozen=True)
class TuneRangesDetails(PassDetails):
    """The output score (min SQNR, dB) before and after `TuneRanges`, the factor each narrowed range got (by its
    tensor), the search's size and data, and the score of every scored output part before and after."""

    score_before_db: float
    score_after_db: float
    factors: dict[str, float]
    pairs: int
    evaluations: int
    samples: int
    streamed: bool
    sequences: int
    scored_db_before: dict[str, float]
    scored_db_after: dict[str, float]
    #: the task metric (``metric``) before and after, when one decided
    metric_before: float | None = None
    metric_after: float | None = None


class TuneRangesConfig(PassConfig):
    """Factors tried per pair, data used, and time allowed."""

    factors: tuple[float, ...] = Field(
        default=(0.7, 0.5, 0.35, 0.25), description="Multipliers of each pair's scale tried besides 1 (each in "
        "(0, 2]; below 1 narrows the range).")
    samples: int = Field(default=256, ge=1, description="Calibration samples the output score is measured on.")
    min_gain_db: float = Field(default=0.05, ge=0, description="Keep a factor only if the score gains more.")

    @field_validator("factors")
    @classmethod
    def _in_range(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 < f <= 2 for f in value):
            raise ValueError(f"each factor must be in (0, 2], got {list(value)}")
        return value
    sweeps: int = Field(default=1, ge=1, le=8, description="Passes over the pairs; a later pass re-tries every "
                        "factor (and 1) on each pair with the other pairs' choices in place.")
    time_budget_s: float | None = Field(
        default=None, gt=0, description="Stop after this many seconds (pairs not reached keep their range).")
    outputs: tuple[GraphOutputName, ...] = Field(
        default=(), description="Graph outputs the score is the minimum over (default: every output); e.g. a "
        "recurrent model's prediction without its state.")
    recurrent: Recurrence | None = Field(
        default=None, description="A recurrent model's state feedback ({state_inputs: {state: stateN}}): score "
        "streamed, each model fed its own previous state over the calibration samples in order "
        "(`qgraph.runtime.streaming`); unset: every sample as it is in the data.")
    output_parts: bool = Field(
        default=True, description="Score each part of an output that a final Concat joins (a detector's boxes "
        "and class scores) on its own, the worst part deciding (`qgraph.runtime.output_parts`); false: every output "
        "whole, where the largest part's error hides the others'.")
    metric: str | None = Field(
        default=None, description="A task metric deciding first (docs/metrics.md: detection.f1(score=0.25), "
        "text_boxes, ctc.exact, ...; or module:function): a factor is kept when it improves the metric against the "
        "float reference, or leaves it equal and gains min_gain_db of SQNR.")

    @field_validator("metric")
    @classmethod
    def _metric_known(cls, value: str | None) -> str | None:
        if value is not None and is_builtin(value):
            try:
                builtin_metric(value, PassError)
            except PassError as exc:  # a validation error: the recipe error names file, line and field
                raise ValueError(str(exc)) from None
        return value


@dataclass
class _Pair:
    """The activation Q/DQ pairs sharing one scale constant (``insert_qdq`` gives a Slice/Reshape/MaxPool output
    its input's scale so no requantization is needed: they move together), and the int32 biases of the layers
    reading them."""

    qs: list[gs.Node]
    dqs: list[gs.Node]
    scale: gs.Constant
    biases: list[tuple[gs.Node, gs.Constant, gs.Constant]] = field(default_factory=list)  # (DQ, codes, scale)

    def apply(self, f: float, graph: GraphHandle) -> None:
        """Scale ``s · f`` on the pair (new constants: shared ones are never edited), biases re-quantized;
        ``f = 1`` puts the original constants back."""
        scale = self.scale if f == 1.0 else _const(graph, self.scale, np.asarray(self.scale.values, np.float32) * f)
        for node in (*self.qs, *self.dqs):
            node.inputs[1] = scale
        for dq, codes, bscale in self.biases:
            if f == 1.0:
                dq.inputs[0], dq.inputs[1] = codes, bscale
                continue
            new = np.clip(np.rint(np.asarray(codes.values, np.float64) / f), -(2**31), 2**31 - 1)
            dq.inputs[0] = _const(graph, codes, new.astype(np.int32))
            dq.inputs[1] = _const(graph, bscale, np.asarray(bscale.values, np.float32) * np.float32(f))


def _const(graph: GraphHandle, like: gs.Constant, values: np.ndarray) -> gs.Constant:
    return gs.Constant(graph.unique_name(f"{like.name}/tuned", kind="tensor"),
                       np.array(values, dtype=np.asarray(like.values).dtype))


def _pairs(graph: GraphHandle) -> list[_Pair]:
    """Activation pairs with a per-tensor constant scale whose readers are all DequantizeLinear, in the top graph
    and inside If/Loop bodies (nested too; found through graphsurgeon's own producer/consumer links)."""
    layers, _ = find_layers(graph)
    bias_of = {id(la.node): la.bias for la in layers if la.bias is not None and la.bias.kind == "int32"}

    def bias(layer: gs.Node, dq: gs.Node) -> tuple[gs.Node, gs.Constant, gs.Constant] | None:
        ref = bias_of.get(id(layer))
        if ref is None:  # find_layers covers the top graph: inside bodies, the Conv/Gemm bias input itself
            return _body_bias(layer, dq)
        bias_dq = graph.producer(ref.owner.inputs[ref.index])
        if layer.inputs[0] is not dq.outputs[0] or bias_dq is None or not isinstance(bias_dq.inputs[1], gs.Constant):
            return None
        return bias_dq, ref.value, bias_dq.inputs[1]

    out: dict[int, _Pair] = {}
    for q in (n for scope in graph.scopes() for n in scope.nodes):
        if not is_q(q) or isinstance(q.inputs[0], gs.Constant) or not isinstance(q.inputs[1], gs.Constant):
            continue
        readers = list(q.outputs[0].outputs)
        params = qparams(graph, q)
        if not readers or not all(is_dq(r) and r.inputs[1] is q.inputs[1] for r in readers) or params is None \
                or params.scale.size != 1:
            continue
        pair = out.setdefault(id(q.inputs[1]), _Pair([], [], q.inputs[1]))
        pair.qs.append(q)
        pair.dqs += readers
        pair.biases += [b for dq in readers for layer in dq.outputs[0].outputs if (b := bias(layer, dq))]
    # a scale constant also read by a pair this pass cannot move (e.g. per-tensor weights) stays as it is
    return [p for p in out.values() if all(is_q(r) or is_dq(r) for r in p.scale.outputs)
            and len(p.scale.outputs) == len(p.qs) + len(p.dqs)]


def _body_bias(layer: gs.Node, dq: gs.Node) -> tuple[gs.Node, gs.Constant, gs.Constant] | None:
    """``(bias DQ, int32 codes, bias scale)`` of ``layer`` when it reads ``dq`` as its data input."""
    if layer.op not in ("Conv", "ConvTranspose", "Gemm") or len(layer.inputs) < 3 or layer.inputs[0] is not \
            dq.outputs[0] or not layer.inputs[2].inputs:
        return None
    bias_dq = layer.inputs[2].inputs[0]
    codes, scale = bias_dq.inputs[0], bias_dq.inputs[1] if len(bias_dq.inputs) > 1 else None
    if not is_dq(bias_dq) or not isinstance(codes, gs.Constant) or not isinstance(scale, gs.Constant) or \
            np.asarray(codes.values).dtype != np.int32:
        return None
    return bias_dq, codes, scale


@register
class TuneRanges(Pass[TuneRangesConfig]):
    """Output-aware activation ranges: per Q/DQ pair, the scale factor with the best model-output SQNR (module
    docstring: objective, search, cost)."""

    name = NAME
    config_class = TuneRangesConfig
    preserves_float = False
    needs_float_reference = True
    pause_gc = False  # one model export and session per evaluation

    def missing_data(self, calibration: CalibrationSpec) -> str:
        """The scale factors are scored on calibration data: always needed."""
        return ("needs calibration data to score the scale factors on: give --calibration-data DATA or the "
                "recipe's `calibration.data`.")

    def requires(self, graph: GraphHandle, ctx: PassContext) -> None:
        """Calibration data and the float reference (``insert_qdq`` earlier in the recipe)."""
        if ctx.calibration_data is None:
            raise PassError(f"{NAME}: {self.missing_data(ctx.calibration)}")
        quantized = any(is_q(n) for g in graph.scopes() for n in g.nodes)
        if ctx.float_reference is None or not quantized:
            raise PassError(f"{NAME}: needs a quantized model and its float reference: run it after `insert_qdq` "
                            "in the same recipe.")
        if self.config.recurrent is not None:
            check_recurrence(self.config.recurrent, ctx.float_reference, NAME)
        known = [o.name for o in ctx.float_reference.graph.output]
        for name in self.config.outputs:
            if name not in known:
                raise PassError(f"{NAME}: outputs names {name!r}, which the model does not produce; its outputs "
                                f"are {known}.")

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Coordinate descent over the pairs (module docstring)."""
        cfg = self.config
        res = PassResult()
        assert ctx.calibration_data is not None and ctx.float_reference is not None
        feeds: list[Feed] = []
        for feed in ctx.calibration_data:
            feeds.append(feed)
            if len(feeds) >= cfg.samples:
                break
        reference = make_session(ctx.float_reference, weights=ctx.float_reference_weights)
        parts = _scored_parts(ctx.float_reference, cfg, res)
        scorer = OutputScore(reference, feeds, cfg.recurrent, cfg.outputs, parts)
        del reference
        pairs = _pairs(graph)
        res.matched = len(pairs)
        top = {id(n) for n in graph.index.nodes}
        inner = sum(1 for p in pairs if id(p.qs[0]) not in top)
        if inner:
            res.decisions.append(f"{inner} of the {len(pairs)} pair(s) sit inside If/Loop bodies: tuned in place, the "
                                 "control flow kept (a branch the data never takes scores no gain and keeps its range)")
        start = time.perf_counter()
        kernels = ctx.kernels
        judge = _Judge(cfg.metric, scorer, cfg.min_gain_db)
        before = self._scores(graph, scorer, kernels)
        best, after = min(before, default=math.inf), before
        best_metric = first_metric = judge.value()
        first, evaluations, reached = best, 1, 0
        current = [1.0] * len(pairs)
        for sweep in range(cfg.sweeps):
            for k, pair in enumerate(pairs):
                if cfg.time_budget_s is not None and time.perf_counter() - start > cfg.time_budget_s:
                    break
                reached = max(reached, k + 1)
                keep = current[k]
                for f in (cfg.factors if sweep == 0 else (1.0, *cfg.factors)):
                    if f == current[k]:
                        continue
                    pair.apply(f, graph)
                    scores = self._scores(graph, scorer, kernels)
                    score = min(scores, default=math.inf)
                    evaluations += 1
                    value = judge.value()
                    if judge.better(value, score, best_metric, best):
                        best, keep, after, best_metric = score, f, scores, value
                pair.apply(keep, graph)
                current[k] = keep
        chosen = {p.qs[0].inputs[0].name: f for p, f in zip(pairs, current, strict=True) if f != 1.0}
        if chosen:
            graph.cleanup()  # the constants no pair reads any more
        res.rewritten = len(chosen)
        res.details = TuneRangesDetails(
            score_before_db=first, score_after_db=best, factors=chosen, pairs=len(pairs), evaluations=evaluations,
            samples=len(feeds), streamed=scorer.streamed, sequences=len(scorer.starts),
            scored_db_before=dict(zip(scorer.labels, before, strict=True)),
            scored_db_after=dict(zip(scorer.labels, after, strict=True)),
            metric_before=first_metric if cfg.metric else None, metric_after=best_metric if cfg.metric else None)
        res.decisions.append(
            f"{len(chosen)} of {len(pairs)} activation range(s) narrowed: output score (min SQNR over "
            f"{'the parts of ' if len(scorer.units) > len(scorer.names) else ''}"
            f"{'outputs ' + ', '.join(cfg.outputs) if cfg.outputs else 'every output'}, "
            f"{scorer.describe()}) {_db(first)} -> {_db(best)} in {evaluations} evaluation(s)"
            + "".join(f"; {t} x{f:g}" for t, f in list(chosen.items())[:5])
            + (f" (+{len(chosen) - 5} more)" if len(chosen) > 5 else ""))
        if cfg.metric is not None:
            res.decisions.append(f"task metric {cfg.metric} decided first: {first_metric:.4g} -> {best_metric:.4g} "
                                 "(against the float reference on the calibration samples; SQNR broke ties)")
        if reached < len(pairs):
            res.decisions.append(f"time budget reached: {len(pairs) - reached} pair(s) not tuned")
        return res

    @staticmethod
    def _scores(graph: GraphHandle, scorer: OutputScore, kernels: Kernels) -> list[float]:
        """The SQNR (dB) of each scored output part with the run's kernels (the target CPU's arithmetic; the
        score: their min)."""
        model, held = graph.weightless_export()
        return scorer.per_output_db(kernels.session(model, weights={n: v for n, (v, _) in held.items()}))


class _Judge:
    """The objective: SQNR alone, or a task metric first and SQNR on ties (``metric``, module:function or built-in),
    computed on the outputs `OutputScore.per_output_db` just ran."""

    def __init__(self, metric: str | None, scorer: OutputScore, min_gain_db: float) -> None:
        self.fn = load_metric(metric) if metric is not None else None
        self.higher = getattr(self.fn, "higher_is_better", True)
        self.scorer, self.min_gain_db = scorer, min_gain_db
        self.refs = scorer.joined() if self.fn is not None else []

    def value(self) -> float:
        """The metric of the last scored candidate (0.0 without a metric)."""
        if self.fn is None:
            return 0.0
        return float(self.fn(self.scorer.joined(self.scorer.last), self.refs))

    def better(self, value: float, score: float, best_value: float, best: float) -> bool:
        """Whether (value, score) beats the best so far: a better metric, or an equal one and more SQNR."""
        if self.fn is not None and value != best_value and not math.isnan(value):
            return value > best_value if self.higher else value < best_value
        return score > best + self.min_gain_db


def _scored_parts(reference: onnx.ModelProto, cfg: TuneRangesConfig, res: PassResult) -> OutputParts | None:
    """The parts of the reference's outputs the score is the minimum over (None: every output whole), with one
    decision per split output (or per Concat output kept whole, and why)."""
    found = find_output_parts(reference)
    split = [s.output for s in found.outputs if s.split and (not cfg.outputs or s.output in cfg.outputs)]
    if not cfg.output_parts:
        if split:
            res.decide(f"{', '.join(split)} scored whole (output_parts: false), though a Concat joins different "
                       "tensors there: the largest part's error decides")
        return None
    for line in found.decisions(cfg.outputs):
        res.decide(line)
    return found

def _db(v: float) -> str:
    return f"{v:.2f} dB" if math.isfinite(v) else str(v)
