"""A model rewritten so onnxruntime computes a target CPU's integer arithmetic on any host.

Run with graph optimizations off (``ORT_DISABLE_ALL``), a Q/DQ model computes every quantized layer as
``DequantizeLinear -> float op -> QuantizeLinear``: exact int32 accumulation up to float rounding, which is what
VNNI and ARM dot products compute. Two things stand between that and a given CPU's deployed numbers:

1. **Integer ops written into the model** (``MatMulInteger`` from dynamic quantization, ``ConvInteger``, and the
   fused forms other tools write: ``QLinearConv``, ``QLinearMatMul``, ``DynamicQuantizeMatMul``,
   ``MatMulIntegerToFloat``) run onnxruntime's real integer kernels even with optimizations off, so on an AVX2
   host they saturate. The fused forms are expanded into their standard-op definitions; where this host's kernels
   saturate, ``MatMulInteger``/``ConvInteger`` become the same sums in float64/float32 (exact).
2. **AVX2 without VNNI** adds adjacent u8 x s8 products into a saturating int16 (`qgraph.runtime.kernels.pairs`). For
   that
   target every layer that runs as a u8 x s8 integer kernel on deployment gets the correction subgraph of
   `qgraph.runtime.kernels.corrections` for exactly the weight pairs that can overflow. Which Q/DQ layers fuse is asked
   of onnxruntime itself: the graph its optimizer (``ORT_ENABLE_EXTENDED``) writes names each fused kernel after the
   layer it replaces.

Measured against onnxruntime 1.32's AVX2 kernels under qemu-user on convolutions (odd/even channels, groups,
strides, s8 activations, weight zero points), MatMuls, Gemms and dynamic quantization: identical outputs.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qgraph.graph.detach import with_weights
from qgraph.graph.ops import proto_scopes
from qgraph.quant.qdq import is_dequantize, is_dynamic_quantize, is_qdq, is_quantize

from .corrections import MIN_OPSET, ConvGeometry, CorrectionInput, ProtoEmitter, conv_correction, matmul_correction
from .expand import exact_integer_node, expand_fused
from .host import saturates
from .pairs import RiskyPairs, kernel_rows, risky_pairs

#: Ops onnxruntime's CPU optimizer fuses Q/DQ layers into, whose u8 x s8 products go through the GEMM kernels.
FUSED_GEMM_OPS = frozenset({"QLinearConv", "QLinearMatMul", "MatMulIntegerToFloat", "QGemm", "DynamicQuantizeMatMul"})
#: Integer ops a model may hold itself.
INTEGER_OPS = frozenset({"MatMulInteger", "ConvInteger", "QLinearConv", "QLinearMatMul", "DynamicQuantizeMatMul",
                         "MatMulIntegerToFloat"})


@dataclass(frozen=True)
class SaturationSite:
    """A layer whose u8 x s8 pair sums can leave int16 on the emulated CPU, and the outputs counting them."""

    node: str
    op: str
    #: The quantized activation the layer reads (the Q/DQ pair's quantized tensor) and its weight.
    activation: str
    weight: str
    pairs_at_risk: int
    pairs: int
    channels_at_risk: int
    channels: int
    worst_pair_sum: int
    saturated_output: str
    computed_output: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (without the internal output names)."""
        return {"node": self.node, "op": self.op, "activation": self.activation, "weight": self.weight,
                "pairs_at_risk": self.pairs_at_risk, "pairs": self.pairs, "channels_at_risk": self.channels_at_risk,
                "channels": self.channels, "worst_pair_sum": self.worst_pair_sum}


@dataclass
class Emulation:
    """An emulation model and what it holds."""

    model: onnx.ModelProto
    family: str
    sites: list[SaturationSite] = field(default_factory=list)
    #: Integer nodes of the model expanded or rewritten to exact float forms.
    rewritten: list[str] = field(default_factory=list)
    #: (node, why) integer layers whose saturation is not emulated.
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: Layers that run as u8 x s8 kernels on the target and were checked (with or without risky pairs).
    analysed: int = 0

    @property
    def counters(self) -> list[str]:
        """The extra graph outputs (two per site)."""
        return [n for s in self.sites for n in (s.saturated_output, s.computed_output)]


def has_integer_work(model: onnx.ModelProto) -> bool:
    """Whether ``model`` holds Q/DQ or integer ops anywhere (a float model needs no emulation)."""
    return any(is_qdq(n.op_type, n.domain, dynamic=True) or n.op_type in INTEGER_OPS
               for g in proto_scopes(model.graph) for n in g.node)


