"""Q/DQ structure on the graphsurgeon graph, for QDQ models from any tool: recognising Q and DQ nodes, their
constant parameters and integer range (`QParams`), the float tensor a DequantizeLinear stands for (`float_source`),
and which compute nodes are quantized.

A node is *quantized* when one of its inputs is produced by a ``DequantizeLinear`` (activation or weight) or when
one of its outputs reaches a graph output only through a ``QuantizeLinear → DequantizeLinear`` pair (its own output
quantization). Nothing depends on node names, doc strings or which tool wrote the model. The protobuf twins of the
predicates are `qgraph.quant.qdq.is_quantize` / `is_dequantize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from qgraph.graph import GraphHandle
from qgraph.quant.math import QuantDtype, dtype_range, fake_quantize_counted, storage_range
from qgraph.quant.math import dequantize as quant_dequantize
from qgraph.quant.qdq import is_dequantize, is_quantize
from qgraph.quant.qdq import is_qdq as qdq_op

#: Producers whose output is never negative: a folded Relu after them needs no restoring.
NON_NEGATIVE_OPS = frozenset({"Relu", "Softmax", "Sigmoid", "Abs", "Exp", "Softplus", "HardSigmoid", "Sqrt"})


def is_q(node: gs.Node) -> bool:
    """Whether ``node`` is a QuantizeLinear (ONNX or com.microsoft domain)."""
    return is_quantize(node.op, node.domain)


def is_dq(node: gs.Node) -> bool:
    """Whether ``node`` is a DequantizeLinear (ONNX or com.microsoft domain)."""
    return is_dequantize(node.op, node.domain)


def is_qdq(node: gs.Node, *, dynamic: bool = False) -> bool:
    """Whether ``node`` is a Q or DQ node (or, with ``dynamic``, a DynamicQuantizeLinear)."""
    return qdq_op(node.op, node.domain, dynamic=dynamic)


# The pair walker on the graphsurgeon graph (`qgraph.quant.qdq` has its twin on protos); every scope (the graph's
# tensor links).


def pair_q(graph: GraphHandle, dq: gs.Node) -> gs.Node | None:
    """The QuantizeLinear of the pair DequantizeLinear ``dq`` closes; None for a DQ of a constant or an input."""
    q = graph.producer(dq.inputs[0]) if dq.inputs else None
    return q if q is not None and is_q(q) else None


def pairs_reading(graph: GraphHandle, tensor: gs.Tensor) -> list[tuple[gs.Node, gs.Node]]:
    """``(Q, DQ)`` for every pair quantizing ``tensor``: a QuantizeLinear reading it as its data input, and each
    DequantizeLinear reading that Q's output."""
    return [(q, dq) for q in graph.consumers(tensor) if is_q(q) and q.inputs[0] is tensor
            for dq in graph.consumers(q.outputs[0]) if is_dq(dq) and dq.inputs[0] is q.outputs[0]]


@dataclass
class QParams:
    """Quantization parameters of a Q or DQ node (per-tensor or per-axis) and its integer range."""

    scale: np.ndarray
    zero_point: np.ndarray
    axis: int
    block_size: int
    qmin: int
    qmax: int

    @property
    def representable(self) -> tuple[float, float]:
        """Smallest and largest float values the pair can represent (over all channels)."""
        lo = (self.qmin - self.zero_point.astype(np.float64)) * self.scale.astype(np.float64)
        hi = (self.qmax - self.zero_point.astype(np.float64)) * self.scale.astype(np.float64)
        return float(np.min(lo)), float(np.max(hi))

    @property
    def clamps_at_zero(self) -> bool:
        """True when the zero point is the integer minimum, i.e. the pair also acts as ``Relu``."""
        return bool(np.all(self.zero_point.astype(np.int64) == self.qmin))


def qparams(graph: GraphHandle, node: gs.Node) -> QParams | None:
    """The constant quantization parameters of Q/DQ ``node``; None when they are computed at run time."""
    scale = graph.constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
    if scale is None:
        return None
    has_zp = len(node.inputs) > 2 and node.inputs[2].name
    zp = graph.constant_value(node.inputs[2]) if has_zp else np.zeros((), np.uint8)
    if zp is None:
        return None
    dtype = np.dtype(zp.dtype)
    if is_q(node) and not has_zp and "output_dtype" in node.attrs:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(node.attrs["output_dtype"])))
    # float8 and other non-integer carriers: no integer clamp to speak of (the int32 range stands for none)
    qmin, qmax = storage_range(dtype) or dtype_range(QuantDtype.INT32)
    return QParams(scale, zp, int(node.attrs.get("axis", 1)), int(node.attrs.get("block_size", 0)), qmin, qmax)


