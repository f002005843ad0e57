"""A model rewritten so onnxruntime computes a target CPU's integer arithmetic on any host.

Two ways, by the session that runs it:

- ``requantize`` (how `qgraph.runtime.kernels.measure.Kernels` measures every CPU family): the session keeps
  onnxruntime's optimizations, so every Q/DQ layer fuses into this host's integer kernels as it deploys. Only the
  layers whose arithmetic differs between this host and the target (u8 x s8 pair sums that can leave int16, where
  one of the two saturates) are rewritten, as the fused kernel computes them: the exact int32 sum, the target's pair
  saturation added, then onnxruntime's requantization (`qgraph.runtime.kernels.requant`). Bit for bit the
  target's deployed outputs: YOLOv8n (both recipes), PicoDet and the digits CNN against onnxruntime 1.32's real
  AVX2 kernels under qemu-user.
- Q/DQ in float (the default; ``exact`` arithmetic and the layer-by-layer diff): with optimizations off
  (``ORT_DISABLE_ALL``) every quantized layer computes ``DequantizeLinear -> float op -> QuantizeLinear``, exact
  int32 accumulation up to float rounding, and a saturating layer gets a correction in float. It rounds one code
  differently from the fused kernels now and then, which compounds through deep networks (YOLOv8n: 20 % of the
  head's codes one step apart; detection F1 0.978 against 0.956 deployed).

Either way:

1. **Integer ops written into the model** (``MatMulInteger`` from dynamic quantization, ``ConvInteger``, and the
   fused forms other tools write: ``QLinearConv``, ``QLinearMatMul``, ``DynamicQuantizeMatMul``,
   ``MatMulIntegerToFloat``) run onnxruntime's real integer kernels, so on an AVX2 host they saturate. The fused
   forms are expanded into their standard-op definitions; where this host's kernels saturate,
   ``MatMulInteger``/``ConvInteger`` become the same sums in float64/float32 (exact).
2. **AVX2 without VNNI** adds adjacent u8 x s8 products into a saturating int16 (`qgraph.runtime.kernels.pairs`):
   every layer that runs as a u8 x s8 integer kernel on deployment gets the correction subgraph of
   `qgraph.runtime.kernels.corrections` for exactly the weight pairs that can overflow. Which Q/DQ layers fuse is
   asked of onnxruntime itself (`qgraph.runtime.kernels.fusion`).

Measured against onnxruntime 1.32's AVX2 kernels under qemu-user on convolutions (odd/even channels, groups,
strides, s8 activations, weight zero points), MatMuls, Gemms and dynamic quantization: identical outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from qgraph.graph.ops import proto_scopes
from qgraph.quant.qdq import is_dequantize, is_dynamic_quantize, is_qdq

from .corrections import MIN_OPSET, ConvGeometry, CorrectionInput, ProtoEmitter, conv_correction, matmul_correction
from .expand import exact_integer_node, expand_fused
from .fusion import FUSED_GEMM_OPS, Constants, fused_layers, fusion_key
from .host import saturates
from .pairs import RiskyPairs, kernel_rows, risky_pairs
from .requant import IntegerForm, integer_form

__all__ = ["FUSED_GEMM_OPS", "INTEGER_OPS", "Emulation", "SaturationSite", "emulate", "fused_layers", "fusion_key",
           "has_integer_work"]

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
    #: Layers written as their fused kernel computes them (``requantize``: `qgraph.runtime.kernels.requant`).
    requantized: list[str] = field(default_factory=list)
    #: (node, why) layers ``requantize`` could not write that way (`notes` says what they compute instead).
    approximate: list[tuple[str, str]] = field(default_factory=list)
    #: Layers inside If/Loop bodies whose saturation is emulated but not counted (a body cannot export counters).
    uncounted: list[str] = field(default_factory=list)

    @property
    def counters(self) -> list[str]:
        """The extra graph outputs (two per site)."""
        return [n for s in self.sites for n in (s.saturated_output, s.computed_output)]

    def notes(self) -> list[str]:
        """Where this emulation is not the target's deployed arithmetic bit for bit, one line per layer with why:
        layers whose saturation (the target's, or this host's where the target has none) it cannot handle, and
        layers it could not write as their fused kernel."""
        target = saturates(self.family)
        lost = "int16 pair saturation not emulated" if target else \
            "runs this host's integer kernel, whose int16 pair sums can saturate where the target's do not"
        instead = "its pair saturation is added to Q/DQ computed in float, which can round a code differently" \
            if target else lost
        return [f"{node}: {lost} ({why})" for node, why in self.skipped] + \
            [f"{node}: not written as its fused kernel ({why}): {instead}" for node, why in self.approximate]


def has_integer_work(model: onnx.ModelProto) -> bool:
    """Whether ``model`` holds Q/DQ or integer ops anywhere (a float model needs no emulation)."""
    return any(is_qdq(n.op_type, n.domain, dynamic=True) or n.op_type in INTEGER_OPS
               for g in proto_scopes(model.graph) for n in g.node)


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
            weights: Mapping[str, np.ndarray] | None = None, count: bool = True, requantize: bool = False) -> Emulation:
    """The model rewritten to compute ``family``'s integer arithmetic in onnxruntime, on a host whose kernels
    saturate (``host_saturates``) or not (see module docs); ``weights`` are the values of a weightless model's
    placeholders (they stay placeholders); ``count`` adds the saturation counters as graph outputs (without it the
    graph's outputs are the model's); ``requantize``: for a session with onnxruntime's optimizations on, only the
    layers whose arithmetic differs on this host are rewritten, as exact int32 sums with onnxruntime's own
    requantization (else: corrections on Q/DQ computed in float, for a session with optimizations off). ``model``
    is not modified."""
    if not has_integer_work(model):
        return Emulation(model, family)
    work = onnx.ModelProto()
    work.CopyFrom(model)
    taken = _name_nodes(work)
    out = Emulation(work, family)
    opset = next((o.version for o in work.opset_import if o.domain in ("", "ai.onnx")), 0)
    expanded = expand_fused(work, taken, opset)
    out.rewritten += expanded
    consts = Constants(work, weights)
    fused = set(expanded)
    if saturates(family) or (requantize and host_saturates):
        fused |= fused_layers(work, weights)
    for graph in proto_scopes(work.graph):
        _rewrite_scope(graph, out, _Scope(consts, taken, opset, fused, host_saturates, requantize),
                       top=count and graph is work.graph)
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


@dataclass(frozen=True)
class _Scope:
    """What every scope's rewrite reads."""

    consts: Constants
    taken: set[str]
    opset: int
    fused: set[str]
    host_saturates: bool
    requantize: bool


