"""Diff two ONNX models: what changed structurally, and where the numbers diverge.

- `structural_diff` (nodes, ops, initializers, attributes, opsets, QDQ coverage, size, provenance);
- `numeric_diff` (every float tensor present in both models compared on the same inputs, in bounded memory,
  with the layer where the error first jumps);
- `attribute` (every Q/DQ pair of a quantized model ranked by the output error it causes, with the reason);
- `qgraph.analysis.diff.render`: terminal tables, JSON and a self-contained HTML page.

Tensors and pairs inside If/Loop bodies are covered too (`qgraph.analysis.diff.bodies`: each body observed as a model of
its own on its executions; a body the data does not reach is reported as not run).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import onnx
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from qgraph.analysis.diff.attribution import Attribution, Culprit
from qgraph.analysis.diff.culprits import EXACT_TOP, attribute
from qgraph.analysis.diff.layers import LayerDiff, NumericDiff
from qgraph.analysis.diff.numeric import numeric_diff
from qgraph.analysis.diff.qdq import NodeQuant, QdqCoverage, SaturationRisk, qdq_coverage, saturation_risks
from qgraph.analysis.diff.structural import StructuralDiff, structural_diff
from qgraph.data import Feed, open_data_source
from qgraph.errors import ModelError
from qgraph.runtime.class_outputs import class_outputs
from qgraph.runtime.evaluation import Evaluation, load_metric, score_stage
from qgraph.runtime.kernels.host import saturates
from qgraph.runtime.kernels.measure import KernelChoice, Kernels, choose, model_target, target_family

__all__ = [
    "Attribution",
    "Culprit",
    "LayerDiff",
    "NodeQuant",
    "NumericDiff",
    "QdqCoverage",
    "SaturationRisk",
    "StructuralDiff",
    "attribute",
    "compare_outputs",
    "diff_files",
    "feeds_for",
    "numeric_diff",
    "qdq_coverage",
    "saturation_risks",
    "structural_diff",
]


def feeds_for(model: onnx.ModelProto, inputs: str | os.PathLike[str], samples: int) -> Iterable[Feed]:
    """Feeds from a data source (``.npz``, folder, ``module:function``) bound to ``model``, or ``"random"``
    for seeded random inputs; at most ``samples`` of them."""
    if str(inputs) == "random":
        from qgraph.runtime.compare import random_feeds

        return random_feeds(model, samples)
    return open_data_source(str(inputs), samples=samples).bind(model)


def diff_files(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    inputs: str | os.PathLike[str] | None = None,
    samples: int = 8,
    labels: str | os.PathLike[str] | None = None,
    metric: str | None = None,
    exact_top: int = EXACT_TOP,
    whole_outputs: bool = False,
    kernels: str = "auto",
    target_cpu: str | None = None,
) -> tuple[StructuralDiff, NumericDiff | None]:
    """Structural diff of two model files, plus, when ``inputs`` (evaluation data) is given, the numeric diff,
    the outputs' top-1 agreement and metric, and the Q/DQ pairs ranked by the output error they cause. An output
    that a final Concat of A joins is also compared part by part and the ranking measures its worst part
    (`qgraph.runtime.output_parts`), unless ``whole_outputs``.

    B is measured for the CPU it was made for (its provenance; ``target_cpu`` overrides it): its outputs' top-1
    agreement, metric, SQNR and cosine with the kernels `qgraph.runtime.kernels.measure.choose` picks (and this host's
    deployed kernels beside them when those emulate another CPU); the layer-by-layer comparison with that CPU's
    arithmetic emulated (a fused integer kernel's intermediate tensors cannot be read), int16 pair saturation
    included for an AVX2 target."""
    from qgraph.io.model_io import load_model

    ma, mb = load_model(a), load_model(b)
    structural = structural_diff(ma, mb, a_path=a, b_path=b)
    if inputs is None:
        return structural, None
    if str(inputs) == "random":
        feeds = list(feeds_for(ma, inputs, samples))
        evaluation = Evaluation(feeds, f"{len(feeds)} seeded random input(s)", metric_spec=metric,
                                metric=load_metric(metric) if metric else None)
    else:
        evaluation = Evaluation.open(ma, str(inputs), labels=None if labels is None else str(labels), metric=metric,
                                     samples=samples)
    choice = choose(target_family(target_cpu) if target_cpu else model_target(mb), kernels)
    try:
        numeric = numeric_diff(ma, layers_model(mb, choice.kernels), evaluation.feeds, whole_outputs=whole_outputs)
        numeric.evaluation = compare_outputs(ma, mb, evaluation, choice)
        if structural.coverage_b.dequantize_nodes:
            numeric.attribution = attribute(ma, mb, evaluation.feeds, exact_top=exact_top,
                                            whole_outputs=whole_outputs)
    except (ort_state.Fail, ort_state.RuntimeException, ort_state.InvalidArgument) as exc:
        # a malformed node onnxruntime tolerates only when its optimizations fold it away (a per-axis scale of the
        # wrong length): the numeric diff reads every tensor, so it runs without them
        reason = str(exc).strip().splitlines()[0][:400] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"onnxruntime cannot run {a} or {b} tensor by tensor (graph optimizations off, as the "
                         f"layer-by-layer diff needs): {reason}. The node it names is malformed: fix it in the model "
                         "(a scale's length must match its axis).") from None
    return structural, numeric


def compare_outputs(a: onnx.ModelProto, b: onnx.ModelProto, evaluation: Evaluation,
                    choice: KernelChoice | None = None) -> dict[str, Any]:
    """Top-1 agreement of B with A, the metric of both, B's lowest output SQNR and cosine, on the evaluation
    samples, B run with ``choice`` (default: this host's deployed kernels; A with the kernels for its own CPU);
    ``host``: the same numbers on this host's deployed kernels when ``choice`` emulates another CPU;
    ``saturation``: B's layers whose int16 pair sums saturated."""
    choice = choice or choose(None)
    names, ref, *_ = evaluation.run(a, choose(model_target(a)).kernels)
    classes = class_outputs(a)  # top-1 agreement for class scores only
    got_names, got, saturation, emulation = evaluation.run(b, choice.kernels)
    # by name when both models name the same outputs (listed in any order); renamed outputs by position, as the
    # layer diff pairs them (`numeric._pair_tensors`), and its table shows that pairing
    by_name = got_names if sorted(got_names) == sorted(names) else None
    score = score_stage("B", ref, names, got, evaluation, got_names=by_name, classes=classes)
    out = {"data": evaluation.describe(), "top1_agreement": score.top1_agreement,
           "metric": evaluation.metric_spec, "metric_a": evaluation.score(ref, ref), "metric_b": score.metric,
           "metric_b_interval": score.metric_interval.to_dict() if score.metric_interval else None,
           "sqnr_db": score.sqnr_db, "cosine": score.cosine, "error": score.error,
           "kernels": choice.to_dict(), "measured_with": choice.kernels.label(),
           "saturation": [c.to_dict() for c in saturation], "emulation_notes": emulation}
    if choice.other is not None:
        host_names, host_got, *_ = evaluation.run(b, choice.other)
        host = score_stage("B", ref, names, host_got, evaluation, got_names=host_names if by_name else None,
                            classes=classes)
        out["host"] = {"measured_with": choice.other.label(), "top1_agreement": host.top1_agreement,
                       "metric_b": host.metric, "sqnr_db": host.sqnr_db, "cosine": host.cosine, "error": host.error}
    return out


def layers_model(model: onnx.ModelProto, kernels: Kernels) -> onnx.ModelProto:
    """The model the layer-by-layer comparison reads tensors from: ``model`` (its Q/DQ computed in float: exact
    int32 arithmetic), with an AVX2 target's pair saturation added where ``kernels`` emulate one."""
    if not (kernels.emulates and saturates(kernels.family)):
        return model
    from qgraph.runtime.kernels.emulate import emulate

    return emulate(model, kernels.family, host_saturates=kernels.host.probed_saturation, count=False).model
