"""Op tables for placement: what each op type becomes in onnxruntime's QDQ fusion, and float-type tracking."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from qgraph.quant.qdq_graph import is_dq

#: Ops with a weight input: fused into QLinearConv / QGemm / QLinearMatMul / MatMulIntegerToFloat.
WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
#: Elementwise binary ops fused into QLinearAdd / QLinearMul (need Q/DQ on both inputs and the output).
BINARY = frozenset({"Add", "Mul"})
#: Variadic ops fused into QLinearConcat.
VARIADIC = frozenset({"Concat"})
#: Single-input ops with a QLinear* kernel (lookup table or integer pooling).
UNARY = frozenset({"AveragePool", "GlobalAveragePool", "LeakyRelu", "Sigmoid", "Softmax"})
#: Activations that disappear into the producer's integer kernel when the output Q clips the same way.
CLIPPING = frozenset({"Relu", "Clip"})
#: Data-movement ops: Q/DQ with equal parameters around them are dropped (they run on integers).
MOVEMENT = frozenset(
    {
        "Reshape",
        "Transpose",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "MaxPool",
        "Slice",
        "Gather",
        "GatherElements",
        "Expand",
        "Tile",
        "Resize",
        "Split",
        "Identity",
    }
)
#: Ops whose output Q is required for onnxruntime to fuse them (MatMul/Gemm also fuse with a float output).
NEEDS_Q_OUT = frozenset({"Conv", "ConvTranspose"}) | BINARY | VARIADIC | UNARY | CLIPPING

#: Ops whose (first) output has the element type of their first input.
_SAME_TYPE = (
    WEIGHTED
    | BINARY
    | VARIADIC
    | UNARY
    | CLIPPING
    | MOVEMENT
    | {
        "Sub",
        "Div",
        "Pow",
        "Sqrt",
        "Exp",
        "Log",
        "Tanh",
        "Erf",
        "Gelu",
        "Neg",
        "Abs",
        "Reciprocal",
        "LayerNormalization",
        "BatchNormalization",
        "InstanceNormalization",
        "ReduceMean",
        "ReduceSum",
        "ReduceMax",
        "ReduceMin",
        "Pad",
        "Dropout",
        "HardSigmoid",
        "HardSwish",
        "Softplus",
        "Elu",
        "Selu",
        "PRelu",
        "Max",
        "Min",
        "Sum",
        "Mean",
        "Einsum",
        "SpaceToDepth",
        "DepthToSpace",
        "GlobalMaxPool",
        "ConvInteger",
    }
)
_FLOAT = {np.dtype(np.float32)}


def _dtype(t: gs.Tensor) -> np.dtype[Any] | None:
    dt = getattr(t, "dtype", None)
    if dt is None:
        return None
    try:
        out: np.dtype[Any] = np.dtype(dt)
        return out
    except TypeError:
        return None


def float32_tensors(nodes: Iterable[gs.Node], inputs: Iterable[gs.Tensor]) -> set[str]:
    """Names of tensors known to be float32, from declared types plus forward propagation (one walk).

    Graph inputs, initializers and tensors with value_info carry their type; other outputs inherit the type
    of the node's first input for type-preserving ops (Conv, Add, Reshape, ...), ``Cast`` gives its ``to``.
    """
    out: set[str] = set()
    for t in inputs:
        if _dtype(t) in _FLOAT:
            out.add(t.name)
    for node in nodes:
        for t in node.inputs:
            if t.name and _dtype(t) in _FLOAT:
                out.add(t.name)
        first = node.inputs[0] if node.inputs else None
        for k, t in enumerate(node.outputs):
            if not t.name:
                continue
            dt = _dtype(t)
            if dt is not None:
                if dt in _FLOAT:
                    out.add(t.name)
                continue
            if node.op == "Cast":
                if node.attrs.get("to") == 1:
                    out.add(t.name)
            elif node.op == "Where" and len(node.inputs) > 1:
                if node.inputs[1].name in out:
                    out.add(t.name)
            elif is_dq(node) or (
                node.op in _SAME_TYPE and first is not None and first.name in out and (k == 0 or node.op == "Split")
            ):
                out.add(t.name)
            elif node.op in ("If", "Loop") and _body_output_dtype(node, k) in _FLOAT:
                out.add(t.name)
    return out


def _body_output_dtype(node: gs.Node, k: int) -> Any:
    """The declared dtype of what becomes output ``k`` of an If (its then branch's output k) or a Loop (body
    output k + 1: the body's first output is the loop condition)."""
    body = node.attrs.get("then_branch" if node.op == "If" else "body")
    outputs = getattr(body, "outputs", None)
    j = k if node.op == "If" else k + 1
    return _dtype(outputs[j]) if outputs is not None and j < len(outputs) else None
