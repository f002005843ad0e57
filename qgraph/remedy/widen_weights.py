"""16-bit weights on chosen nodes of a QDQ model: with `qgraph.remedy.widen.widen_activations`, A16W16 mixed precision.

16-bit activations alone (A16W8) leave the int8 weights' rounding: on the PP-OCRv4 detector that alone costs
11 dB of the map, and NPUs (QNN HTP and others) run the layers that need it with 16-bit weights too.
`widen_weights` rewrites, for each chosen Conv/ConvTranspose/Gemm/MatMul, the ``DequantizeLinear`` of its constant
weight (input 1) and its int32 bias (input 2):

- the weight is re-quantized **from the float reference** when one is given (`qgraph.remedy.fallback.ReferenceWeights`:
  the recipe's float model, so neither the int8 rounding nor an 8-bit bias correction stays), else from its
  int8 codes (then it only changes type: the values are the int8 grid's, and the outcome says so);
- symmetric int16 on the same axis as before: ``s_c = max|w_c| / 32767`` per output channel (per tensor when the
  8-bit weight was), ``q = round_half_even(w / s_c)``, zero point 0;
- the bias becomes int32 on ``input scale × s_c`` (`qgraph.quant.math.quantize_bias`; where its codes would leave int32
  the channel's weight scale is raised until they fit, as insert_qdq does), from the reference's float bias when
  there is one; a bias already kept float (`widen_activations`, int32 overflow) takes the reference's float values;
- below opset 21 the rewritten ``DequantizeLinear`` is onnxruntime's ``com.microsoft`` one (int16 inputs).

A weight ``DequantizeLinear`` read by other nodes too, or with run-time parameters, is refused with the reason.
Linear: one look at each chosen node's weight and bias producers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qgraph.graph import GraphHandle
from qgraph.quant.math import QuantDtype, QuantSpec, compute_scale_zero_point, quantize, quantize_bias
from qgraph.quant.qdq_graph import dequantize, is_dq, pair_q, qparams
from qgraph.quant.reference_weights import ReferenceWeights

MS_DOMAIN = "com.microsoft"
#: Ops whose input 1 is a weight (and input 2, when present, an int32 bias for the first three).
WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
_BIASED = frozenset({"Conv", "ConvTranspose", "Gemm"})


@dataclass
class WeightWidenOutcome:
    """What `widen_weights` did, node by node."""

    widened: list[str] = field(default_factory=list)  # nodes whose weights are now int16
    from_codes: list[str] = field(default_factory=list)  # no float reference: int8 grid values stored as int16
    biases_requantized: list[str] = field(default_factory=list)
    weight_scales_raised: int = 0  # channels whose weight scale was raised so the int32 bias fits
    refused: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    dangling_q: bool = False  # a weight was Q(float constant): that Q is left without readers
    added: list[gs.Node] = field(default_factory=list)  # DequantizeLinear nodes of biases made int32 again


def widen_weights(graph: GraphHandle, targets: Iterable[gs.Node], reference: ReferenceWeights | None = None,
                  int32_biases: Iterable[str] = ()) -> WeightWidenOutcome:
    """Give the weights (and int32 biases) of ``targets`` 16 bits in place (see module docs); nodes without a
    quantized constant weight are passed over silently (an Add has no weight to widen). ``int32_biases``: nodes
    whose bias is float now but was int32 (`widen_activations` kept it float on overflow): it becomes int32 again
    on the new scales."""
    out = WeightWidenOutcome()
    self_int32 = set(int32_biases)
    contrib = graph.opset < 21
    for node in targets:
        if node.op not in WEIGHTED or len(node.inputs) < 2:
            continue
        dq = graph.producer(node.inputs[1])
        if dq is None or not is_dq(dq) or _codes_of(graph, dq) is None:
            continue  # a float weight, or an activation (a MatMul of two activations): no weight to widen
        why = _why_not(graph, node, dq)
        if why:
            out.refused.append((node.name, f"weights not widened: {why}"))
            continue
        _widen_one(graph, node, dq, reference, contrib, node.name in self_int32, out)
    if out.widened and contrib:
        graph.import_domain(MS_DOMAIN)
    if out.added:
        graph.graph.nodes.extend(out.added)
        graph.toposort()
    if out.dangling_q:
        graph.cleanup()  # a TensorRT-form weight's QuantizeLinear has no reader left
    else:
        graph.changed()
    return out


def _codes_of(graph: GraphHandle, dq: gs.Node) -> np.ndarray | None:
    """The integer weight codes ``dq`` reads: a constant, or (TensorRT's form) ``Q(float constant)`` evaluated."""
    codes = graph.constant_value(dq.inputs[0])
    if codes is not None:
        return codes
    q = pair_q(graph, dq)
    if q is None:
        return None
    values, params = graph.constant_value(q.inputs[0]), qparams(graph, q)
    if values is None or params is None:
        return None
    dtype = np.dtype(params.zero_point.dtype)
    return quantize(values, params.scale, params.zero_point, QuantDtype(dtype.name),
                    params.axis if params.scale.size > 1 else None)


def _why_not(graph: GraphHandle, node: gs.Node, dq: gs.Node) -> str | None:
    params = qparams(graph, dq)
    if params is None:
        return "its weight's quantization parameters are computed at run time"
    if np.dtype(params.zero_point.dtype).itemsize >= 2:
        return "already 16-bit or wider"
    if params.block_size:
        return "blocked weight quantization"
    if any(c is not node for c in graph.consumers(dq.outputs[0])):
        return "its weight's DequantizeLinear is read by other nodes too"
    return None


def _widen_one(graph: GraphHandle, node: gs.Node, dq: gs.Node, reference: ReferenceWeights | None, contrib: bool,
               int32_bias: bool, out: WeightWidenOutcome) -> None:
    params = qparams(graph, dq)
    codes = _codes_of(graph, dq)
    assert params is not None and codes is not None  # _why_not checked
    stored = dq.inputs[0].name
    out.dangling_q |= graph.constant_value(dq.inputs[0]) is None
    weights = reference.get(node.outputs[0].name, 1, stored, (codes, params)) if reference is not None else None
    if weights is None or weights.shape != codes.shape:
        weights = dequantize(codes, params).astype(np.float32)
        out.from_codes.append(node.name)
    axis = params.axis % codes.ndim if params.scale.size > 1 else None
    absmax = _absmax(weights.astype(np.float64), axis)
    spec = QuantSpec(dtype=QuantDtype.INT16, symmetric=True, per_channel=axis is not None, axis=axis)
    scale, _ = compute_scale_zero_point(-absmax, absmax, spec)
    scale = _bias_follows(graph, node, scale, reference, int32_bias, out)
    q = quantize(weights, scale, np.zeros(scale.shape, np.int16), QuantDtype.INT16, axis)
    base = node.inputs[1].name
    dq.inputs[0] = gs.Constant(graph.unique_name(f"{base}/w16", "tensor"), q)
    while len(dq.inputs) > 1:
        dq.inputs.pop()
    dq.inputs.extend([gs.Constant(graph.unique_name(f"{base}/w16_scale", "tensor"), scale.reshape(params.scale.shape)),
                      gs.Constant(graph.unique_name(f"{base}/w16_zero_point", "tensor"),
                                  np.zeros(params.scale.shape, np.int16))])
    if axis is not None:
        dq.attrs["axis"] = axis
    dq.attrs.pop("block_size", None)
    if contrib:
        dq.domain = MS_DOMAIN
    out.widened.append(node.name)


def _absmax(weights: np.ndarray, axis: int | None) -> np.ndarray:
    """``max |w|`` over everything (``axis`` None) or over all axes but ``axis``."""
    if axis is None:
        return np.asarray(np.max(np.abs(weights)) if weights.size else 0.0)
    others = tuple(i for i in range(weights.ndim) if i != axis)
    return np.max(np.abs(weights), axis=others) if weights.size else np.zeros(weights.shape[axis])


def _bias_follows(graph: GraphHandle, node: gs.Node, w_scale: np.ndarray, reference: ReferenceWeights | None,
                  int32_bias: bool, out: WeightWidenOutcome) -> np.ndarray:
    """Re-quantize ``node``'s int32 bias on ``input scale × w_scale`` (a float bias that was int32: again, else
    its values refreshed from the reference); returns the weight scale to use (raised where the bias codes would
    overflow int32)."""
    if node.op not in _BIASED or len(node.inputs) < 3 or not node.inputs[2].name:
        return w_scale
    bias_in = node.inputs[2]
    ref_bias = reference.get(node.outputs[0].name, 2, bias_in.name) if reference is not None else None
    in_dq = graph.producer(node.inputs[0])
    in_params = qparams(graph, in_dq) if in_dq is not None and is_dq(in_dq) else None
    if in_params is None or in_params.scale.size != 1:
        return w_scale
    bias_dq = graph.producer(bias_in)
    if bias_dq is None:  # a float bias: the float reference's values when there are any
        if not isinstance(bias_in, gs.Constant):
            return w_scale
        usable = ref_bias is not None and ref_bias.shape == bias_in.values.shape and not (
            reference is not None and reference.checked and not np.allclose(ref_bias, bias_in.values, 1e-5, 1e-7))
        values = ref_bias if usable and ref_bias is not None else bias_in.values
        if not int32_bias:
            node.inputs[2] = gs.Constant(graph.unique_name(f"{bias_in.name}/ref", "tensor"), values.astype(np.float32))
            return w_scale
        bias_dq = gs.Node("DequantizeLinear", graph.unique_name(f"{bias_in.name}/w16_dq", "node"),
                          inputs=[bias_in, bias_in], outputs=[gs.Variable(graph.unique_name(
                              f"{bias_in.name}/w16_dq", "tensor"), dtype=np.float32)])
        out.added.append(bias_dq)
        node.inputs[2] = bias_dq.outputs[0]
        return _requantize_bias(graph, node, bias_dq, values.astype(np.float64), in_params.scale, w_scale, out)
    b_params = qparams(graph, bias_dq) if is_dq(bias_dq) else None
    b_codes = graph.constant_value(bias_dq.inputs[0]) if is_dq(bias_dq) else None
    if b_params is None or b_codes is None or len(graph.consumers(bias_dq.outputs[0])) != 1:
        return w_scale
    if ref_bias is not None and reference is not None and reference.checked:  # a user's model: the bias it quantized?
        ref_bias = reference.get(node.outputs[0].name, 2, bias_in.name, (b_codes, b_params))
    bias = ref_bias if ref_bias is not None and ref_bias.shape == b_codes.shape else dequantize(b_codes, b_params)
    return _requantize_bias(graph, node, bias_dq, bias, in_params.scale, w_scale, out)


def _requantize_bias(graph: GraphHandle, node: gs.Node, bias_dq: gs.Node, bias: np.ndarray, in_scale: np.ndarray,
                     w_scale: np.ndarray, out: WeightWidenOutcome) -> np.ndarray:
    """``bias_dq`` reads ``bias`` as int32 on ``in_scale × w_scale``; returns the (possibly raised) weight scale."""
    bias_in = node.inputs[2]
    qb = quantize_bias(bias, in_scale, np.broadcast_to(w_scale.reshape(-1), bias.shape))
    out.weight_scales_raised += int(np.count_nonzero(qb.adjusted))
    if w_scale.size == 1 and np.any(qb.adjusted):
        # A per-tensor weight keeps one scale: the largest any channel's bias needs, for every channel.
        w_scale = np.asarray(np.max(qb.weight_scale), np.float32).reshape(w_scale.shape)
        qb = quantize_bias(bias, in_scale, np.broadcast_to(w_scale.reshape(-1), bias.shape))
    bias_dq.inputs[0] = gs.Constant(graph.unique_name(f"{bias_in.name}/w16", "tensor"), qb.values)
    # One scale per element unless they are all one value (a per-tensor weight): then the bias is per tensor too.
    bias_scale = qb.scale[:1].reshape(()) if w_scale.size == 1 else qb.scale
    bias_dq.inputs[1] = gs.Constant(graph.unique_name(f"{bias_in.name}/w16_scale", "tensor"), bias_scale)
    if len(bias_dq.inputs) > 2:
        bias_dq.inputs.pop()  # int32 zero point 0 is the default
    if bias_scale.size > 1:
        bias_dq.attrs["axis"] = 0
    out.biases_requantized.append(node.name)
    return w_scale if w_scale.size == 1 else qb.weight_scale.astype(np.float32).reshape(w_scale.shape)
