"""Structural QDQ analysis and the float-fallback rewrite, for QDQ models from any tool.

A node is *quantized* when one of its inputs is produced by a ``DequantizeLinear`` (activation or weight) or
when one of its outputs reaches a graph output only through a ``QuantizeLinear → DequantizeLinear`` pair (its
own output quantization). Nothing depends on node names, doc strings or which tool wrote the model.

Falling a node back to float (`fall_back`) rewires it, and only it:

- every input read through ``DequantizeLinear`` is rewired to the float tensor behind it: the input of the
  ``QuantizeLinear`` for activations (walking back through ``DQ → Q → DQ`` chains), the float constant for
  weights stored as ``Q(float constant)``, or a new float constant equal to ``DQ(int constant)`` for weights
  stored as integers (the original float weights are not in such a model; the dequantized values are what
  the quantized model computed with, so the weight side is exact w.r.t. the QDQ model);
- an output that reaches a graph output through ``Q → DQ`` is connected to that graph output directly.

Shared pairs are never modified: a quantized neighbour that reads the same ``DQ`` output keeps reading it (the
fallen-back node is the one that gets rewired), and a neighbour that reads a ``DQ`` whose output is also a graph
output gets that pair on a renamed output, so it stays quantized and bit-identical. Q/DQ nodes that serve no
one afterwards are removed by one cleanup.

With the float model the QDQ model was made from (`ReferenceWeights`: the pipeline's float reference, whose
tensors carry the same names), a weight stored as integers is restored to its float value instead: the constant
input at the same position of the reference node producing the same output tensor (so BatchNorm folding,
equalization and bias correction of the quantized model are undone only for the nodes that go back to float).

Quantizers fold ``Relu`` into the ``QuantizeLinear`` after a Conv/MatMul when its range starts at 0 (onnxruntime
does). Bypassing such a pair would silently drop the Relu, so when a bypassed pair clamps at exactly 0 and the
tensor's producer is not already non-negative, a ``Relu`` is inserted on the float path (``<tensor>/relu``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from qgraph import GraphHandle
from qgraph.qdq import is_dequantize, is_quantize
from qgraph.quant import dequantize as quant_dequantize
from qgraph.quant import fake_quantize_counted
from qgraph.reference_weights import ReferenceWeights as ReferenceWeights  # public here since before the split

PASS_NAME = "float_fallback"
#: Producers whose output is never negative: a folded Relu after them needs no restoring.
NON_NEGATIVE_OPS = frozenset({"Relu", "Softmax", "Sigmoid", "Abs", "Exp", "Softplus", "HardSigmoid", "Sqrt"})
_INT_RANGES: dict[Any, tuple[int, int]] = {
    np.dtype(np.uint8): (0, 255),
    np.dtype(np.int8): (-128, 127),
    np.dtype(np.uint16): (0, 65535),
    np.dtype(np.int16): (-32768, 32767),
    np.dtype(np.int32): (-(2**31), 2**31 - 1),
}


def is_q(node: gs.Node) -> bool:
    """Whether ``node`` is a QuantizeLinear (ONNX or com.microsoft domain)."""
    return is_quantize(node.op, node.domain)


def is_dq(node: gs.Node) -> bool:
    """Whether ``node`` is a DequantizeLinear (ONNX or com.microsoft domain)."""
    return is_dequantize(node.op, node.domain)


def is_qdq(node: gs.Node) -> bool:
    """Whether ``node`` is a Q or DQ node."""
    return is_q(node) or is_dq(node)


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
    qmin, qmax = _INT_RANGES.get(dtype, (0, 0))
    if qmin == qmax == 0:
        try:
            info = np.iinfo(dtype)
            qmin, qmax = int(info.min), int(info.max)
        except ValueError:  # float8 and other non-integer carriers: no integer clamp to speak of
            qmin, qmax = -(2**31), 2**31 - 1
    return QParams(scale, zp, int(node.attrs.get("axis", 1)), int(node.attrs.get("block_size", 0)), qmin, qmax)


def dequantize(values: np.ndarray, params: QParams) -> np.ndarray:
    """``DequantizeLinear`` of ``values`` with ``params`` (`qgraph.quant.dequantize`), in the scale's dtype."""
    out = quant_dequantize(values, params.scale, params.zero_point, params.axis if params.scale.size > 1 else None,
                           params.block_size)
    return out.astype(params.scale.dtype)


