"""Dynamically quantized MatMuls back to float (`fall_back_dynamic`), the dynamic twin of `qgraph.remedy.fallback`.

A `qgraph.quant.dynamic_graph.DynamicUnit` (``DynamicQuantizeLinear`` + ``MatMulInteger`` + ``Cast`` + scale
``Mul``\\ s, or ``com.microsoft.MatMulIntegerToFloat`` / ``DynamicQuantizeMatMul``) becomes
``MatMul(X, W) -> Y``, named as the unit (the replaced MatMul's name when it can be told), reading the float tensor
the unit quantized at run time and writing the unit's own output tensor, so every reader is unchanged. A fused bias
becomes a float ``Add``. The other units reading the same ``X`` keep its ``DynamicQuantizeLinear``; one nobody reads
any more is removed by the one cleanup.

``W`` is the float weight from ``reference`` (`ReferenceWeights`: the recipe's float model, whose tensors carry the
same names) when it has one that the stored integers were quantized from (`qgraph.quant.math.matches_codes`: a
Gemm's folded ``alpha`` or ``transB``, or a model other than the one quantized, does not match), else the
dequantized codes ``(Wq - Wz) * Ws`` (then only the activation's quantization is undone; the outcome says which).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx_graphsurgeon as gs

from qgraph.graph import GraphHandle
from qgraph.quant.dynamic_graph import DynamicUnit
from qgraph.quant.math import matches_codes
from qgraph.quant.reference_weights import ReferenceWeights
from qgraph.remedy.fallback import PASS_NAME, FallbackOutcome


def fall_back_dynamic(graph: GraphHandle, units: Iterable[DynamicUnit], reference: ReferenceWeights | None = None,
                      out: FallbackOutcome | None = None, tag: str = PASS_NAME) -> FallbackOutcome:
    """Return ``units`` to float in place (see module docs), recording into ``out`` (a new outcome when None).
    One cleanup and one sort, whatever the number of units."""
    out = out if out is not None else FallbackOutcome()
    before = len(graph.graph.nodes)
    added: list[gs.Node] = []
    for unit in units:
        weight, restored = _float_weight(unit, reference)
        const = gs.Constant(graph.unique_name(f"{unit.name}/float_weight"), weight)
        (out.float_weights_restored if restored else out.dequantized_weights).append(const.name)
        y = unit.output
        for node in unit.nodes:  # detached first: a tensor has one producer
            node.outputs.clear()
            node.inputs.clear()
        if unit.bias is None:
            added.append(gs.Node("MatMul", name=unit.name, inputs=[unit.x, const], outputs=[y]))
        else:
            mid = gs.Variable(graph.unique_name(f"{y.name}/no_bias", kind="tensor"), dtype=np.float32)
            added.append(gs.Node("MatMul", name=unit.name, inputs=[unit.x, const], outputs=[mid]))
            added.append(gs.Node("Add", name=graph.unique_name(f"{unit.name}/bias", kind="node"),
                                 inputs=[mid, unit.bias], outputs=[y]))
        out.fallen_back.append(unit.name)
        out.dynamic[unit.name] = (unit.anchor_name, "float reference" if restored else "dequantized codes")
    if not added:
        return out
    graph.graph.nodes.extend(added)
    for node in added:
        graph.tag(node, tag)
    graph.cleanup()
    graph.toposort()
    out.nodes_added += len(added)
    out.nodes_removed += before + len(added) - len(graph.graph.nodes)
    return out


def _float_weight(unit: DynamicUnit, reference: ReferenceWeights | None) -> tuple[np.ndarray, bool]:
    """The reference's float weight when the codes were quantized from it (True), else the dequantized codes."""
    if reference is not None:
        values = reference.get(unit.output.name, 1, unit.weight_name)
        axis = 1 if unit.scale.size > 1 else None
        if values is not None and matches_codes(values, unit.codes, unit.scale, unit.zero_point, axis):
            return np.asarray(values, np.float32), True
    return unit.dequantized(), False
