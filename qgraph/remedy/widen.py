"""Mixed precision for QDQ models from any tool: 16-bit activations on chosen nodes, weights unchanged (A16W8).

An NPU has no cheap float path: a layer whose 8-bit activations cost too much accuracy runs with 16-bit
activations instead (QNN HTP, Ethos and most NPUs run A16W8 convolutions and matmuls natively). `widen_activations`
rewrites, for each chosen node, the Q/DQ pairs of the activations it reads and of the outputs it writes:

- each such ``QuantizeLinear`` and every ``DequantizeLinear`` reading it get 16-bit parameters of the same
  signedness (uint8 → uint16, int8 → int16); every consumer of the pair then reads 16 bits, which only makes
  it more exact (a pair is a tensor's quantization: on an NPU the producer writes that tensor once);
- the range is the 8-bit pair's representable range ``[(qmin - z)·s, (qmax - z)·s]`` times ``margin``
  (zero stays exactly representable): with 65536 codes rounding is ~48 dB below the 8-bit step, so what limits a
  16-bit tensor is clipping, and the 8-bit range was chosen to trade clipping against 8-bit rounding (a 2x margin
  costs 6 dB of a ~90 dB rounding SQNR and removes the clipping of held-out data beyond the calibrated range);
- an int32 bias whose scale is ``input scale × weight scale`` (Conv, ConvTranspose, Gemm reading a widened
  input) is re-quantized on the new input scale; where the codes would leave int32 the bias is kept float;
- below opset 21 (16-bit Q/DQ in the ONNX domain) the widened pairs use onnxruntime's ``com.microsoft``
  QuantizeLinear/DequantizeLinear, which every onnxruntime execution provider (CPU, QNN) reads.

Weights stay as they are. On onnxruntime's CPU provider a 16-bit pair is not fused into an integer kernel: the
consumer runs in float on the dequantized values (exact for accuracy measurement, not a speed-up).
Linear: one look at each chosen node's inputs, outputs and their consumers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qgraph.graph import GraphHandle
from qgraph.quant.math import QuantDtype, dtype_range, storage_range
from qgraph.quant.qdq_graph import QParams, is_dq, is_qdq, owned_output_pairs, pair_q, qparams
from qgraph.remedy.widen_weights import WeightWidenOutcome

MS_DOMAIN = "com.microsoft"
#: The 16-bit type each 8-bit activation type widens to.
WIDER = {np.dtype(np.uint8): np.dtype(np.uint16), np.dtype(np.int8): np.dtype(np.int16)}
_BIASED = frozenset({"Conv", "ConvTranspose", "Gemm"})
_INT32 = dtype_range(QuantDtype.INT32)


@dataclass
class WidenOutcome:
    """What `widen_activations` did."""

    widened: list[str] = field(default_factory=list)  # nodes whose activations are now 16-bit
    tensors: list[str] = field(default_factory=list)  # activation tensors whose Q/DQ pair is now 16-bit
    biases_requantized: list[str] = field(default_factory=list)
    biases_float: list[str] = field(default_factory=list)  # int32 codes would overflow: kept float
    refused: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    converted: int = 0  # inputs of other nodes that keep 8 bits through a DQ16 -> Q8 -> DQ8 conversion
    contrib_domain: bool = False  # the pairs use com.microsoft Q/DQ (model opset < 21)
    weights: WeightWidenOutcome | None = None  # with 16-bit weights too (remedy a16w16)


def widen_activations(graph: GraphHandle, targets: Iterable[gs.Node], margin: float = 2.0) -> WidenOutcome:
    """Give ``targets`` 16-bit activations in place (see module docs); ``margin`` widens each 8-bit range."""
    out = WidenOutcome()
    pairs: dict[int, gs.Node] = {}
    chosen: set[int] = set()
    for node in targets:
        if is_qdq(node):
            continue
        mine = _pairs_of(graph, node)
        if not mine:
            out.refused.append((node.name, "no activation Q/DQ pair to widen: no input read through a "
                                           "QuantizeLinear -> DequantizeLinear pair and no quantized graph output"))
            continue
        problems = [why for q in mine if (why := _why_not(graph, q))]
        if not problems and all(_is_wide(graph, q) for q in mine):
            out.refused.append((node.name, "already 16-bit: every activation pair it reads is 16-bit"))
            continue
        if problems:
            out.refused.append((node.name, "; ".join(sorted(set(problems)))))
            continue
        out.widened.append(node.name)
        chosen.add(id(node))
        for q in mine:
            pairs.setdefault(id(q), q)
    contrib = graph.opset < 21
    added: list[gs.Node] = []
    for q in pairs.values():
        params = qparams(graph, q)
        assert params is not None  # _why_not checked
        _widen_pair(graph, q, params, margin, contrib, chosen, added, out)
    if pairs and contrib:
        graph.import_domain(MS_DOMAIN)
        out.contrib_domain = True
    if added:
        graph.graph.nodes.extend(added)
        graph.toposort()
    graph.changed()
    return out


def _pairs_of(graph: GraphHandle, node: gs.Node) -> list[gs.Node]:
    """The activation QuantizeLinear nodes of ``node``: behind its DQ inputs, and of its outputs that reach a graph
    output through ``Q -> DQ`` (an output pair read by other nodes is their input pair)."""
    found: list[gs.Node] = []
    for t in node.inputs:
        dq = graph.producer(t)
        if dq is None or not is_dq(dq):
            continue
        q = pair_q(graph, dq)
        # A weight stored as Q(float constant) -> DQ (TensorRT's form) is a weight, not an activation: it stays.
        if q is not None and graph.constant_value(q.inputs[0]) is None:
            found.append(q)
    for _, dq in owned_output_pairs(graph, node):
        q = pair_q(graph, dq)
        if q is not None:
            found.append(q)
    return found


def _is_wide(graph: GraphHandle, q: gs.Node) -> bool:
    params = qparams(graph, q)
    return params is not None and np.dtype(params.zero_point.dtype) in WIDER.values()


def _why_not(graph: GraphHandle, q: gs.Node) -> str | None:
    params = qparams(graph, q)
    name = q.inputs[0].name
    if params is None:
        return f"{name!r}: quantization parameters computed at run time"
    if params.scale.size != 1:
        return f"{name!r}: per-axis activation quantization"
    dtype = np.dtype(params.zero_point.dtype)
    if dtype not in WIDER and dtype not in WIDER.values():
        return f"{name!r}: {dtype} activations (only 8-bit ones widen to 16 bits)"
    return None


def wide_params(params: QParams, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """16-bit ``(scale, zero_point)`` covering ``margin`` x the representable range of 8-bit ``params``."""
    wide = WIDER.get(np.dtype(params.zero_point.dtype), np.dtype(params.zero_point.dtype))
    qrange = storage_range(wide)
    assert qrange is not None, f"{wide}: not an integer carrier"  # `_refusal` let 8/16-bit integers only
    qmin, qmax = qrange
    lo, hi = params.representable
    lo, hi = min(lo, 0.0) * margin, max(hi, 0.0) * margin
    dtype = params.scale.dtype
    if qmin < 0 and int(params.zero_point.reshape(-1)[0]) == 0:  # symmetric signed stays symmetric
        scale = max(-lo / -qmin, hi / qmax)
        zero = 0
    else:
        scale = (hi - lo) / (qmax - qmin)
        zero = int(np.clip(round(qmin - lo / scale), qmin, qmax)) if scale > 0 else 0
    scale = scale if scale > 0 else float(params.scale.reshape(-1)[0])
    return np.asarray(scale, dtype=dtype).reshape(params.scale.shape), np.asarray(zero, dtype=wide).reshape(
        params.zero_point.shape)


def _widen_pair(graph: GraphHandle, q: gs.Node, params: QParams, margin: float, contrib: bool, chosen: set[int],
                added: list[gs.Node], out: WidenOutcome) -> None:
    """Rewrite ``q`` and its DQs to 16-bit parameters. Consumers that are not ``chosen`` keep reading 8 bits
    through a conversion ``DQ16 -> Q8 -> DQ8`` with the old parameters (as onnxruntime's mixed-precision QDQ
    models convert at region boundaries: each node's inputs keep one type); the int32 biases of chosen consumers
    follow the new input scale."""
    if np.dtype(params.zero_point.dtype) in WIDER.values():
        return  # already 16-bit
    scale, zero = wide_params(params, margin)
    base = q.inputs[0].name
    old = list(q.inputs[1:3])
    if len(old) < 2 or not old[1].name:  # no zero point input: the 8-bit conversion needs an explicit one
        old = [old[0], gs.Constant(graph.unique_name(f"{base}/zero_point8", "tensor"), params.zero_point)]
    s_const = gs.Constant(graph.unique_name(f"{base}/scale16", "tensor"), scale)
    z_const = gs.Constant(graph.unique_name(f"{base}/zero_point16", "tensor"), zero)
    dqs = [d for d in graph.consumers(q.outputs[0]) if is_dq(d) and d.inputs[0] is q.outputs[0]]
    for node in (q, *dqs):
        while len(node.inputs) > 1:
            node.inputs.pop()
        node.inputs.extend([s_const, z_const])
        node.attrs.pop("output_dtype", None)  # the zero point carries the type
        if contrib:
            node.domain = MS_DOMAIN
    q.outputs[0].dtype = zero.dtype
    out.tensors.append(base)
    old_scale, new_scale = float(params.scale.reshape(-1)[0]), float(scale.reshape(-1)[0])
    for dq in dqs:
        narrow = [c for c in graph.consumers(dq.outputs[0]) if id(c) not in chosen and not is_qdq(c)]
        if narrow:
            _convert_back(graph, dq, old, narrow, added)
            out.converted += len(narrow)
        for consumer in graph.consumers(dq.outputs[0]):
            if (id(consumer) in chosen and consumer.op in _BIASED and len(consumer.inputs) > 2
                    and consumer.inputs[0] is dq.outputs[0]):
                _requantize_bias(graph, consumer, old_scale, new_scale, out)


def _convert_back(graph: GraphHandle, dq: gs.Node, params: list[gs.Tensor], readers: list[gs.Node],
                  added: list[gs.Node]) -> None:
    """``readers`` read ``dq``'s output through ``Q -> DQ`` with the 8-bit ``params`` (scale, zero point)."""
    wide = dq.outputs[0]
    name = graph.unique_name(f"{wide.name}/to8", "any")
    # each name free in both namespaces: the node and the tensor it writes share it
    q_name, dq_name = graph.unique_name(f"{name}/q", "any"), graph.unique_name(f"{name}/dq", "any")
    q8_out = gs.Variable(q_name, dtype=params[1].dtype if len(params) > 1 else np.uint8)
    dq8_out = gs.Variable(dq_name, dtype=wide.dtype)
    added.append(gs.Node("QuantizeLinear", q_name, inputs=[wide, *params], outputs=[q8_out]))
    added.append(gs.Node("DequantizeLinear", dq_name, inputs=[q8_out, *params], outputs=[dq8_out]))
    for reader in readers:
        for i, t in enumerate(reader.inputs):
            if t is wide:
                reader.inputs[i] = dq8_out


def _requantize_bias(graph: GraphHandle, node: gs.Node, old_in: float, new_in: float, out: WidenOutcome) -> None:
    """``node``'s int32 bias on the new input scale (when its scale is old input scale x weight scale)."""
    bias_dq = graph.producer(node.inputs[2])
    if bias_dq is None or not is_dq(bias_dq) or graph.producer(bias_dq.inputs[0]) is not None:
        return
    params = qparams(graph, bias_dq)
    codes = graph.constant_value(bias_dq.inputs[0])
    if params is None or codes is None or codes.dtype != np.int32 or len(graph.consumers(bias_dq.outputs[0])) != 1:
        return
    w_dq = graph.producer(node.inputs[1])
    w_params = qparams(graph, w_dq) if w_dq is not None and is_dq(w_dq) else None
    if w_params is None:
        return
    expected = np.broadcast_to(w_params.scale.astype(np.float64).reshape(-1) * old_in, params.scale.reshape(-1).shape)
    if not np.allclose(params.scale.reshape(-1), expected, rtol=1e-5):
        return  # not the ORT int32 bias convention: its scale does not follow the input
    # A 1-D bias: its scale is one value or one per element, so plain broadcasting dequantizes it.
    values = (codes.astype(np.float64) - params.zero_point.astype(np.float64)) * params.scale.astype(np.float64)
    new_scale = (params.scale.astype(np.float64) * (new_in / old_in)).astype(params.scale.dtype)
    q = np.rint(values / new_scale.astype(np.float64))
    name = node.inputs[2].name
    if q.min() < _INT32[0] or q.max() > _INT32[1]:
        node.inputs[2] = gs.Constant(graph.unique_name(f"{name}/float", "tensor"), values.astype(np.float32))
        out.biases_float.append(node.name)
        return
    bias_dq.inputs[0] = gs.Constant(graph.unique_name(f"{name}/q16", "tensor"), q.astype(np.int32))
    bias_dq.inputs[1] = gs.Constant(graph.unique_name(f"{name}/scale16", "tensor"), new_scale)
    out.biases_requantized.append(node.name)