def fake_quantize(values: np.ndarray, params: QParams) -> tuple[np.ndarray, int]:
    """``DQ(Q(x))`` and the number of saturated elements (`qgraph.quant.fake_quantize_counted`)."""
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
            return FloatSource(tensor=current, relu=relu and _can_be_negative(graph, current))
        x = dq.inputs[0]
        q = graph.producer(x)
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


def _can_be_negative(graph: GraphHandle, tensor: gs.Tensor) -> bool:
    prod = graph.producer(tensor)
    return prod is not None and prod.op not in NON_NEGATIVE_OPS and not isinstance(tensor, gs.Constant)


def owned_output_pairs(graph: GraphHandle, node: gs.Node) -> list[tuple[gs.Tensor, gs.Node]]:
    """``(float output, DQ)`` for each output of ``node`` reaching a graph output through ``Q → DQ``."""
    pairs: list[tuple[gs.Tensor, gs.Node]] = []
    for t in node.outputs:
        for q in graph.consumers(t):
            if not is_q(q) or q.inputs[0] is not t:
                continue
            for dq in graph.consumers(q.outputs[0]):
                if is_dq(dq) and dq.inputs[0] is q.outputs[0] and graph.is_graph_output(dq.outputs[0]):
                    pairs.append((t, dq))
    return pairs


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


@dataclass
class FallbackOutcome:
    """What `fall_back` did, node by node."""

    fallen_back: list[str] = field(default_factory=list)
    already_float: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    ignored_qdq: int = 0  # Q/DQ nodes in the selection (they are what gets removed, not what is selected)
    dequantized_weights: list[str] = field(default_factory=list)  # new float constants from integer weights
    relu_restored: list[str] = field(default_factory=list)  # tensors given back the Relu a quantizer folded
    float_weights_restored: list[str] = field(default_factory=list)  # constants taken from the float reference
    still_quantized_for: dict[str, list[str]] = field(default_factory=dict)  # node -> consumers keeping Q/DQ
    nodes_added: int = 0
    nodes_removed: int = 0


def fall_back(graph: GraphHandle, targets: Iterable[gs.Node], tag: str = PASS_NAME,
              reference: ReferenceWeights | None = None) -> FallbackOutcome:
    """Return ``targets`` to float in place (see module docs); weights stored as integers take their float value
    from ``reference`` when it has one of the same shape. Bounded walks: 2 index builds, 1 cleanup."""
    out = FallbackOutcome()
    nodes_before = len(graph.graph.nodes)
    chosen: list[gs.Node] = []
    plans: list[list[tuple[int, FloatSource]]] = []
    for node in targets:
        if is_qdq(node):
            out.ignored_qdq += 1
            continue
        plan = [(i, float_source(graph, node.inputs[i])) for i in dq_inputs(graph, node)]
        problems = [s.problem for _, s in plan if s.problem]
        if problems:
            out.refused.append((node.name, "; ".join(problems)))
            continue
        if not plan and not owned_output_pairs(graph, node):
            out.already_float.append(node.name)
            continue
        chosen.append(node)
        plans.append(plan)
    consts: dict[int, gs.Constant] = {}
    relus: dict[str, gs.Tensor] = {}
    added: list[gs.Node] = []
    for node, plan in zip(chosen, plans, strict=True):
        for i, src in plan:
            restored = _restore(graph, node, i, src, reference, out)
            node.inputs[i] = restored if restored is not None else _materialize(graph, src, consts, relus, added, out,
                                                                                 tag)
    graph.graph.nodes.extend(added)
    graph.changed()  # consumer lists moved: rebuild the index once before looking at the output side
    n_relus = len(added)
    for node in chosen:
        keep = sorted(
            {
                c.name
                for t in node.outputs
                for q in graph.consumers(t)
                if is_q(q)
                for dq in graph.consumers(q.outputs[0])
                if is_dq(dq)
                for c in graph.consumers(dq.outputs[0])
            }
        )
        if keep:
            out.still_quantized_for[node.name] = keep
        for t, dq in owned_output_pairs(graph, node):
            _detach_graph_output(graph, t, dq, added, tag)
        out.fallen_back.append(node.name)
    graph.graph.nodes.extend(added[n_relus:])
    graph.cleanup()
    if added:
        graph.toposort()
    out.nodes_added = len(added)
    out.nodes_removed = nodes_before + len(added) - len(graph.graph.nodes)
    return out


