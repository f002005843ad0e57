"""What auto mode's cosine/sqnr target scores: each part of an output that a final Concat joins
(`qgraph.runtime.output_parts`), or, with ``auto.output_parts: false``, every output whole."""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx

from qgraph import PassResult
from qgraph.analysis.sensitivity.targets import Target
from qgraph.runtime.output_parts import OutputParts, find_output_parts

from .details import FloatFallbackDetails

if TYPE_CHECKING:
    from .config import AutoFallbackConfig


def scored_parts(auto: AutoFallbackConfig, reference: onnx.ModelProto, target: Target, res: PassResult,
                 details: FloatFallbackDetails) -> OutputParts | None:
    """The parts the target scores (None for a user metric, which gets the outputs), with one decision per split
    output (or per Concat output kept whole, and why) in ``res`` and the split outputs in ``details``."""
    if target.kind == "metric":
        return None
    found = find_output_parts(reference)
    selected = [s for s in found.outputs if not target.outputs or s.output in target.outputs]
    if not auto.output_parts:
        split = [s.output for s in selected if s.split]
        if split:
            res.decide(f"auto: {', '.join(split)} scored whole (output_parts: false), though a Concat joins "
                       "different tensors there: the largest part's error decides")
        return found.without_parts()
    for line in found.decisions(target.outputs):
        res.decide(f"auto: {line}")
    if any(s.split or s.reason for s in selected):
        details["output_parts"] = found.to_dict()
    return found