#: `fused_layers` answers by the model's fusion key (`fusion_key`), a few models at most: a weight-correcting pass
#: emulates the same structure before and after changing only bias or weight codes (its fidelity guard), and each
#: answer costs an optimizing onnxruntime session (1-2 s on a 3,000-layer chain).
_FUSED: dict[str, frozenset[str]] = {}
_FUSED_KEPT = 4
#: Initializers up to this many elements enter the fusion key by value (scales, zero points, shapes, clip bounds).
_KEY_VALUE_ELEMENTS = 64


def fusion_key(model: onnx.ModelProto, weights: Mapping[str, np.ndarray] | None = None) -> str:
    """What onnxruntime's Q/DQ fusion of ``model`` can depend on: every node (name, op, domain, wiring,
    non-graph attributes), every initializer's name, type and shape, the values of every scale and zero point (per
    channel too) and of the other small ones (shapes, clip bounds), except a DequantizeLinear's data input (bias
    and weight codes: fusion only asks that they are constant). Two models with the same key fuse the same
    layers."""
    h = hashlib.sha256()
    codes: set[str] = set()
    grids: set[str] = set()
    for g in proto_scopes(model.graph):
        for n in g.node:
            h.update(repr((n.name, n.domain, n.op_type, tuple(n.input), tuple(n.output))).encode())
            for a in n.attribute:
                if a.type not in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                    h.update(a.SerializeToString())
            if is_dequantize(n.op_type, n.domain) and n.input:
                codes.add(n.input[0])
            if is_quantize(n.op_type, n.domain) or is_dequantize(n.op_type, n.domain):
                grids.update(n.input[1:])  # scales and zero points, per channel too: always by value
    for g in proto_scopes(model.graph):
        for vi in (*g.input, *g.output):
            h.update(vi.SerializeToString())
        for t in g.initializer:
            h.update(repr((t.name, t.data_type, tuple(t.dims))).encode())
            if t.name not in grids and (t.name in codes or int(np.prod(t.dims)) > _KEY_VALUE_ELEMENTS):
                continue
            if weights and t.name in weights:
                h.update(np.ascontiguousarray(weights[t.name]).tobytes())
            elif t.data_location == TensorProto.EXTERNAL:
                h.update(repr([(e.key, e.value) for e in t.external_data]).encode())
            else:
                h.update(np.ascontiguousarray(numpy_helper.to_array(t)).tobytes())
    return h.hexdigest()


def fused_layers(model: onnx.ModelProto, weights: Mapping[str, np.ndarray] | None = None) -> set[str]:
    """Names of the layers onnxruntime's CPU optimizer turns into u8/s8 GEMM-based integer kernels (every node
    must have a unique name); ``weights``: the values of a weightless model's placeholders. Remembered by
    `fusion_key` for the last few models."""
    key = fusion_key(model, weights)
    if key not in _FUSED:
        while len(_FUSED) >= _FUSED_KEPT:
            del _FUSED[next(iter(_FUSED))]
        _FUSED[key] = frozenset(_fused_layers(with_weights(model, weights) if weights else model))
    return set(_FUSED[key])


def _fused_layers(model: onnx.ModelProto) -> set[str]:
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="qgraph-fused-") as tmp:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        opts.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        opts.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        optimized = onnx.load(str(Path(tmp) / "optimized.onnx"), load_external_data=False)
    return {n.name for g in proto_scopes(optimized.graph) for n in g.node if n.op_type in FUSED_GEMM_OPS}


class _Constants:
    """Initializers and Constant outputs of every scope, read lazily by name (a weightless model's placeholders
    from ``weights``)."""

    def __init__(self, model: onnx.ModelProto, weights: Mapping[str, np.ndarray] | None = None) -> None:
        self.weights = weights or {}
        self.protos: dict[str, onnx.TensorProto] = {}
        for g in proto_scopes(model.graph):
            for t in g.initializer:
                self.protos[t.name] = t
            for n in g.node:
                if n.op_type == "Constant" and n.output and n.attribute and n.attribute[0].name == "value":
                    self.protos[n.output[0]] = n.attribute[0].t
        self.cache: dict[str, np.ndarray] = {}

    def get(self, name: str) -> np.ndarray | None:
        """The value of constant ``name``, or None for anything else (an activation, a missing optional)."""
        if name in self.cache:
            return self.cache[name]
        if name in self.weights:
            return np.asarray(self.weights[name])
        t = self.protos.get(name)
        if t is None or t.data_location == TensorProto.EXTERNAL:
            return None
        value = numpy_helper.to_array(t)
        self.cache[name] = value
        return value


@dataclass(frozen=True)
class _Layer:
    """A layer running as a u8/s8 x s8 kernel: where its codes, weight codes and scales are."""

    node: onnx.NodeProto
    op: str  # Conv | MatMul | Gemm (the arithmetic's shape)
    inp: CorrectionInput
    weight_name: str
    weight: np.ndarray
    zero_point: float = 0.0


