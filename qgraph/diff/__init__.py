"""Diff two ONNX models: what changed structurally, and where the numbers diverge.

- `structural_diff` (nodes, ops, initializers, attributes, opsets, QDQ coverage, size, provenance);
- `numeric_diff` (every float tensor present in both models compared on the same inputs, in bounded memory,
  with the layer where the error first jumps);
- `qgraph.diff.render`: terminal tables, JSON and a self-contained HTML page.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import onnx

from qgraph.data import Feed, open_data_source
from qgraph.diff.layers import LayerDiff, NumericDiff
from qgraph.diff.numeric import numeric_diff
from qgraph.diff.qdq import NodeQuant, QdqCoverage, SaturationRisk, qdq_coverage, saturation_risks
from qgraph.diff.structural import StructuralDiff, structural_diff

__all__ = [
    "LayerDiff",
    "NodeQuant",
    "NumericDiff",
    "QdqCoverage",
    "SaturationRisk",
    "StructuralDiff",
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
) -> tuple[StructuralDiff, NumericDiff | None]:
    """Structural diff of two model files, plus the numeric diff when ``inputs`` is given."""
    from qgraph.model_io import load_model

    ma, mb = load_model(a), load_model(b)
    structural = structural_diff(ma, mb, a_path=a, b_path=b)
    numeric = numeric_diff(ma, mb, feeds_for(ma, inputs, samples)) if inputs is not None else None
    return structural, numeric
