"""The ``correct_bias`` pass: empirical bias correction of a QDQ model (Nagel et al. 2019; AIMET's and Quark's
"empirical bias correction").

Quantizing a layer's weights shifts the mean of its output; the shift is the same for every input, so the bias can
take it back. For each quantized Conv/Gemm/MatMul (weight behind Q/DQ) and output channel ``c``, on the
calibration data, ``b_c += delta_c`` with, by ``mode``:

- ``local`` (default): ``delta = E[W_float x_q + b_float] - E[Ŵ x_q + b̂]``, the layer's *own* mean error on the
  quantized input ``x_q`` it reads (float weight and bias from `PassContext.float_reference`). The layer is
  linear, so this is ``(W_float - Ŵ) · E[row of x_q] + (b_float - b̂)``: one run of the quantized model (Q/DQ as
  written, in float: no host-specific integer kernels) measures every layer's mean input row (the mean im2col row
  of a Conv; `qgraph.runtime.row_means`), and the rest is arithmetic in float64. No double counting: correcting
  layer ``k`` does not change what layer ``k + 1`` corrects.
- ``one_shot``: ``delta = E[y_float] - E[y_quant]`` from one run of the float model and one of the quantized model
  (the textbook empirical form, all layers at once). In a deep chain every layer also "corrects" the shift its
  upstream layers already correct: on PP-LCNet it overshoots (measured below).
- ``sequential``: the same global difference, re-measured before each of ``rounds`` groups of layers in graph
  order (default: one layer per round: exact, ``L + 1`` runs; few rounds overshoot like ``one_shot``).

``y`` is the layer's output before any activation (the bias Add's output after a MatMul). An int32 bias moves by
``round(delta / bias_scale)`` codes (clamped to int32), a float bias by ``delta``; a Conv/Gemm without bias gets one
(int32 with scale ``s_x · s_w`` when both are known). Means are reduced inside onnxruntime
(`qgraph.runtime.channel_means`): memory stays that of one inference. ``measure_after`` (off by default: the guard
measures the outputs) measures the rows again on the corrected graph, for the error left per layer.

Cost (``local``): DNSMOS (speechmos wheel, 16 clips of 9 s, AVX512-VNNI host) 4.6 s for the rows, where a float
twin of every layer run beside it took 8.3 s (and a second run after); the whole pass 22.8 s -> 10.5 s.

Measured (``benchmarks/bench_weight_correction.py``): per-tensor depthwise test net 31.0 dB -> 37.1 (local),
40.0 (sequential per layer), 32.6 (one_shot); PP-LCNet orientation (per-channel INT8, logits SQNR / top-1)
10.8 dB / 0.672 -> local 11.3 dB / 0.703 (+5.8 s, about the float calibration time), sequential per layer
8.9 dB / 0.719 (+57 s), one_shot 2.9 dB.

A guard (``guard: true``, default) scores the model against the float reference on ``guard_samples`` calibration
samples before and after (the minimum SQNR over outputs, each part of a Concat-joined output on its own;
`qgraph.recovery.weight_correction.FidelityGuard`) and undoes the correction where it makes the model worse:
``one_shot`` on a chain of linear convolutions overshoots (35.7 -> 30.0 dB held out, undone); on YOLOv8n the local
correction lifts the class-score part 17.0 -> 18.0 dB on calibration data and is kept. A drop is undone only where
those samples show it: the 95 % paired bootstrap interval of the change lies wholly below ``guard_tolerance_db``
(`qgraph.metrics.interval.sqnr_change`). YOLOv8n calibrated on 320 images read 17.32 -> 16.97 dB on 32 of them
(interval -2.03 to +0.99 dB); a fixed 0.05 dB rule undid that correction, which is worth +3.2 dB on the class
scores of 640 held-out images (logit error near the threshold 0.57 -> 0.37). It costs two runs of the
quantized model on those samples, and a run of the float reference unless calibration kept its outputs
(`qgraph.recovery.reference_outputs`: DNSMOS 16 clips, correct_bias 6.0 -> 3.6 s).

Recipe (after the quantizing pass; run it after ``optimize_rounding`` when both are used)::

    - pass: insert_qdq
      preset: ort-x86-vnni
    - pass: correct_bias
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from pydantic import Field

from qgraph import GraphHandle, NodeSelector, PassContext, PassDetails, PassResult, register
from qgraph.quant.layers import QuantLayer, ensure_bias, float_biases
from qgraph.recovery.weight_correction import (
    CorrectionPass,
    FidelityGuard,
    GuardConfig,
    calibration_batches,
    weightless,
)
from qgraph.runtime.layer_data import channel_means
from qgraph.runtime.row_means import RowSource, conv_rows, matrix_rows, row_means

__all__ = ["CorrectBias", "CorrectBiasConfig"]

NAME = "correct_bias"


@dataclass(frozen=True)
class CorrectBiasDetails(PassDetails):
    """The biases `CorrectBias` created (None: none), each corrected layer's numbers (by layer) and how many times
    the model ran; the last two are None when no layer was left to correct."""

    biases_created: list[str] | None = None
    layers: dict[str, dict[str, float]] | None = None
    model_runs: int | None = None


class CorrectBiasConfig(GuardConfig):
    """Which layers to correct and how to order the corrections."""

    mode: Literal["local", "one_shot", "sequential"] = Field(
        default="local",
        description="local: each layer's own mean error on the quantized input it reads, (W_float - W_q) times its "
        "mean input row plus the bias difference, one run; "
        "one_shot: E[y_float] - E[y_quant] of all layers from one paired float/quantized run; sequential: the "
        "same in `rounds` groups in graph order, re-measuring the quantized model before each group.",
    )
    rounds: int | None = Field(
        default=None, ge=1, description="sequential: groups of layers (runs of the quantized model); default: one "
        "per layer (exact, one run per layer).")
    nodes: NodeSelector | None = Field(default=None, description="Only correct these layers (default: all).")
    create_bias: bool = Field(default=True, description="Give a quantized Conv/Gemm without bias one to correct.")
    measure_after: bool = Field(
        default=False, description="One more run of the quantized model (measuring the rows again) to report the "
        "mean error left per layer. Off by default: the guard already measures what the correction did to the "
        "outputs, and this run costs as much as the measurement itself.")


def _tensors(layers: list[QuantLayer]) -> dict[str, tuple[int, bool]]:
    return {la.output: (la.channels, la.node.op == "Conv" and la.output == la.node.outputs[0].name) for la in layers}


def _means(graph: GraphHandle, ctx: PassContext, tensors: dict[str, tuple[int, bool]]
           ) -> dict[str, npt.NDArray[np.float64]]:
    """`channel_means` of the current graph, its session reading the graph's weights in place."""
    model, shared = weightless(graph)
    return channel_means(model, tensors, calibration_batches(ctx), shared)


