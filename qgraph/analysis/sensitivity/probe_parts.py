"""The one-run probe (`qgraph.analysis.sensitivity.probe`) for outputs scored part by part
(`qgraph.runtime.output_parts`).

A part of an output that a final Concat joins is a scored output of its own: its weights ``κ`` start at the
Concat's input (`seeds`), so a node feeding the boxes has ``κ = 0`` for the scores. The Concat itself (with the
Q/DQ pairs on its inputs and output) writes every part: for it the probe measures ``Σ(ŷ - y)²`` and ``Σ y²`` on
each part (`part_reductions`, slices of its compared tensors reduced inside onnxruntime), and `part_weights` sets
its ``κ_o = η_o / η`` so that its output-referred noise ``η κ_o`` is the part's own ``η_o``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qgraph.runtime.output_parts import OutputPart, OutputParts

#: unit index, Σ(ŷ - y)² output name, Σ y² output name
PartReduction = tuple[int, str, str]


def cuts(parts: OutputParts | None) -> dict[str, list[tuple[int, OutputPart]]]:
    """Graph output -> (scored unit index, part) of every split output. Parts along axis 0 are left out: a batch
    of samples joined on axis 0 interleaves them, so they are not one slice."""
    if parts is None:
        return {}
    out: dict[str, list[tuple[int, OutputPart]]] = {}
    unit = 0
    for split in parts.outputs:
        for p in split.parts:
            if split.split and p.axis:
                out.setdefault(split.output, []).append((unit, p))
            unit += 1
    return out


def part_reductions(prefix: str, pairs: Sequence[tuple[str, str]], by_output: dict[str, list[tuple[int, OutputPart]]]
                    ) -> tuple[list[onnx.NodeProto], list[TensorProto], list[PartReduction]]:
    """For each compared ``(ŷ, y)`` pair whose ``y`` is a split graph output: per part, ``Σ(ŷ_p - y_p)²`` and
    ``Σ y_p²`` of the part's slice (float32 sums)."""
    nodes: list[onnx.NodeProto] = []
    consts: list[TensorProto] = []
    names: list[PartReduction] = []
    for j, (cand, ref) in enumerate(pairs):
        for unit, part in by_output.get(ref, ()):
            q = f"{prefix}{j}/part{unit}/"
            for key, value in (("start", part.start), ("stop", part.stop), ("axis", part.axis)):
                consts.append(numpy_helper.from_array(np.array([value], np.int64), q + key))
            bounds = [q + "start", q + "stop", q + "axis"]
            nodes += [
                helper.make_node("Slice", [cand, *bounds], [q + "cs"]),
                helper.make_node("Slice", [ref, *bounds], [q + "rs"]),
                helper.make_node("Cast", [q + "cs"], [q + "c"], to=TensorProto.FLOAT),
                helper.make_node("Cast", [q + "rs"], [q + "r"], to=TensorProto.FLOAT),
                helper.make_node("Sub", [q + "c", q + "r"], [q + "e"]),
                helper.make_node("ReduceSumSquare", [q + "e"], [q + "err"], keepdims=0),
                helper.make_node("ReduceSumSquare", [q + "r"], [q + "sig"], keepdims=0),
            ]
            names.append((unit, q + "err", q + "sig"))
    return nodes, consts, names


def seeds(structure: onnx.ModelProto, parts: OutputParts | None) -> list[str] | None:
    """The tensor each scored unit starts at: a split output's Concat input (its float tensor, which the float
    model's Concat reads), else the graph output (also when that tensor is not in the float model)."""
    if parts is None:
        return None
    outputs = [o.name for o in structure.graph.output]
    known = {t for n in structure.graph.node for t in n.output} | {i.name for i in structure.graph.input}
    return [outputs[k] if p.whole or p.source not in known else p.source
            for k, split in enumerate(parts.outputs) for p in split.parts]


def part_weights(weights: list[float], eta: float, sums: dict[int, list[float]]) -> list[float]:
    """``weights`` (κ per unit) with ``κ_o = η_o / η`` for the units measured on their own (``sums[o] = [Σ err,
    Σ sig]``), so that ``η κ_o = η_o``."""
    out = list(weights)
    for unit, (err, sig) in sums.items():
        if unit >= len(out):
            continue
        eta_o = err / sig if sig > 0 else (0.0 if err == 0 else math.inf)
        if eta > 0 and math.isfinite(eta):
            out[unit] = eta_o / eta
        elif eta_o > 0:
            out[unit] = 1.0  # the node's own noise is unmeasurable (inf): rank it as the output's
    return out
