"""Integer ops as standard ops: fused forms expanded to their definitions, integer products computed exactly.

`expand_fused` rewrites the fused integer ops other tools write (``QLinearConv``, ``QLinearMatMul``, and
onnxruntime's ``DynamicQuantizeMatMul`` / ``MatMulIntegerToFloat``) into the Q/DQ or ``MatMulInteger`` form they
are defined by, keeping the node's name on the layer (so the emulation treats it as the fused layer it is).
`exact_integer_node` computes ``MatMulInteger`` in float64 and ``ConvInteger`` in float32 (exact below 2^24), for
hosts whose integer kernels saturate.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from qgraph.graph.ops import proto_scopes

from .corrections import ProtoEmitter

Lookup = Callable[[str], "np.ndarray | None"]
_MS = "com.microsoft"


def operand(node: onnx.NodeProto, i: int) -> str:
    """Input ``i`` of ``node``, "" when absent (an omitted optional input)."""
    return node.input[i] if len(node.input) > i else ""


def _dq(em: ProtoEmitter, codes: str, scale: str, zp: str, base: str, axis: int | None = None) -> str:
    inputs = [codes, scale, zp] if zp else [codes, scale]
    return em.op("DequantizeLinear", inputs, base, **({"axis": axis} if axis is not None else {}))


def _qlinear_conv(node: onnx.NodeProto, em: ProtoEmitter) -> None:
    x, xs, xzp, w, ws, wzp, ys, yzp = (operand(node, i) for i in range(8))
    xd = _dq(em, x, xs, xzp, f"{node.name}/x_dq")
    wd = _dq(em, w, ws, wzp, f"{node.name}/w_dq", axis=0)
    inputs = [xd, wd]
    bias = operand(node, 8)
    if bias:
        scale = em.op("Mul", [xs, ws], f"{node.name}/bias_scale")
        inputs.append(em.op("Mul", [em.op("Cast", [bias], f"{node.name}/bias_f", to=TensorProto.FLOAT), scale],
                            f"{node.name}/bias_dq"))
    conv = em.name(f"{node.name}/float")
    em.nodes.append(helper.make_node("Conv", inputs, [conv], name=node.name,
                                     **{a.name: helper.get_attribute_value(a) for a in node.attribute}))
    em.nodes.append(helper.make_node("QuantizeLinear", [conv, ys, yzp], list(node.output),
                                     name=em.name(f"{node.name}/q")))


def _qlinear_matmul(node: onnx.NodeProto, em: ProtoEmitter) -> None:
    a, as_, azp, b, bs, bzp, ys, yzp = (operand(node, i) for i in range(8))
    ad = _dq(em, a, as_, azp, f"{node.name}/a_dq")
    bd = _dq(em, b, bs, bzp, f"{node.name}/b_dq", axis=-1)
    mm = em.name(f"{node.name}/float")
    em.nodes.append(helper.make_node("MatMul", [ad, bd], [mm], name=node.name))
    em.nodes.append(helper.make_node("QuantizeLinear", [mm, ys, yzp], list(node.output),
                                     name=em.name(f"{node.name}/q")))


def _to_float(em: ProtoEmitter, node: onnx.NodeProto, acc: str, scale: str, bias: str) -> None:
    """``Cast(acc) · scale (+ bias)`` into the node's output."""
    accf = em.op("Cast", [acc], f"{node.name}/acc_f", to=TensorProto.FLOAT)
    if not bias:
        em.nodes.append(helper.make_node("Mul", [accf, scale], list(node.output), name=em.name(f"{node.name}/scaled")))
        return
    scaled = em.op("Mul", [accf, scale], f"{node.name}/scaled")
    em.nodes.append(helper.make_node("Add", [scaled, bias], list(node.output), name=em.name(f"{node.name}/bias")))


