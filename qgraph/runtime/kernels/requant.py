"""A fused Q/DQ layer written out as onnxruntime's integer kernel computes it: the exact int32 sum, then its own
requantization.

onnxruntime's CPU optimizer turns ``DequantizeLinear -> Conv/MatMul/Gemm -> QuantizeLinear`` into one integer
kernel (QLinearConv, QLinearMatMul, QGemm) that sums the codes in int32, adds the int32 bias codes and requantizes
with a float multiplier::

    y = saturate(round_half_even(float32(acc + bias) * M[n]) + y_zero_point),   M[n] = s_x * s_w[n] / s_y

(``M`` in float32, left to right). A MatMul or Gemm whose output is not quantized becomes
``MatMulIntegerToFloat``/QGemm with a float output, ``float32(acc + bias) * (s_x * s_w[n])``. Q/DQ computed in float
(``DequantizeLinear -> float op -> QuantizeLinear``) rounds the same sum differently now and then, one code here and
there, and that compounds through a deep network: on YOLOv8n 0.001 % of the codes differ after the third layer and
20 % at the head, enough to move detections at the score threshold. So an emulation that must give a CPU's deployed
numbers rewrites only the layers whose integer arithmetic differs on this host, in exactly this form, and lets
onnxruntime fuse every other layer into this host's own kernels.

`integer_form` recognises such a layer (or says why not); `IntegerForm.accumulator` writes its exact int32 sum
(``ConvInteger``/``MatMulInteger``, or their exact float forms where this host's integer kernels would saturate or
have none) and `IntegerForm.finish` the bias and the requantization, into the tensor the layer's QuantizeLinear
wrote. Checked bit for bit against onnxruntime's fused kernels (`tests/kernels/test_requant.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from qgraph.quant.qdq import is_dequantize, is_quantize

from .corrections import ProtoEmitter
from .expand import exact_integer_node, operand

Lookup = Callable[[str], "np.ndarray | None"]


@dataclass(frozen=True)
class IntegerForm:
    """A fused layer as its integer kernel computes it (see module docs)."""

    node: onnx.NodeProto
    op: str  # Conv | MatMul | Gemm
    #: The activation codes and their zero point (tensor names; "" when absent), and whether they are signed.
    codes: str
    zero_point: str
    signed: bool
    x_scale: np.float32
    #: The weight codes (tensor name), their zero point, and the per-output-channel weight scales.
    weight: str
    weight_zero_point: str
    w_scale: np.ndarray
    #: int32 bias codes per output channel, or None.
    bias: np.ndarray | None
    #: The QuantizeLinear the layer's output feeds alone, and its scale (None: the output stays float).
    quantize: onnx.NodeProto | None
    y_scale: np.float32 | None
    #: Nodes the form replaces: the layer, its output QuantizeLinear (and a Relu before it), the DequantizeLinears
    #: only the layer reads (the form reads their codes).
    replaces: frozenset[str]
    #: Gemm with transB: the weight codes transposed to the (K, N) MatMulInteger reads.
    transposed: np.ndarray | None = None
    #: Spatial dimensions of a convolution (0 for MatMul/Gemm).
    spatial: int = 0
    #: The sum is computed in its exact float form on every host: onnxruntime's CPU has no integer kernel for the
    #: operands (s8 activations, a convolution with weight zero points), or a convolution whose every partial sum
    #: stays below 2^24 (exact in float32: onnxruntime's ConvInteger runs 10x slower than its float Conv).
    float_form: bool = False

    @property
    def channel_shape(self) -> list[int]:
        """How a per-output-channel vector broadcasts against the layer's output."""
        return [1, -1] + [1] * self.spatial if self.op == "Conv" else [-1]

    def accumulator(self, em: ProtoEmitter, consts: Lookup, *, exact_float: bool) -> str:
        """Write the layer's exact int32 sum (zero points subtracted) and return its name; ``exact_float``: in the
        exact float forms of `qgraph.runtime.kernels.expand.exact_integer_node` rather than with this host's integer
        kernels (which saturate)."""
        base = self.node.name
        weight = self.weight if self.transposed is None else em.const(f"{base}/weight_kn", self.transposed)
        inputs = [self.codes, weight, self.zero_point, self.weight_zero_point]
        while not inputs[-1]:
            inputs.pop()
        acc = em.name(f"{base}/acc")
        op = "ConvInteger" if self.op == "Conv" else "MatMulInteger"
        attrs = {a.name: helper.get_attribute_value(a) for a in self.node.attribute} if self.op == "Conv" else {}
        integer = helper.make_node(op, inputs, [acc], name=em.name(f"{base}/integer"), **attrs)
        if not (exact_float or self.float_form):
            em.nodes.append(integer)
            return acc
        transposed = self.transposed

        def lookup(name: str) -> np.ndarray | None:
            return transposed if transposed is not None and name == weight else consts(name)

        exact_integer_node(integer, em, lookup)
        return acc

    def finish(self, em: ProtoEmitter, acc: str) -> None:
        """Add the bias codes to the int32 ``acc`` and write the layer's result where the fused kernel writes it:
        the QuantizeLinear's codes, or the layer's float output."""
        base = self.node.name
        if self.bias is not None:
            bias = em.const(f"{base}/bias_codes", self.bias.reshape(self.channel_shape), np.int32)
            acc = em.op("Add", [acc, bias], f"{base}/acc_bias")
        accf = em.op("Cast", [acc], f"{base}/acc_f", to=TensorProto.FLOAT)
        if self.quantize is None or self.y_scale is None:
            scale = (self.x_scale * self.w_scale).astype(np.float32).reshape(self.channel_shape)
            em.nodes.append(helper.make_node("Mul", [accf, em.const(f"{base}/scale", scale)], [self.node.output[0]],
                                             name=em.name(f"{base}/scaled")))
            return
        multiplier = (self.x_scale * self.w_scale / self.y_scale).astype(np.float32)  # float32, left to right
        scaled = em.op("Mul", [accf, em.const(f"{base}/multiplier", multiplier.reshape(self.channel_shape))],
                       f"{base}/requant")
        q = self.quantize
        inputs = [scaled, em.const(f"{base}/unit_scale", np.float32(1.0)), *q.input[2:3]]
        em.nodes.append(helper.make_node("QuantizeLinear", inputs, [q.output[0]], name=em.name(f"{base}/round")))