def emulate(model: onnx.ModelProto, family: str, *, host_saturates: bool,
            weights: Mapping[str, np.ndarray] | None = None, count: bool = True) -> Emulation:
    """The model rewritten to compute ``family``'s integer arithmetic in onnxruntime with optimizations off, on a
    host whose kernels saturate (``host_saturates``) or not (see module docs); ``weights`` are the values of a
    weightless model's placeholders (they stay placeholders); ``count`` adds the saturation counters as graph
    outputs (without it the graph's outputs are the model's). ``model`` is not modified."""
    if not has_integer_work(model):
        return Emulation(model, family)
    work = onnx.ModelProto()
    work.CopyFrom(model)
    taken = _name_nodes(work)
    out = Emulation(work, family)
    opset = next((o.version for o in work.opset_import if o.domain in ("", "ai.onnx")), 0)
    expanded = expand_fused(work, taken, opset)
    out.rewritten += expanded
    consts = _Constants(work, weights)
    fused = set(expanded)
    if saturates(family):
        fused |= fused_layers(work, weights)
    for graph in proto_scopes(work.graph):
        _rewrite_scope(graph, out, consts, taken, opset, fused, host_saturates, top=count and graph is work.graph)
    for name in out.counters:
        work.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, []))
    return out


def _name_nodes(model: onnx.ModelProto) -> set[str]:
    """Give unnamed nodes a name (onnxruntime names a fused kernel after its layer); every name in use."""
    taken = {n.name for g in proto_scopes(model.graph) for n in g.node}
    taken |= {t for g in proto_scopes(model.graph) for n in g.node for t in (*n.input, *n.output)}
    taken |= {t.name for g in proto_scopes(model.graph) for t in (*g.initializer, *g.input, *g.output)}
    for g in proto_scopes(model.graph):
        for i, n in enumerate(g.node):
            if not n.name:
                name, k = f"{n.op_type}({n.output[0] if n.output else i})", 1
                while name in taken:
                    k += 1
                    name = f"{n.op_type}({n.output[0] if n.output else i})#{k}"
                n.name = name
                taken.add(name)
    return taken


def _rewrite_scope(graph: onnx.GraphProto, out: Emulation, consts: _Constants, taken: set[str], opset: int,
                   fused: set[str], host_saturates: bool, top: bool) -> None:
    """Exact forms for this scope's integer nodes and corrections for its saturating layers, in place."""
    producers = {t: n for n in graph.node for t in n.output}
    nodes: list[onnx.NodeProto] = []
    extra_inits: list[onnx.TensorProto] = []
    for node in graph.node:
        em = ProtoEmitter(taken, opset)
        layer = _integer_layer(node, producers, consts, fused, out) if saturates(out.family) else None
        if layer is not None:
            _add_correction(layer, em, out, opset, top)  # renames the node's output: the exact form below writes it
        if host_saturates and node.op_type in ("MatMulInteger", "ConvInteger"):
            exact = ProtoEmitter(taken, opset)
            nodes += exact_integer_node(node, exact, consts.get)
            extra_inits += exact.inits
            out.rewritten.append(node.name)
        else:
            nodes.append(node)
        nodes += em.nodes
        extra_inits += em.inits
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(extra_inits)


def _integer_layer(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto], consts: _Constants, fused: set[str],
                   out: Emulation) -> _Layer | None:
    """The node as a u8/s8 x s8 layer of the deployed model, or None (a reason goes to ``out.skipped`` when it is
    one but cannot be emulated)."""
    if node.op_type in ("MatMulInteger", "ConvInteger"):
        return _explicit_layer(node, producers, consts, out)
    if node.name not in fused or node.op_type not in ("Conv", "MatMul", "Gemm"):
        return None
    act, wdq = (producers.get(node.input[i]) for i in (0, 1))
    if act is None or wdq is None or not is_dequantize(act.op_type, act.domain) or \
            not is_dequantize(wdq.op_type, wdq.domain):
        out.skipped.append((node.name, "its inputs are not DequantizeLinear outputs"))
        return None
    weight = consts.get(wdq.input[0])
    if weight is None:
        out.skipped.append((node.name, f"weight {wdq.input[0]!r} is not a constant"))
        return None
    if weight.dtype != np.int8:
        return None  # u8 weights: the u8 x u8 kernels widen to int16 first (exact)
    zp = consts.get(act.input[2]) if len(act.input) > 2 and act.input[2] else None
    signed = zp is not None and zp.dtype == np.int8
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Gemm" and attrs.get("transA", 0):
        out.skipped.append((node.name, "Gemm with transA is not emulated"))
        return None
    n_out = weight.shape[0] if node.op_type == "Conv" or (node.op_type == "Gemm" and attrs.get("transB", 0)) \
        else weight.shape[-1]
    wscale = consts.get(wdq.input[1])
    if wscale is None:
        out.skipped.append((node.name, "its weight scale is not a constant"))
        return None
    inp = CorrectionInput(act.input[0], signed, "float", act_scale=act.input[1],
                          weight_scale=np.broadcast_to(np.asarray(wscale, np.float64).reshape(-1), (n_out,)).copy(),
                          alpha=float(attrs.get("alpha", 1.0)) if node.op_type == "Gemm" else 1.0)
    return _Layer(node, node.op_type, inp, wdq.input[0], weight, float(zp) if zp is not None else 0.0)