def _dynamic_matmul(node: onnx.NodeProto, em: ProtoEmitter) -> None:
    a, b, bs, bzp, bias = (operand(node, i) for i in range(5))
    q = em.op("DynamicQuantizeLinear", [a], f"{node.name}/dynq", outputs=3)
    s, z = em.nodes[-1].output[1], em.nodes[-1].output[2]
    acc = em.name(f"{node.name}/acc")
    em.nodes.append(helper.make_node("MatMulInteger", [q, b, z, bzp] if bzp else [q, b, z], [acc], name=node.name))
    _to_float(em, node, acc, em.op("Mul", [s, bs], f"{node.name}/scale"), bias)


def _integer_to_float(node: onnx.NodeProto, em: ProtoEmitter) -> None:
    a, b, as_, bs, azp, bzp, bias = (operand(node, i) for i in range(7))
    acc = em.name(f"{node.name}/acc")
    inputs = [a, b, azp, bzp] if bzp else [a, b, azp] if azp else [a, b]
    em.nodes.append(helper.make_node("MatMulInteger", inputs, [acc], name=node.name))
    _to_float(em, node, acc, em.op("Mul", [as_, bs], f"{node.name}/scale"), bias)


_EXPANDERS = {("QLinearConv", ""): _qlinear_conv, ("QLinearMatMul", ""): _qlinear_matmul,
              ("DynamicQuantizeMatMul", _MS): _dynamic_matmul, ("MatMulIntegerToFloat", _MS): _integer_to_float}


def expand_fused(model: onnx.ModelProto, taken: set[str], opset: int) -> list[str]:
    """Expand every fused integer op of ``model`` in place (see module docs); the names of the layers expanded."""
    done: list[str] = []
    for graph in proto_scopes(model.graph):
        if not any((n.op_type, n.domain if n.domain != "ai.onnx" else "") in _EXPANDERS for n in graph.node):
            continue
        nodes: list[onnx.NodeProto] = []
        inits: list[onnx.TensorProto] = []
        for node in graph.node:
            expander = _EXPANDERS.get((node.op_type, node.domain if node.domain != "ai.onnx" else ""))
            if expander is None:
                nodes.append(node)
                continue
            em = ProtoEmitter(taken, opset)
            expander(node, em)
            nodes += em.nodes
            inits += em.inits
            done.append(node.name)
        del graph.node[:]
        graph.node.extend(nodes)
        graph.initializer.extend(inits)
    return done


def exact_integer_node(node: onnx.NodeProto, em: ProtoEmitter, consts: Lookup) -> list[onnx.NodeProto]:
    """``MatMulInteger`` as a float64 MatMul of zero-point-free codes, ``ConvInteger`` as a float32 Conv: the same
    int32 results without the host's integer kernels."""
    base = node.name
    x, w, xzp, wzp = (operand(node, i) for i in range(4))
    wide = TensorProto.DOUBLE if node.op_type == "MatMulInteger" else TensorProto.FLOAT

    def centred(codes: str, zp: str, tag: str, per_channel_axis: int | None) -> str:
        value = em.op("Cast", [codes], f"{base}/{tag}", to=wide)
        if not zp:
            return value
        zero = em.op("Cast", [zp], f"{base}/{tag}_zp", to=wide)
        zp_value = consts(zp)
        if per_channel_axis is not None and zp_value is not None and zp_value.size > 1:
            shape = [-1] + [1] * per_channel_axis  # a Conv weight's (O,) zero points against (O, C, kh, kw)
            zero = em.op("Reshape", [zero, em.const(f"{base}/{tag}_zp_shape", shape, np.int64)], f"{base}/{tag}_zpr")
        return em.op("Sub", [value, zero], f"{base}/{tag}_centred")

    if node.op_type == "MatMulInteger":
        product = em.op("MatMul", [centred(x, xzp, "a", None), centred(w, wzp, "b", None)], f"{base}/exact")
    else:
        weight = consts(w)
        rank = weight.ndim - 1 if weight is not None else 3
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        product = em.op("Conv", [centred(x, xzp, "x", None), centred(w, wzp, "w", rank)], f"{base}/exact", **attrs)
        product = em.op("Round", [product], f"{base}/round") if em.opset >= 11 else product
    em.nodes.append(helper.make_node("Cast", [product], list(node.output), name=em.name(f"{base}/int32"),
                                     to=TensorProto.INT32))
    return em.nodes