def _scalar(consts: Lookup, name: str) -> np.ndarray | None:
    value = consts(name) if name else None
    return value if value is not None and value.size == 1 else None


def _output_quantize(node: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]], graph_outputs: set[str]
                     ) -> tuple[onnx.NodeProto | None, onnx.NodeProto | None]:
    """The QuantizeLinear that alone reads the layer's output, directly or through a Relu (which the fused
    kernel's clamp at the lowest code carries out: onnxruntime drops it), and that Relu."""
    relu = None
    out = node.output[0]
    readers = consumers.get(out, [])
    if len(readers) == 1 and readers[0].op_type == "Relu" and out not in graph_outputs:
        relu, out = readers[0], readers[0].output[0]
        readers = consumers.get(out, [])
    if len(readers) == 1 and is_quantize(readers[0].op_type, readers[0].domain) and out not in graph_outputs:
        return relu, readers[0]
    return None, None


def integer_form(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto],
                 consumers: dict[str, list[onnx.NodeProto]], consts: Lookup,
                 graph_outputs: set[str]) -> IntegerForm | str:
    """``node`` (a Conv, MatMul or Gemm onnxruntime fuses) as an `IntegerForm`, or why it cannot be written as one."""
    op = node.op_type
    act, wdq = producers.get(node.input[0]), producers.get(operand(node, 1))
    if act is None or wdq is None or not is_dequantize(act.op_type, act.domain) or \
            not is_dequantize(wdq.op_type, wdq.domain):
        return "its inputs are not DequantizeLinear outputs"
    weight, w_scale = consts(wdq.input[0]), consts(wdq.input[1])
    x_scale, zero_point = _scalar(consts, act.input[1]), _scalar(consts, operand(act, 2))
    if weight is None or w_scale is None or x_scale is None or (operand(act, 2) and zero_point is None):
        return "its scales, zero points or weight are not constants"
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    transposed = None
    if op == "Gemm":
        if attrs.get("transA", 0) or float(attrs.get("alpha", 1.0)) != 1.0 or float(attrs.get("beta", 1.0)) != 1.0:
            return "a Gemm with transA, alpha or beta"
        transposed = np.ascontiguousarray(weight.T) if attrs.get("transB", 0) else None
    elif op == "MatMul" and weight.ndim != 2:
        return f"a MatMul weight of shape {list(weight.shape)}"
    n_out = weight.shape[0] if op == "Conv" or transposed is not None else weight.shape[-1]
    w_zp = consts(operand(wdq, 2)) if operand(wdq, 2) else None
    bias: np.ndarray | None = None
    if op in ("Conv", "Gemm") and operand(node, 2):
        bdq = producers.get(node.input[2])
        codes = consts(bdq.input[0]) if bdq is not None and is_dequantize(bdq.op_type, bdq.domain) else None
        if codes is None or codes.dtype != np.int32:
            return "its bias is not int32 codes"
        bias = np.broadcast_to(codes.reshape(-1), (n_out,)).astype(np.int32)
    relu, quantize = _output_quantize(node, consumers, graph_outputs)
    y_scale = _scalar(consts, quantize.input[1]) if quantize is not None else None
    if (quantize is None and op == "Conv") or (quantize is not None and y_scale is None):
        return "its output is not requantized by one QuantizeLinear with constant scale"
    if relu is not None:
        y_zp = _scalar(consts, operand(quantize, 2)) if quantize is not None else None
        lowest = np.iinfo(y_zp.dtype).min if y_zp is not None else 0
        if y_zp is not None and int(y_zp.reshape(())) != lowest:
            return "a Relu before a QuantizeLinear whose zero point is not the lowest code"
    own = {p.name for i in (0, 1, 2) if operand(node, i)
           for p in [producers.get(node.input[i])] if p is not None and len(consumers.get(node.input[i], [])) == 1}
    signed = zero_point is not None and zero_point.dtype == np.int8
    zero_weights = w_zp is None or not np.any(w_zp)  # left out: ConvInteger takes no per-channel zero points
    return IntegerForm(
        node, op, act.input[0], operand(act, 2), signed, np.float32(x_scale.reshape(())), wdq.input[0],
        "" if zero_weights else operand(wdq, 2),
        np.broadcast_to(np.asarray(w_scale, np.float32).reshape(-1), (n_out,)).copy(), bias,
        quantize, np.float32(y_scale.reshape(())) if y_scale is not None else None,
        frozenset({node.name, *own, *(n.name for n in (relu, quantize) if n is not None)}), transposed,
        weight.ndim - 2 if op == "Conv" else 0,
        float_form=signed or (op == "Conv" and (not zero_weights or _float32_exact(weight, w_zp, zero_point))))


def _float32_exact(weight: np.ndarray, w_zp: np.ndarray | None, zero_point: np.ndarray | None) -> bool:
    """Whether every partial sum of a convolution's products stays below 2^24 (so float32 adds them exactly): the
    largest output channel's sum of |weight codes| times the farthest activation code from its zero point."""
    w = weight.astype(np.int64).reshape(weight.shape[0], -1)
    if w_zp is not None:
        w = w - np.asarray(w_zp, np.int64).reshape(-1, 1)
    zp = int(zero_point.reshape(())) if zero_point is not None else 0
    lo, hi = (-128, 127) if zero_point is not None and zero_point.dtype == np.int8 else (0, 255)
    return int(np.abs(w).sum(axis=1).max(initial=0)) * max(zp - lo, hi - zp) < 2 ** 24