def dequantize(values: np.ndarray, params: QParams) -> np.ndarray:
    """``DequantizeLinear`` of ``values`` with ``params`` (`qgraph.quant.math.dequantize`), in the scale's dtype."""
    out = quant_dequantize(values, params.scale, params.zero_point, params.axis if params.scale.size > 1 else None,
                           params.block_size)
    return out.astype(params.scale.dtype)


def fake_quantize(values: np.ndarray, params: QParams) -> tuple[np.ndarray, int]:
    """``DQ(Q(x))`` and the number of saturated elements (`qgraph.quant.math.fake_quantize_counted`)."""
    axis = params.axis if params.scale.size > 1 else None
    return fake_quantize_counted(values, params.scale, params.zero_point, params.qmin, params.qmax, axis,
                                 params.block_size)


@dataclass
class FloatSource:
    """What a fallen-back node reads instead of a ``DequantizeLinear`` output."""

    tensor: gs.Tensor | None = None  # an existing float tensor (activation or float constant)
    weight_dq: gs.Node | None = None  # a DQ of an integer constant, to be materialized as a float constant
    relu: bool = False  # the bypassed pairs clamped at 0 on a tensor that can be negative
    problem: str | None = None  # why no float source exists


def float_source(graph: GraphHandle, tensor: gs.Tensor) -> FloatSource:
    """The float tensor behind the ``DequantizeLinear`` producing ``tensor`` (see module docs)."""
    relu = False
    current = tensor
    for _ in range(64):  # DQ→Q→DQ chains are short; the bound only guards against malformed loops
        dq = graph.producer(current)
        if dq is None or not is_dq(dq):
            return FloatSource(tensor=current, relu=relu and can_be_negative(graph, current))
        x = dq.inputs[0]
        q = graph.producer(x)  # not `pair_q`: what else writes it decides the problem reported
        if q is None:
            if isinstance(x, gs.Constant) or graph.constant_value(x) is not None:
                if qparams(graph, dq) is None:
                    return FloatSource(problem=f"weight DequantizeLinear {dq.name!r} has non-constant parameters")
                return FloatSource(weight_dq=dq)
            return FloatSource(
                problem=f"{dq.name!r} dequantizes {x.name!r}, an integer graph input: there is no float tensor to "
                "read instead"
            )
        if not is_q(q):
            return FloatSource(
                problem=f"{dq.name!r} dequantizes the output of {q.op} {q.name!r} (not a QuantizeLinear): not a "
                "QDQ pattern float_fallback can undo"
            )
        params = qparams(graph, q)
        relu = relu or (params is not None and params.clamps_at_zero)
        current = q.inputs[0]
    return FloatSource(problem=f"Q/DQ chain above {tensor.name!r} is too long")


def can_be_negative(graph: GraphHandle, tensor: gs.Tensor) -> bool:
    """Whether ``tensor`` may hold negative values (its producer is not one of `NON_NEGATIVE_OPS`, not a constant)."""
    prod = graph.producer(tensor)
    return prod is not None and prod.op not in NON_NEGATIVE_OPS and not isinstance(tensor, gs.Constant)


def owned_output_pairs(graph: GraphHandle, node: gs.Node) -> list[tuple[gs.Tensor, gs.Node]]:
    """``(float output, DQ)`` for each output of ``node`` reaching a graph output through ``Q → DQ``."""
    return [(t, dq) for t in node.outputs for _, dq in pairs_reading(graph, t) if graph.is_graph_output(dq.outputs[0])]


def is_quantized(graph: GraphHandle, node: gs.Node) -> bool:
    """Whether falling ``node`` back would change it (see module docs)."""
    if is_qdq(node):
        return False
    for t in node.inputs:
        prod = graph.producer(t)
        if prod is not None and is_dq(prod):
            return True
    return bool(owned_output_pairs(graph, node))


def quantized_nodes(graph: GraphHandle) -> list[gs.Node]:
    """Every quantized compute node of the top graph, in graph order (one walk over the index)."""
    return [n for n in graph.index.nodes if is_quantized(graph, n)]


def dq_inputs(graph: GraphHandle, node: gs.Node) -> list[int]:
    """Positions of ``node``'s inputs that are read through a ``DequantizeLinear``."""
    return [i for i, t in enumerate(node.inputs) if (p := graph.producer(t)) is not None and is_dq(p)]
