"""Diff two ONNX models: what changed structurally, and where the numbers diverge.

- `structural_diff` (nodes, ops, initializers, attributes, opsets, QDQ coverage, size, provenance);
- `numeric_diff` (every float tensor present in both models compared on the same inputs, in bounded memory,
  with the layer where the error first jumps);
- `attribute` (every Q/DQ pair of a quantized model ranked by the output error it causes, with the reason);
- `qgraph.diff.render`: terminal tables, JSON and a self-contained HTML page.

Tensors and pairs inside If/Loop bodies are covered too (`qgraph.diff.bodies`: each body observed as a model of
its own on its executions; a body the data does not reach is reported as not run).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import onnx

from qgraph.data import Feed, open_data_source
from qgraph.diff.culprits import EXACT_TOP, Attribution, Culprit, attribute
from qgraph.diff.layers import LayerDiff, NumericDiff
from qgraph.diff.numeric import numeric_diff
from qgraph.diff.qdq import NodeQuant, QdqCoverage, SaturationRisk, qdq_coverage, saturation_risks
from qgraph.diff.structural import StructuralDiff, structural_diff
from qgraph.evaluation import Evaluation, load_metric, score_stage

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
        from qgraph.compare import random_feeds

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
) -> tuple[StructuralDiff, NumericDiff | None]:
    """Structural diff of two model files, plus, when ``inputs`` (evaluation data) is given, the numeric diff,
    the outputs' top-1 agreement and metric, and the Q/DQ pairs ranked by the output error they cause. An output
    that a final Concat of A joins is also compared part by part and the ranking measures its worst part
    (`qgraph.output_parts`), unless ``whole_outputs``."""
    from qgraph.model_io import load_model

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
    numeric = numeric_diff(ma, mb, evaluation.feeds, whole_outputs=whole_outputs)
    numeric.evaluation = compare_outputs(ma, mb, evaluation)
    if structural.coverage_b.dequantize_nodes:
        numeric.attribution = attribute(ma, mb, evaluation.feeds, exact_top=exact_top, whole_outputs=whole_outputs)
    return structural, numeric


def compare_outputs(a: onnx.ModelProto, b: onnx.ModelProto, evaluation: Evaluation) -> dict[str, Any]:
    """Top-1 agreement of B with A and the metric of both on the evaluation samples."""
    names, ref = evaluation.outputs(a)
    score = score_stage("B", ref, names, evaluation.outputs(b)[1], evaluation)
    return {"data": evaluation.describe(), "top1_agreement": score.top1_agreement,
            "metric": evaluation.metric_spec, "metric_a": evaluation.score(ref, ref), "metric_b": score.metric,
            "error": score.error}