def _explicit_layer(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto], consts: _Constants,
                    out: Emulation) -> _Layer | None:
    """``MatMulInteger``/``ConvInteger`` with a constant s8 weight, as a layer with an int32 accumulator."""
    weight = consts.get(node.input[1])
    if weight is None:
        out.skipped.append((node.name, f"weight {node.input[1]!r} is not a constant"))
        return None
    if weight.dtype != np.int8:
        return None
    zp = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    src = producers.get(node.input[0])
    dynamic = src is not None and is_dynamic_quantize(src.op_type, src.domain)
    signed = zp is not None and zp.dtype == np.int8 and not dynamic
    if node.op_type == "ConvInteger" and zp is None and len(node.input) > 2 and node.input[2]:
        out.skipped.append((node.name, "its activation zero point is not a constant (convolution padding reads it)"))
        return None
    op = "Conv" if node.op_type == "ConvInteger" else "MatMul"
    return _Layer(node, op, CorrectionInput(node.input[0], signed, "int32"), node.input[1], weight,
                  float(np.asarray(zp).reshape(-1)[0]) if zp is not None else 0.0)


def _add_correction(layer: _Layer, em: ProtoEmitter, out: Emulation, opset: int, count: bool) -> None:
    """Rename the layer's output and add ``output = renamed + correction`` when some pair can saturate; with
    ``count``, the site's counters become graph outputs (If/Loop bodies cannot export them)."""
    node = layer.node
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    group = int(attrs.get("group", 1))
    if layer.op == "Conv" and layer.weight.shape[1] == 1 and layer.weight.shape[0] == group:
        return  # depthwise: onnxruntime's depthwise kernel has no int16 pairs
    rows = kernel_rows(layer.weight, layer.op, bool(attrs.get("transB", 0)))
    if rows is None or (layer.op == "MatMul" and layer.weight.ndim != 2):
        out.skipped.append((node.name, f"weight of shape {list(layer.weight.shape)} is not emulated"))
        return
    out.analysed += 1
    risky = risky_pairs(rows)
    if not risky.count:
        return
    if opset < MIN_OPSET:
        out.skipped.append((node.name, f"opset {opset} < {MIN_OPSET}: its saturation is not emulated"))
        return
    base = f"{node.name}/avx2"
    exact = em.name(f"{node.output[0]}/exact")
    if layer.op == "Conv":
        geo = _geometry(attrs, layer.weight, group)
        if geo is None:
            out.skipped.append((node.name, f"auto_pad {attrs.get('auto_pad')!r} is not emulated"))
            return
        corr, sat, computed = conv_correction(em, layer.inp, risky, geo, layer.zero_point, layer.weight.shape[0],
                                              exact, base, count)
    else:
        corr, sat, computed = matmul_correction(em, layer.inp, risky, base, count)
    final = node.output[0]
    node.output[0] = exact
    em.nodes.append(helper.make_node("Add", [exact, corr], [final], name=em.name(f"{base}/saturated")))
    if count:
        out.sites.append(_site(layer, risky, sat, computed))
    else:
        out.skipped.append((node.name, "saturation emulated inside a subgraph: not counted"))


def _site(layer: _Layer, risky: RiskyPairs, saturated: str, computed: str) -> SaturationSite:
    return SaturationSite(layer.node.name, layer.node.op_type, layer.inp.codes, layer.weight_name, risky.count,
                          risky.pairs * risky.channels, risky.channels_at_risk, risky.channels, risky.worst,
                          saturated, computed)


def _geometry(attrs: dict[str, Any], weight: np.ndarray, group: int) -> ConvGeometry | None:
    """The convolution's window with explicit pads, or None for ``auto_pad`` SAME_* (not emulated)."""
    kernel = tuple(int(k) for k in attrs.get("kernel_shape", weight.shape[2:]))
    n = len(kernel)
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID", b"", ""):
        return None
    pads = tuple(int(p) for p in attrs.get("pads", [0] * (2 * n)))
    if attrs.get("auto_pad") in (b"VALID", "VALID"):
        pads = (0,) * (2 * n)
    return ConvGeometry(kernel, tuple(int(s) for s in attrs.get("strides", [1] * n)),
                        tuple(int(d) for d in attrs.get("dilations", [1] * n)), pads, group,
                        int(weight.shape[1]) * group)