def _rewrite_scope(graph: onnx.GraphProto, out: Emulation, sc: _Scope, top: bool) -> None:
    """Exact forms for this scope's integer nodes and corrections for its saturating layers, in place."""
    producers = {t: n for n in graph.node for t in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    outputs = {o.name for o in graph.output}
    nodes: list[onnx.NodeProto] = []
    extra_inits: list[onnx.TensorProto] = []
    removed: set[str] = set()
    differs = saturates(out.family) or (sc.requantize and sc.host_saturates)
    for node in graph.node:
        em = ProtoEmitter(sc.taken, sc.opset)
        layer = _integer_layer(node, producers, sc.consts, sc.fused, out) if differs else None
        risky = _risk(layer, out, sc.opset) if layer is not None else None
        if layer is not None and risky is not None and sc.requantize and node.op_type in ("Conv", "MatMul", "Gemm"):
            form = integer_form(node, producers, consumers, sc.consts.get, outputs)
            if isinstance(form, IntegerForm):
                _requantize(layer, form, risky, em, out, sc.consts, sc.host_saturates, top)
                removed |= form.replaces
                nodes += em.nodes
                extra_inits += em.inits
                continue
            out.approximate.append((node.name, form))
        if layer is not None and risky is not None and saturates(out.family):
            _add_correction(layer, risky, em, out, top)  # renames the node's output: the exact form writes it
        if sc.host_saturates and node.op_type in ("MatMulInteger", "ConvInteger"):
            exact = ProtoEmitter(sc.taken, sc.opset)
            nodes += exact_integer_node(node, exact, sc.consts.get)
            extra_inits += exact.inits
            out.rewritten.append(node.name)
        else:
            nodes.append(node)
        nodes += em.nodes
        extra_inits += em.inits
    del graph.node[:]
    graph.node.extend(n for n in nodes if n.name not in removed)
    graph.initializer.extend(extra_inits)


def _integer_layer(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto], consts: Constants, fused: set[str],
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


def _explicit_layer(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto], consts: Constants,
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


def _risk(layer: _Layer, out: Emulation, opset: int) -> RiskyPairs | None:
    """The layer's weight pairs that can leave int16, or None when none can (or the layer cannot be emulated: the
    reason goes to ``out.skipped``)."""
    node = layer.node
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    group = int(attrs.get("group", 1))
    if layer.op == "Conv" and layer.weight.shape[1] == 1 and layer.weight.shape[0] == group:
        return None  # depthwise: onnxruntime's depthwise kernel has no int16 pairs
    rows = kernel_rows(layer.weight, layer.op, bool(attrs.get("transB", 0)))
    if rows is None or (layer.op == "MatMul" and layer.weight.ndim != 2):
        out.skipped.append((node.name, f"weight of shape {list(layer.weight.shape)} is not emulated"))
        return None
    out.analysed += 1
    risky = risky_pairs(rows)
    if not risky.count:
        return None
    if opset < MIN_OPSET:
        out.skipped.append((node.name, f"opset {opset} < {MIN_OPSET}: its saturation is not emulated"))
        return None
    if layer.op == "Conv" and _geometry(attrs, layer.weight, group) is None:
        out.skipped.append((node.name, f"auto_pad {attrs.get('auto_pad')!r} is not emulated"))
        return None
    return risky


def _correction(layer: _Layer, em: ProtoEmitter, out: Emulation, risky: RiskyPairs, inp: CorrectionInput,
                output: str, count: bool) -> str:
    """The correction to add to ``output`` (the layer's exact result in ``inp``'s units); with ``count``, the
    site's counters become graph outputs (If/Loop bodies cannot export them)."""
    node = layer.node
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    base = f"{node.name}/avx2"
    if layer.op == "Conv":
        geo = _geometry(attrs, layer.weight, int(attrs.get("group", 1)))
        assert geo is not None  # `_risk` checked
        corr, sat, computed = conv_correction(em, inp, risky, geo, layer.zero_point, layer.weight.shape[0], output,
                                              base, count)
    else:
        corr, sat, computed = matmul_correction(em, inp, risky, base, count)
    if count:
        out.sites.append(_site(layer, risky, sat, computed))
    else:
        out.uncounted.append(node.name)
    return corr


def _add_correction(layer: _Layer, risky: RiskyPairs, em: ProtoEmitter, out: Emulation, count: bool) -> None:
    """Rename the layer's output and add ``output = renamed + correction`` for its ``risky`` pairs."""
    node = layer.node
    exact = em.name(f"{node.output[0]}/exact")
    corr = _correction(layer, em, out, risky, layer.inp, exact, count)
    final = node.output[0]
    node.output[0] = exact
    em.nodes.append(helper.make_node("Add", [exact, corr], [final], name=em.name(f"{node.name}/avx2/saturated")))


def _requantize(layer: _Layer, form: IntegerForm, risky: RiskyPairs, em: ProtoEmitter, out: Emulation,
                consts: Constants, host_saturates: bool, count: bool) -> None:
    """The layer as its fused kernel computes it (`qgraph.runtime.kernels.requant`): the exact int32 sum, the
    target's pair saturation added to it where the target has it, then onnxruntime's requantization."""
    acc = form.accumulator(em, consts.get, exact_float=host_saturates)
    if saturates(out.family):
        corr = _correction(layer, em, out, risky, CorrectionInput(form.codes, form.signed, "int32"), acc, count)
        acc = em.op("Add", [acc, corr], f"{layer.node.name}/avx2/saturated")
    form.finish(em, acc)
    out.requantized.append(layer.node.name)


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
