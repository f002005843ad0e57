"""Which layers ``quantize_weights`` takes, and their rewrite in the graph.

A layer is a MatMul or Gemm (``transA = 0``) whose weight is a constant 2-D float tensor read by it alone
(`qgraph.recovery.equalize.as_linear`); the weight is read as ``W [K, N]`` (``transB`` Gemm weights are transposed
views) with Gemm's ``alpha`` folded in. Everything else is skipped with the reason.

Rewrites, in place (the node keeps its name and output, so `qgraph diff` pairs it with the float layer):

- ``matmul_nbits``: the node becomes ``com.microsoft.MatMulNBits(A, B, scales, zero_points?, , bias?)``; a
  Gemm's ``beta · C`` (``[N]`` or ``[1, N]``) becomes the bias input;
- ``qdq``: ``DequantizeLinear(codes, scale, zero_point?)`` named ``<weight>/dq`` produces
  ``<weight>/dequantized``, which the MatMul/Gemm reads instead of the float weight (``alpha`` set to 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from qgraph import GraphHandle
from qgraph.graph import NoMatch, const_value
from qgraph.recovery.equalize import LinearLayer, as_linear

from .packing import MS_DOMAIN, Packed

PASS = "quantize_weights"


@dataclass
class Layer:
    """A layer to quantize: the node, its weight's layout and Gemm's factors."""

    linear: LinearLayer
    alpha: float = 1.0
    bias: np.ndarray | None = None  # MatMulNBits bias (beta · C as [N]) for a Gemm with C

    @property
    def node(self) -> gs.Node:
        """The MatMul/Gemm node."""
        return self.linear.node

    @property
    def weight_name(self) -> str:
        """The float weight's name (new tensors are named after it)."""
        return str(self.linear.weight.name)

    def matrix(self) -> np.ndarray:
        """``alpha · W`` as ``[K, N]`` float32 (a view where no scaling is needed)."""
        w = const_value(self.linear.weight)
        assert w is not None
        m = self.linear.matrix(np.asarray(w))
        return np.asarray(m * np.float32(self.alpha) if self.alpha != 1.0 else m, np.float32)

    def stored(self, matrix: np.ndarray) -> np.ndarray:
        """A ``[K, N]`` matrix in the weight's stored layout and dtype (Gemm ``transB``, ``alpha`` undone)."""
        m = matrix / np.float32(self.alpha) if self.alpha != 1.0 else matrix
        return np.ascontiguousarray(m.T if self.linear.transposed else m).astype(self.dtype)

    @property
    def dtype(self) -> np.dtype[Any]:
        """The weight's float type (scales are stored in it)."""
        w = const_value(self.linear.weight)
        assert w is not None
        return w.dtype


def as_layer(node: gs.Node, format_: str) -> Layer:
    """``node`` as a `Layer`, or `NoMatch` with the reason."""
    if node.op not in ("MatMul", "Gemm"):
        raise NoMatch(f"{node.op} is not a MatMul/Gemm")
    linear = as_linear(node)
    w = const_value(linear.weight)
    assert w is not None
    if w.dtype not in (np.float32, np.float16):
        raise NoMatch(f"its weight is {w.dtype}, not float32/float16")
    if node.op == "MatMul":
        return Layer(linear)
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    bias = None
    if linear.bias is not None and format_ == "matmul_nbits":
        c = const_value(linear.bias)
        assert c is not None
        n = linear.out_channels(w)
        if c.size not in (1, n):
            raise NoMatch(f"its bias C has shape {c.shape}; MatMulNBits takes a bias per output column")
        bias = (np.broadcast_to(np.asarray(c, np.float32).reshape(-1), (n,)) * beta).astype(w.dtype)
    return Layer(linear, alpha, bias)


def _const(proto: Any) -> gs.Constant:
    return gs.Constant(proto.name, LazyValues(proto))


def emit(graph: GraphHandle, layer: Layer, packed: Packed) -> list[gs.Node]:
    """Rewrite ``layer`` with ``packed`` (module docstring); returns the nodes created."""
    node = layer.node
    t = {role: _const(proto) for role, proto in packed.tensors.items()}
    if packed.op == "MatMulNBits":
        inputs: list[gs.Tensor] = [node.inputs[0], t["B"], t["scales"]]
        if "zero_points" in t or layer.bias is not None:
            inputs.append(t.get("zero_points", gs.Variable.empty()))
        if layer.bias is not None:
            bias = gs.Constant(graph.unique_name(f"{layer.weight_name}/bias", kind="tensor"), layer.bias)
            inputs += [gs.Variable.empty(), bias]
        node.op, node.domain = "MatMulNBits", MS_DOMAIN
        node.attrs.clear()
        node.attrs.update(packed.attrs)
        node.inputs.clear()
        node.inputs.extend(inputs)
        graph.import_domain(MS_DOMAIN)
        return []
    weight = layer.linear.weight
    out = gs.Variable(graph.unique_name(f"{weight.name}/dequantized", kind="tensor"), dtype=layer.dtype,
                      shape=list(np.asarray(const_value(weight)).shape))
    dq_inputs = [t["codes"], t["scale"], *([t["zero_point"]] if "zero_point" in t else [])]
    dq = gs.Node("DequantizeLinear", graph.unique_name(f"{weight.name}/dq", kind="node"), attrs=dict(packed.attrs),
                 inputs=dq_inputs, outputs=[out])
    graph.tag(dq, PASS)
    node.inputs[1] = out
    if node.op == "Gemm":
        node.attrs["alpha"] = 1.0
    return [dq]