def _restore(graph: GraphHandle, node: gs.Node, i: int, src: FloatSource, reference: ReferenceWeights | None,
             out: FallbackOutcome) -> gs.Constant | None:
    """The reference's float constant for integer weight input ``i`` of ``node`` (None: none of that shape)."""
    if reference is None or src.weight_dq is None or not node.outputs:
        return None
    q = graph.constant_value(src.weight_dq.inputs[0])
    params = qparams(graph, src.weight_dq)
    if q is None or params is None:
        return None
    values = reference.get(node.outputs[0].name, i, src.weight_dq.inputs[0].name, (q, params))
    if values is None or tuple(values.shape) != tuple(q.shape):
        return None
    const = gs.Constant(graph.unique_name(f"{node.name}/float_input{i}"), np.asarray(values, params.scale.dtype))
    out.float_weights_restored.append(const.name)
    return const


def _materialize(
    graph: GraphHandle,
    src: FloatSource,
    consts: dict[int, gs.Constant],
    relus: dict[str, gs.Tensor],
    added: list[gs.Node],
    out: FallbackOutcome,
    tag: str,
) -> gs.Tensor:
    if src.weight_dq is not None:
        dq = src.weight_dq
        if id(dq) not in consts:
            params = qparams(graph, dq)
            values = graph.constant_value(dq.inputs[0])
            assert params is not None and values is not None  # checked by float_source
            base = dq.inputs[0].name
            base = base[: -len("_quantized")] if base.endswith("_quantized") else base + "/float"
            consts[id(dq)] = gs.Constant(graph.unique_name(base), dequantize(values, params))
            out.dequantized_weights.append(consts[id(dq)].name)
        return consts[id(dq)]
    assert src.tensor is not None
    if not src.relu:
        return src.tensor
    t = src.tensor
    if t.name not in relus:
        name = graph.unique_name(f"{t.name}/relu")
        relu_out = gs.Variable(name, dtype=t.dtype, shape=t.shape)
        node = gs.Node("Relu", name, inputs=[t], outputs=[relu_out])
        graph.tag(node, tag)
        added.append(node)
        relus[t.name] = relu_out
        out.relu_restored.append(t.name)
    return relus[t.name]


def _detach_graph_output(graph: GraphHandle, t: gs.Tensor, dq: gs.Node, added: list[gs.Node], tag: str) -> None:
    """Make graph output ``y = DQ(Q(t))`` float; other readers of ``y`` keep the pair on a renamed tensor."""
    y = dq.outputs[0]
    readers = list(graph.consumers(y))
    if readers:
        renamed = gs.Variable(graph.unique_name(f"{y.name}/dq"), dtype=y.dtype, shape=y.shape)
        for reader in readers:
            for i, inp in enumerate(reader.inputs):
                if inp is y:
                    reader.inputs[i] = renamed
        dq.outputs[0] = renamed
    else:
        dq.outputs.clear()
    q = graph.producer(dq.inputs[0])
    params = qparams(graph, q) if q is not None else None
    relu = params is not None and params.clamps_at_zero and _can_be_negative(graph, t)
    node = gs.Node("Relu" if relu else "Identity", graph.unique_name(f"{y.name}/float"), inputs=[t], outputs=[y])
    graph.tag(node, tag)
    added.append(node)
