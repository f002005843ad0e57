"""Quantized weighted layers of a QDQ graph, as the weight-correction passes see them.

A *quantized layer* is a default-domain ``Conv``, ``Gemm`` or ``MatMul`` whose weight (input 1) is read through a
``DequantizeLinear`` of a constant: integer codes (``W/q -> W/dq``, the usual form) or a float constant behind
``QuantizeLinear -> DequantizeLinear`` (``format: float_qdq``). Its *bias* is Conv/Gemm input 2, or the constant
operand of the one ``Add`` after a MatMul; either an int32 constant behind a DequantizeLinear (scale
``s_x · s_w``) or a float constant. Its *output* is the tensor before any activation: the bias Add's output for
MatMul + Add, else the node's output. Found structurally (no reliance on names), in one walk of the index.

The weight is viewed as *rows*: one row per output channel holding the ``K`` weights that channel's dot product
uses (Conv: ``W.reshape(C_out, -1)``, rows of group ``g`` read input channels of group ``g``; Gemm ``transB=1``: ``B``;
Gemm ``transB=0`` and MatMul: ``B^T``). `rows` and `from_rows` convert.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnx_graphsurgeon as gs

from qgraph.graph import GraphHandle, NoMatch, gs_label, is_default_domain
from qgraph.graph.detach import is_placeholder
from qgraph.quant.math import _broadcast_param, dequantize, shift_int32_bias
from qgraph.quant.qdq_graph import QParams, is_dq, pair_q, qparams

WEIGHTED_OPS = frozenset({"Conv", "Gemm", "MatMul"})


def _replaced(old: gs.Constant, values: npt.NDArray[Any]) -> gs.Constant:
    """A new constant with ``old``'s name and ``values`` in place of ``old`` in every node reading it (a new object,
    so the pipeline's contract sees the change; O(readers))."""
    new = gs.Constant(old.name, np.ascontiguousarray(values))
    for reader in list(old.outputs):
        for i, t in enumerate(reader.inputs):
            if t is old:
                reader.inputs[i] = new
    return new


@dataclass
class BiasRef:
    """Where a layer's bias lives: ``owner.inputs[index]``, an int32 DQ (``codes``, ``scale``) or a float constant."""

    owner: gs.Node
    index: int
    kind: str  # "int32" | "float"
    value: gs.Constant  # int32 codes or float values
    scale: npt.NDArray[np.float32] | None = None  # int32 only
    beta: float = 1.0  # Gemm's C multiplier (float bias)