def _rows(layer: QuantLayer) -> RowSource:
    """Where ``layer``'s input rows come from (`qgraph.runtime.row_means`)."""
    node = layer.node
    x = node.inputs[0].name
    if node.op == "Conv":
        w = layer.weight.values.shape
        return conv_rows(x, int(w[1]) * layer.groups, w[2:], node.attrs)
    k = int(layer.rows(np.empty(layer.weight.values.shape, np.bool_)).shape[1])
    return matrix_rows(x, k, transposed=node.op == "Gemm" and bool(int(node.attrs.get("transA", 0))))


def _rms(x: npt.NDArray[np.float64]) -> float:
    return float(math.sqrt(float(np.mean(np.square(x))))) if x.size else 0.0


@register
class CorrectBias(CorrectionPass[CorrectBiasConfig]):
    """Empirical bias correction: b += mean output error per output channel of each quantized layer.

    Needs calibration data and the float model (run it after ``insert_qdq`` in the same recipe). ``mode: local``
    (each layer's own error, one run; default), ``one_shot`` or ``sequential`` (E[y_float] - E[y_quant] against
    the float model, at once or in ``rounds``); see the module docstring.
    """

    name = NAME
    config_class = CorrectBiasConfig

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Measure the mean output errors and fold them into the biases (module docstring)."""
        res = PassResult()
        cands = self.start(graph, ctx, self.config.nodes, res)
        if cands is None:
            return res
        layers = []
        created: list[str] = []
        for layer in cands.layers:
            res.matched += 1
            had = layer.bias is not None
            if not had and not (self.config.create_bias and ensure_bias(graph, layer, NAME)):
                res.skip(layer.name, "no bias operand of its own to correct (a MatMul without Add, a shared bias, "
                         "or create_bias: false)")
                continue
            if not had:
                res.nodes_added += int(layer.bias is not None and layer.bias.kind == "int32")
                created.append(layer.name)
            layers.append(layer)
        res.details = CorrectBiasDetails(biases_created=created or None)
        if created:
            graph.toposort()  # the new bias DequantizeLinear nodes were appended: once, not per layer
        graph.changed()
        if not layers:
            res.notes.append("no layer to correct")
            return res
        assert ctx.float_reference is not None
        guard = FidelityGuard.start(self.config, graph, ctx, layers, res)
        if self.config.mode == "local":
            per_layer, runs, clipped = self._local(graph, ctx, layers, cands.float_weights)
        else:
            per_layer, runs, clipped = self._global(graph, ctx, layers)
        res.rewritten = sum(int(v.pop("changed")) for v in per_layer.values())
        res.details = CorrectBiasDetails(biases_created=created or None, layers=per_layer, model_runs=runs)
        if clipped:
            res.notes.append(f"{clipped} int32 bias code(s) saturated")
        changed, what = res.rewritten, self._summary(per_layer, runs)
        # One line says what happened and why: corrected (and the guard's measure), or undone and why.
        if guard is None:
            res.decide(f"bias correction: {changed} of {len(per_layer)} layer bias(es) corrected ({what})")
        elif guard.finish(graph, self.config.guard_tolerance_db, report=False):
            res.decide(f"bias correction: {changed} of {len(per_layer)} layer bias(es) corrected ({what}); kept: "
                       f"{guard.measured()}")
        else:
            res.rewritten = 0
            res.decide(f"bias correction undone, every bias is as before: correcting {changed} of {len(per_layer)} "
                       f"layer bias(es) ({what}) lowered the {guard.measured()} (guard: false keeps it)")
        return res

    def _apply(self, layer: QuantLayer, delta: npt.NDArray[np.float64]) -> tuple[bool, int]:
        before = layer.bias_values()
        clipped = layer.shift_bias(delta)
        after = layer.bias_values()
        return before is None or after is None or not np.array_equal(before, after), clipped

    def _local(self, graph: GraphHandle, ctx: PassContext, layers: list[QuantLayer],
               weights: dict[str, npt.NDArray[np.float32]]) -> tuple[dict[str, dict[str, float]], int, int]:
        """Each layer's own mean error, E[layer_float(x_q)] - E[layer_quant(x_q)], from the mean input row of every
        layer in one run (`QuantLayer.mean_error`); ``measure_after`` measures the rows again on the corrected
        graph (its upstream corrections move them)."""
        assert ctx.float_reference is not None
        biases = float_biases(ctx.float_reference, layers, ctx.float_reference_weights)
        sources = [_rows(la) for la in layers]

        def errors() -> list[npt.NDArray[np.float64]]:
            model, shared = weightless(graph)
            rows = row_means(model, sources, calibration_batches(ctx), shared)
            return [la.mean_error(weights[la.output], biases[la.output], r) for la, r in zip(layers, rows, strict=True)]

        per_layer: dict[str, dict[str, float]] = {}
        clipped = 0
        for layer, delta in zip(layers, errors(), strict=True):
            changed, c = self._apply(layer, delta)
            clipped += c
            per_layer[layer.name] = {"mean_error_rms_before": _rms(delta), "changed": changed}
        graph.changed()
        if self.config.measure_after:
            for layer, left in zip(layers, errors(), strict=True):
                per_layer[layer.name]["mean_error_rms_after"] = _rms(left)
        return per_layer, 1 + self.config.measure_after, clipped

    def _global(self, graph: GraphHandle, ctx: PassContext,
                layers: list[QuantLayer]) -> tuple[dict[str, dict[str, float]], int, int]:
        """E[y_float] - E[y_quant] against the float model, all at once or in rounds (module docstring)."""
        assert ctx.float_reference is not None
        target = channel_means(ctx.float_reference, _tensors(layers), calibration_batches(ctx),
                               ctx.float_reference_weights)
        groups = self._groups(layers)
        per_layer: dict[str, dict[str, float]] = {}
        clipped = 0
        for group in groups:
            measured = _means(graph, ctx, _tensors(group))
            for layer in group:
                delta = target[layer.output] - measured[layer.output]
                changed, c = self._apply(layer, delta)
                clipped += c
                per_layer[layer.name] = {"mean_error_rms_before": _rms(delta), "changed": changed}
            graph.changed()
        runs = len(groups) + 1
        if self.config.measure_after:
            left = _means(graph, ctx, _tensors(layers))
            runs += 1
            for layer in layers:
                per_layer[layer.name]["mean_error_rms_after"] = _rms(target[layer.output] - left[layer.output])
        return per_layer, runs, clipped

    def _groups(self, layers: list[QuantLayer]) -> list[list[QuantLayer]]:
        if self.config.mode == "one_shot":
            return [layers]
        k = len(layers) if self.config.rounds is None else min(self.config.rounds, len(layers))
        bounds = np.linspace(0, len(layers), k + 1).round().astype(int)
        return [layers[a:b] for a, b in itertools.pairwise(bounds) if b > a]

    def _summary(self, per_layer: dict[str, dict[str, float]], runs: int) -> str:
        before = float(np.median([v["mean_error_rms_before"] for v in per_layer.values()]))
        text = f"{self.config.mode}, {runs} model run(s); median per-layer mean-error RMS {before:.3g}"
        if self.config.measure_after:
            after = float(np.median([v["mean_error_rms_after"] for v in per_layer.values()]))
            text += f" -> {after:.3g}"
        return text