@dataclass
class QuantLayer:
    """A quantized weighted layer (module docstring)."""

    node: gs.Node
    weight: gs.Constant  # integer codes, or the float weight behind Q (float_qdq)
    params: QParams
    float_qdq: bool
    output: str
    bias: BiasRef | None
    input_scale: float | None  # scale of the activation DQ feeding input 0, when per tensor

    @property
    def name(self) -> str:
        """The node's name by qgraph's rule (`qgraph.graph.naming`; for messages and details)."""
        return gs_label(self.node)

    @property
    def groups(self) -> int:
        """Convolution groups (1 for Gemm/MatMul)."""
        return int(self.node.attrs.get("group", 1)) if self.node.op == "Conv" else 1

    @property
    def channels(self) -> int:
        """Output channels (rows)."""
        shape = self.weight.values.shape
        if self.node.op == "Conv" or (self.node.op == "Gemm" and int(self.node.attrs.get("transB", 0))):
            return int(shape[0])
        return int(shape[-1])

    def codes(self) -> npt.NDArray[np.int64]:
        """The integer codes as stored, or as QuantizeLinear computes them from the float weight."""
        values = np.asarray(self.weight.values)
        if not self.float_qdq:
            return values.astype(np.int64)
        p = self.params
        axis = p.axis if p.scale.size > 1 else None
        s = _broadcast_param(p.scale.astype(np.float32), values.ndim, axis)
        z = _broadcast_param(p.zero_point.astype(np.float64), values.ndim, axis)
        codes: npt.NDArray[np.int64] = np.clip(np.rint(values.astype(np.float32) / s) + z, p.qmin, p.qmax).astype(
            np.int64)
        return codes

    def full(self, param: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
        """A per-tensor or per-axis parameter broadcast to the weight's shape."""
        shape = self.weight.values.shape
        axis = self.params.axis if param.size > 1 else None
        return np.broadcast_to(_broadcast_param(param.astype(np.float64), len(shape), axis), shape)

    def rows(self, w: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Weight-shaped ``w`` as ``(C_out, K)`` rows (module docstring)."""
        if self.node.op == "Conv" or (self.node.op == "Gemm" and int(self.node.attrs.get("transB", 0))):
            return w.reshape(w.shape[0], -1)
        return w.T

    def from_rows(self, r: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Inverse of `rows`."""
        shape = self.weight.values.shape
        if self.node.op == "Conv" or (self.node.op == "Gemm" and int(self.node.attrs.get("transB", 0))):
            return r.reshape(shape)
        return np.ascontiguousarray(r.T)

    def dequantized_weight(self) -> npt.NDArray[np.float64]:
        """The weight the graph computes with: ``(q - z) · s`` as DequantizeLinear gives it (float32 values)."""
        p = self.params
        axis = p.axis if p.scale.size > 1 else None
        return dequantize(self.codes(), p.scale, p.zero_point, axis).astype(np.float64)

    def mean_error(self, float_weight: npt.NDArray[Any], float_bias: npt.NDArray[np.float64],
                   mean_row: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """``E[y_float] - E[y]`` per output channel ``(C,)`` over inputs whose mean row (im2col row of a Conv, laid
        out like the weight's ``(C_in, *kernel)``; `qgraph.runtime.row_means`) is ``mean_row``: the layer is linear,
        so this is ``alpha (W_float - W) · mean row + (b_float - b)`` exactly, with no float copy of the layer run.
        ``float_bias`` ``(C,)`` already holds Gemm's ``beta``, as `bias_values` does."""
        diff = self.rows(np.asarray(float_weight, np.float64) - self.dequantized_weight())  # (C, K / groups)
        g = self.groups
        shift = np.einsum("gck,gk->gc", diff.reshape(g, diff.shape[0] // g, -1),
                          np.asarray(mean_row, np.float64).reshape(g, -1)).reshape(-1)
        if self.node.op == "Gemm":
            shift *= float(self.node.attrs.get("alpha", 1.0))
        bias = self.bias_values()
        error: npt.NDArray[np.float64] = shift + float_bias - (0.0 if bias is None else bias)
        return error

    def write_codes(self, codes: npt.NDArray[np.int64]) -> None:
        """Store new codes (weight-shaped): the integer initializer, or (float_qdq) the float weight the
        QuantizeLinear rounds exactly to them, ``(q - z) · s``."""
        old = np.asarray(self.weight.values)
        if self.float_qdq:
            p = self.params
            axis = p.axis if p.scale.size > 1 else None
            self.weight = _replaced(self.weight, dequantize(codes, p.scale, p.zero_point, axis).astype(old.dtype))
        else:
            self.weight = _replaced(self.weight, codes.astype(old.dtype))

    def snapshot(self) -> tuple[npt.NDArray[Any], npt.NDArray[Any] | None]:
        """Copies of the weight and the bias as stored (codes, or float values), for `restore`."""
        bias = None if self.bias is None else np.array(self.bias.value.values, copy=True)
        return np.array(self.weight.values, copy=True), bias

    def restore(self, stored: tuple[npt.NDArray[Any], npt.NDArray[Any] | None]) -> None:
        """Put back the weight and bias a `snapshot` took (undo `write_codes` / `shift_bias`)."""
        weight, bias = stored
        self.weight = _replaced(self.weight, weight)
        if bias is not None and self.bias is not None:
            self.bias.value = _replaced(self.bias.value, bias)

    def bias_values(self) -> npt.NDArray[np.float64] | None:
        """The bias as the graph computes with it, flat ``(C,)`` (None without bias)."""
        b = self.bias
        if b is None:
            return None
        v = np.asarray(b.value.values, np.float64).reshape(-1)
        return v * (b.scale.astype(np.float64).reshape(-1) if b.scale is not None else b.beta)

    def shift_bias(self, delta: npt.NDArray[np.float64]) -> int:
        """Add ``delta`` ``(C,)`` to the bias (int32: rounded to its scale, clamped); the count of saturated codes.
        The layer must have a bias (`ensure_bias`)."""
        b = self.bias
        assert b is not None
        old = np.asarray(b.value.values)
        if b.kind == "int32":
            assert b.scale is not None
            new, clipped = shift_int32_bias(old.reshape(-1), b.scale.reshape(-1), delta)
            b.value = _replaced(b.value, new.reshape(old.shape))
            return clipped
        b.value = _replaced(b.value, (old.astype(np.float64) + (delta / b.beta).reshape(old.shape)).astype(old.dtype))
        return 0


def _input_scale(graph: GraphHandle, node: gs.Node) -> float | None:
    prod = graph.producer(node.inputs[0])
    if prod is None or not is_dq(prod):
        return None
    p = qparams(graph, prod)
    return float(p.scale.reshape(-1)[0]) if p is not None and p.scale.size == 1 else None


def _weight(graph: GraphHandle, node: gs.Node) -> tuple[gs.Constant, QParams, bool]:
    """The weight's constant, parameters and form; `NoMatch` saying why the node is not a quantized layer."""
    if len(node.inputs) < 2:
        raise NoMatch("no weight input")
    dq = graph.producer(node.inputs[1])
    if dq is None or not is_dq(dq):
        raise NoMatch("its weight is not read through a DequantizeLinear")
    if len(graph.consumers(node.inputs[1])) != 1:
        raise NoMatch("its dequantized weight is shared with other nodes")
    params = qparams(graph, dq)
    if params is None or params.block_size:
        raise NoMatch("its weight's quantization parameters are not constant (or blocked)")
    src = dq.inputs[0]
    if isinstance(src, gs.Constant):
        if np.asarray(src.values).dtype.kind not in "iu" or src.values.dtype.itemsize > 2:
            raise NoMatch("its weight codes are not 8/16-bit integers")
        owners = graph.consumers(src)
        if len(owners) != 1:
            raise NoMatch("its weight codes are shared")
        return src, params, False
    q = pair_q(graph, dq)
    if q is not None and isinstance(q.inputs[0], gs.Constant) and len(graph.consumers(src)) == 1:
        if len(graph.consumers(q.inputs[0])) != 1:
            raise NoMatch("its float weight is shared")
        return q.inputs[0], params, True
    raise NoMatch("its weight is not a constant behind Q/DQ")


def _bias(graph: GraphHandle, node: gs.Node, channels: int) -> tuple[BiasRef | None, str]:
    """The bias and the layer's output tensor name."""
    owner, index = node, 2
    if node.op == "MatMul":
        users = graph.consumers(node.outputs[0])
        if len(users) != 1 or users[0].op != "Add" or graph.is_graph_output(node.outputs[0]):
            return None, node.outputs[0].name
        owner = users[0]
        index = 1 if owner.inputs[0] is node.outputs[0] else 0
    if len(owner.inputs) <= index or not owner.inputs[index].name:
        return None, node.outputs[0].name
    t = owner.inputs[index]
    beta = float(owner.attrs.get("beta", 1.0)) if owner.op == "Gemm" else 1.0
    found: BiasRef | None = None
    if isinstance(t, gs.Constant) and np.asarray(t.values).dtype.kind == "f":
        found = BiasRef(owner, index, "float", t, beta=beta)
    else:
        dq = graph.producer(t)
        p = qparams(graph, dq) if dq is not None and is_dq(dq) else None
        src = dq.inputs[0] if dq is not None else None
        if (p is not None and isinstance(src, gs.Constant) and np.asarray(src.values).dtype == np.int32
                and not np.any(p.zero_point) and len(graph.consumers(src)) == 1 and beta == 1.0):
            found = BiasRef(owner, index, "int32", src, np.broadcast_to(p.scale, (channels,)).astype(np.float32))
    if found is None or np.asarray(found.value.values).size != channels or len(graph.consumers(t)) != 1:
        return None, node.outputs[0].name  # not a bias of this layer alone: the layer output is the node's
    return found, owner.outputs[0].name


def find_layers(graph: GraphHandle) -> tuple[list[QuantLayer], list[tuple[str, str]]]:
    """Quantized layers of the top graph in graph order, and ``(node, reason)`` for weighted nodes that are not."""
    layers: list[QuantLayer] = []
    skipped: list[tuple[str, str]] = []
    for node in graph.index.nodes:
        if node.op not in WEIGHTED_OPS or not is_default_domain(node.domain):
            continue
        name = gs_label(node)
        try:
            weight, params, float_qdq = _weight(graph, node)
        except NoMatch as refusal:
            skipped.append((name, refusal.reason))
            continue
        shape = weight.values.shape
        if (node.op == "MatMul" and len(shape) != 2) or (node.op == "Gemm" and int(node.attrs.get("transA", 0))):
            skipped.append((name, "only 2-D MatMul weights and Gemm without transA are handled"))
            continue
        layer = QuantLayer(node, weight, params, float_qdq, node.outputs[0].name, None, _input_scale(graph, node))
        layer.bias, layer.output = _bias(graph, node, layer.channels)
        layers.append(layer)
    return layers, skipped


def ensure_bias(graph: GraphHandle, layer: QuantLayer, tag: str) -> bool:
    """Give a Conv/Gemm without bias a zero bias (int32 behind a DequantizeLinear with scale ``s_x · s_w`` when
    both scales are known, else float); False for a MatMul (an Add would change its fusion) and for a bias
    operand the layer does not own alone."""
    if layer.bias is not None:
        return True
    node = layer.node
    if node.op == "MatMul" or (node.op == "Gemm" and float(node.attrs.get("beta", 1.0)) != 1.0):
        return False
    if len(node.inputs) > 2 and node.inputs[2].name:  # a bias this layer does not own alone (shared)
        return False
    c = layer.channels
    base = f"{layer.name}/bias"
    if layer.input_scale is not None:
        scale = (np.broadcast_to(layer.params.scale.astype(np.float32), (c,)) * np.float32(layer.input_scale))
        codes = gs.Constant(graph.unique_name(f"{base}/q", "tensor"), np.zeros(c, np.int32))
        sc = gs.Constant(graph.unique_name(f"{base}/scale", "tensor"), scale.astype(np.float32))
        out = gs.Variable(graph.unique_name(f"{base}/dq", "tensor"), dtype=np.float32, shape=[c])
        dq = gs.Node("DequantizeLinear", graph.unique_name(f"{base}/dq", "node"), attrs={"axis": 0},
                     inputs=[codes, sc], outputs=[out])
        graph.graph.nodes.append(dq)
        graph.tag(dq, tag)
        layer.bias = BiasRef(node, 2, "int32", codes, scale.astype(np.float32))
        node.inputs.append(out)
    else:
        value = gs.Constant(graph.unique_name(base, "tensor"), np.zeros(c, np.float32))
        layer.bias = BiasRef(node, 2, "float", value)
        node.inputs.append(value)
    return True


def _tensor_value(proto: onnx.TensorProto, weights: Mapping[str, npt.NDArray[Any]] | None) -> npt.NDArray[Any]:
    """A reference tensor's values: its placeholder's entry in ``weights`` (shared, not copied), else its data."""
    if weights is not None and is_placeholder(proto):
        return weights[proto.name]
    return onnx.numpy_helper.to_array(proto)


def float_weights(reference: onnx.ModelProto, layers: list[QuantLayer],
                  weights: Mapping[str, npt.NDArray[Any]] | None = None) -> dict[str, npt.NDArray[np.float32]]:
    """The float weight of each layer in ``reference``, keyed by layer output: the constant input 1 of the
    weighted node there that produces the same output tensor (original tensors keep their names). ``weights``:
    the values of a weightless reference's placeholders (`PassContext.float_reference_weights`); float32 arrays
    are returned as they are, not copied (read-only use)."""
    wanted = {layer.node.outputs[0].name: layer.output for layer in layers}
    inits = {t.name: t for t in reference.graph.initializer}
    consts = {n.output[0]: n.attribute[0].t for n in reference.graph.node
              if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value"}
    out: dict[str, npt.NDArray[np.float32]] = {}
    for n in reference.graph.node:
        if n.op_type in WEIGHTED_OPS and n.output and n.output[0] in wanted and len(n.input) > 1:
            proto = inits.get(n.input[1]) or consts.get(n.input[1])
            if proto is not None and proto.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE):
                out[wanted[n.output[0]]] = np.asarray(_tensor_value(proto, weights), np.float32)
    return out


def float_biases(reference: onnx.ModelProto, layers: list[QuantLayer],
                 weights: Mapping[str, npt.NDArray[Any]] | None = None) -> dict[str, npt.NDArray[np.float64]]:
    """The float bias ``(C,)`` each layer adds in ``reference`` (Conv/Gemm input 2 times Gemm's ``beta``, or the
    constant operand of the Add producing the layer output after a MatMul); zeros for a layer without one.
    ``weights`` as in `float_weights`."""
    inits = {t.name: t for t in reference.graph.initializer}
    by_output = {n.output[0]: n for n in reference.graph.node if n.output}
    out: dict[str, npt.NDArray[np.float64]] = {}
    for layer in layers:
        c = layer.channels
        value = np.zeros(c, np.float64)
        owner = by_output.get(layer.output)
        if owner is not None and owner.op_type in ("Conv", "Gemm") and len(owner.input) > 2 and owner.input[2]:
            proto = inits.get(owner.input[2])
            beta = next((a.f for a in owner.attribute if a.name == "beta"), 1.0) if owner.op_type == "Gemm" else 1.0
            if proto is not None:
                value = np.broadcast_to(_tensor_value(proto, weights).astype(np.float64).reshape(-1) * beta, (c,))
        elif owner is not None and owner.op_type == "Add":
            proto = next((inits[i] for i in owner.input if i in inits), None)
            if proto is not None and int(np.prod(proto.dims)) in (1, c):
                value = np.broadcast_to(_tensor_value(proto, weights).astype(np.float64).reshape(-1), (c,))
        out[layer.output] = np.array(value)
    return out
