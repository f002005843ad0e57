"""Weights (per-channel or per-tensor), int32 biases and constant operands of Add/Mul/Concat.

Weight ``W`` of a unit becomes the integer initializer ``W/q`` with ``W/scale`` and ``W/zero_point`` behind a
DequantizeLinear node ``W/dq`` (output ``W/dq``); with ``format: float_qdq`` (TensorRT) ``W`` stays float and a
QuantizeLinear ``W/q`` feeds the DequantizeLinear. The bias ``B`` becomes ``B/q`` (int32, zero point 0) with
``B/scale = input_scale x weight_scale`` per output channel (`qgraph.quant.math.quantize_bias`, which raises a weight
channel's scale when the product would be too small for the bias to fit in int32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper

from qgraph import GraphHandle, PassError
from qgraph.quant.math import QuantDtype, QuantSpec, compute_scale_zero_point, quantize

from .pairsafe import ChannelCodes, PairSafeLayer, pair_safe_layer
from .units import Unit, label
from .wmath import WeightMath, layer_math, lopsided, stacked_math

PASS = "insert_qdq"


def storage(arr: npt.NDArray[Any], dtype: QuantDtype) -> npt.NDArray[Any]:
    """``arr`` in the numpy dtype the initializer is written with (ml_dtypes int4/uint4 for 4-bit types)."""
    if dtype in (QuantDtype.INT4, QuantDtype.UINT4):
        import ml_dtypes

        return np.asarray(arr).astype(ml_dtypes.int4 if dtype == QuantDtype.INT4 else ml_dtypes.uint4)
    return np.asarray(arr)


@dataclass
class QuantizedWeight:
    """A unit's quantized weight, as the saturation analysis and the bias need it."""

    name: str
    node: str
    op: str
    values: npt.NDArray[Any]  # integer codes, original layout
    scale: npt.NDArray[np.float32]
    zero_point: npt.NDArray[Any]
    axis: int | None
    transposed: bool = False  # Gemm transB


class Emitter:
    """Creates Q/DQ nodes and initializers with predictable, collision-free names, tagged with the pass."""

    def __init__(self, graph: GraphHandle) -> None:
        self.g = graph
        self.new_nodes: list[gs.Node] = []
        self._zero_points: dict[tuple[str, tuple[int, ...], bytes], gs.Constant] = {}
        self._outputs: set[int] | None = None

    def scope_outputs(self) -> set[int]:
        """ids of the output tensors of every scope (computed once: passes rewire nodes, never outputs)."""
        if self._outputs is None:
            self._outputs = {id(t) for g in self.g.scopes() for t in g.outputs}
        return self._outputs

    def zero_point(self, base: str, value: npt.NDArray[Any]) -> gs.Constant:
        """Zero-point initializer ``<base>/zero_point``; equal zero points share one initializer."""
        arr = np.asarray(value)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        got = self._zero_points.get(key)
        if got is None:
            got = self.const(f"{base}/zero_point", arr)
            self._zero_points[key] = got
        return got

    def name(self, base: str) -> str:
        """Tensor name ``base`` or ``base_1``... not used yet (the handle's, across every scope)."""
        return self.g.unique_name(base, kind="tensor")

    def node_name(self, base: str) -> str:
        """Node name ``base`` or ``base_1``... not used yet."""
        return self.g.unique_name(base, kind="node")

    def const(self, base: str, value: npt.NDArray[Any]) -> gs.Constant:
        """A new initializer."""
        arr = np.asarray(value)
        name = self.name(base)
        if arr.dtype.name in ("int4", "uint4"):  # graphsurgeon would write one byte per 4-bit value: pack here
            kind = TensorProto.INT4 if arr.dtype.name == "int4" else TensorProto.UINT4
            proto = helper.make_tensor(name, kind, list(arr.shape), arr.astype(np.int32).ravel().tolist())
            return gs.Constant(name, gs.ir.tensor.LazyValues(proto))
        return gs.Constant(name, arr if arr.flags.c_contiguous else np.ascontiguousarray(arr))

    def node(
        self,
        op: str,
        base: str,
        inputs: list[gs.Tensor],
        outputs: list[gs.Tensor],
        target: gs.Graph | None = None,
        **attrs: Any,
    ) -> gs.Node:
        """A new node named ``base`` (made unique), tagged with the pass, appended to ``target`` (top graph)."""
        n = gs.Node(op, self.node_name(base), attrs=attrs, inputs=inputs, outputs=outputs)
        (target if target is not None else self.g.graph).nodes.append(n)
        self.g.tag(n, PASS)
        self.new_nodes.append(n)
        return n

    def dequantize(
        self,
        base: str,
        q: gs.Tensor,
        scale: gs.Tensor,
        zp: gs.Tensor | None,
        shape: Any = None,
        axis: int | None = None,
    ) -> gs.Variable:
        """``DequantizeLinear`` named ``<base>/dq`` with output ``<base>/dq``."""
        out = gs.Variable(self.name(f"{base}/dq"), dtype=np.float32, shape=shape)
        inputs = [q, scale] + ([zp] if zp is not None else [])
        self.node("DequantizeLinear", out.name, inputs, [out], **({"axis": axis} if axis is not None else {}))
        return out


def finite_constant(value: npt.NDArray[Any], tensor: str, node: str) -> None:
    """`PassError` naming ``tensor`` and ``node`` when a float constant holds NaN/Inf (no scale exists for it)."""
    if value.dtype.kind in "fc" and not np.isfinite(value).all():
        bad = int(value.size - np.count_nonzero(np.isfinite(value)))
        raise PassError(
            f"insert_qdq: constant {tensor!r} (input of node {node!r}) holds {bad} NaN/Inf value(s), so it has no "
            "quantization scale. Fix the model (a BatchNorm with negative variance folds into NaN weights) or keep "
            f"the node float: `nodes: {{exclude: {{names: [{node}]}}}}`."
        )


def release_float(em: Emitter, t: gs.Tensor) -> None:
    """Free a float initializer's values once its integer replacement took over its last reader: one float copy of
    a weight at a time, not all of them beside all the integer ones (an unread initializer is never exported)."""
    if isinstance(t, gs.Constant) and not t.outputs and id(t) not in em.scope_outputs():
        t.values = np.empty((0,), np.float32)


def check_finite_weights(graph: GraphHandle, units: list[Unit]) -> None:
    """`finite_constant` on the weight and bias of every weighted unit."""
    for unit in units:
        node = unit.node
        refs = [(node, unit.weight_index)] if unit.weight_index is not None else []
        refs += [unit.bias] if unit.bias is not None else []
        for owner, index in refs:
            value = graph.constant_value(owner.inputs[index])
            if value is not None:
                finite_constant(value, owner.inputs[index].name, owner.name)


def quantize_weight_values(
    w: npt.NDArray[np.float32], spec: QuantSpec
) -> tuple[npt.NDArray[np.float32], npt.NDArray[Any]]:
    """Scale and zero point of ``w`` (per channel along ``spec.axis`` or per tensor)."""
    if spec.per_channel and spec.axis is not None:
        axes = tuple(i for i in range(w.ndim) if i != spec.axis % w.ndim)
        lo, hi = w.min(axis=axes), w.max(axis=axes)
    else:
        lo, hi = np.float64(w.min()) if w.size else 0.0, np.float64(w.max()) if w.size else 0.0
    return compute_scale_zero_point(lo, hi, spec)


class WeightQuantizer:
    """Quantizes the weights, biases and constant operands of the plan's units."""

    def __init__(self, em: Emitter, spec: QuantSpec, fmt: str, act_dtype: QuantDtype, bias: str) -> None:
        self.em = em
        self.spec = spec
        self.fmt = fmt
        self.act_dtype = act_dtype
        self.bias_mode = bias
        self._shared: dict[tuple[str, int | None, bytes], gs.Variable] = {}
        self.weights: list[QuantizedWeight] = []
        self.adjusted: list[str] = []
        self._specs: dict[tuple[int | None, bool], QuantSpec] = {}
        self.auto_symmetric = False
        self.asym_gain = 1.25
        self.asymmetric: list[str] = []  # layers `symmetric: auto` gave zero points
        self._pre: dict[int, WeightMath] = {}
        #: ``saturation: avoid``: raise the scales of channels whose u8 x s8 pairs could leave int16 (AVX2).
        self.pair_safe = False
        #: Raw codes of each layer input's channels on the calibration data (`pairsafe`; absent: any code).
        self.input_codes: dict[str, ChannelCodes] = {}
        self.rescaled: list[PairSafeLayer] = []

    def _inputs(
        self, unit: Unit, input_scale: float | None
    ) -> tuple[npt.NDArray[np.float32], QuantSpec, npt.NDArray[np.float32] | None]:
        """The unit's float weight, its spec, and its bias values (beta folded) when it gets an int32 bias."""
        node = unit.node
        assert unit.weight_index is not None
        w = self.em.g.constant_value(node.inputs[unit.weight_index])
        assert w is not None
        finite_constant(w, node.inputs[unit.weight_index].name, node.name)
        axis = unit.weight_axis
        w = w.astype(np.float32, copy=False)
        symmetric = not lopsided(w, axis, self.asym_gain) if self.auto_symmetric else self.spec.symmetric
        spec = self._specs.get((axis, symmetric))
        if spec is None:
            update = {"per_channel": axis is not None, "axis": axis, "symmetric": symmetric}
            spec = self._specs[(axis, symmetric)] = self.spec.model_copy(update=update)
        bias = None
        if unit.bias is not None and self.bias_mode == "int32" and input_scale is not None:
            bnode, bidx = unit.bias
            b = self.em.g.constant_value(bnode.inputs[bidx])
            assert b is not None
            finite_constant(b, bnode.inputs[bidx].name, bnode.name)
            beta = float(bnode.attrs.get("beta", 1.0)) if bnode.op == "Gemm" else 1.0
            bias = b.astype(np.float32) if beta == 1.0 else (b.astype(np.float64) * beta).astype(np.float32)
        return w, spec, bias

    def prepare(self, units: list[tuple[Unit, float | None]], min_group: int = 4, max_bytes: int = 1 << 20) -> None:
        """Precompute the arithmetic of same-shaped layers of at most ``max_bytes`` in stacks (see `wmath`): the
        per-call overhead it removes only matters for small layers, and a stack is a copy of its weights."""
        groups: dict[tuple[Any, ...], list[tuple[Unit, npt.NDArray[np.float32], Any, float | None]]] = {}
        for unit, s_in in units:
            if unit.weight_index is None:
                continue
            w, spec, bias = self._inputs(unit, s_in)
            if w.nbytes > max_bytes:
                continue
            key = (w.shape, spec.axis, spec.symmetric, None if bias is None else bias.shape)
            groups.setdefault(key, []).append((unit, w, bias, s_in))
        for (_, axis, symmetric, bshape), members in groups.items():
            if len(members) < min_group:
                continue
            spec = self._specs[(axis, symmetric)]
            biases = [m[2] for m in members] if bshape is not None else None
            scales = [float(m[3]) for m in members] if bshape is not None else None  # type: ignore[arg-type]
            for (unit, _, _, _), math in zip(
                members, stacked_math([m[1] for m in members], spec, biases, scales), strict=True
            ):
                if math is not None:
                    self._pre[id(unit)] = math

    def unit(self, unit: Unit, input_scale: float | None) -> QuantizedWeight | None:
        """Quantize ``unit``'s weight (and bias when ``input_scale`` is known); rewire the node."""
        node = unit.node
        if unit.weight_index is None:
            return None
        w_t = node.inputs[unit.weight_index]
        w, spec, bias = self._inputs(unit, input_scale)
        math = self._pre.pop(id(unit), None) or layer_math(w, spec, bias, input_scale)
        if self.pair_safe and spec.symmetric and spec.dtype == QuantDtype.INT8:
            codes = self.input_codes.get(unit.act_inputs[0]) if unit.act_inputs else None
            fixed = pair_safe_layer(node, w, math.qw, math.scale, spec, codes)
            if fixed is not None:
                self.rescaled.append(fixed)
                math = layer_math(w, spec, bias, input_scale, scale=fixed.scale)
        if self.auto_symmetric and not spec.symmetric:
            self.asymmetric.append(label(node))
        scale, zp, axis = math.scale, math.zero_point, spec.axis
        if math.adjusted:
            self.adjusted.append(label(node))
        if unit.bias is not None and bias is not None and math.bias_q is not None and math.bias_scale is not None:
            bnode, _ = unit.bias
            self._emit_bias(unit, math.bias_q.reshape(self._bias_shape(bnode, bias)), math.bias_scale, scale.ndim > 0)
            if bnode.op == "Gemm":
                bnode.attrs["beta"] = 1.0
        key = (w_t.name, axis, scale.tobytes())
        dq = self._shared.get(key)
        if dq is None:
            dq = self._emit_weight(w_t, w, math.qw, scale, zp, axis if scale.ndim else None)
            self._shared[key] = dq
        node.inputs[unit.weight_index] = dq
        if self.fmt != "float_qdq":
            release_float(self.em, w_t)
        qwt = QuantizedWeight(w_t.name, label(node), node.op, math.qw, np.asarray(scale), np.asarray(zp), axis)
        qwt.transposed = bool(node.op == "Gemm" and int(node.attrs.get("transB", 0)))
        self.weights.append(qwt)
        return qwt

    @staticmethod
    def _bias_shape(bnode: gs.Node, b: npt.NDArray[Any]) -> tuple[int, ...]:
        # Gemm's C may be (1, N); the int32 bias is (N,) (same broadcast). An Add keeps its bias shape.
        return (b.size,) if bnode.op != "Add" else tuple(b.shape)

    def _emit_weight(
        self,
        w_t: gs.Tensor,
        w: npt.NDArray[np.float32],
        qw: npt.NDArray[Any],
        scale: npt.NDArray[np.float32],
        zp: npt.NDArray[Any],
        axis: int | None,
    ) -> gs.Variable:
        em = self.em
        base = w_t.name
        s = em.const(f"{base}/scale", np.asarray(scale, np.float32))
        z = em.zero_point(base, storage(zp, self.spec.dtype))
        if self.fmt == "float_qdq":
            src = gs.Constant(w_t.name, w) if isinstance(w_t, gs.Constant) else w_t
            q = gs.Variable(em.name(f"{base}/q"), dtype=storage(qw[:0], self.spec.dtype).dtype, shape=list(w.shape))
            em.node("QuantizeLinear", q.name, [src, s, z], [q], **({"axis": axis} if axis is not None else {}))
            qin: gs.Tensor = q
        else:
            qin = em.const(f"{base}/q", storage(qw, self.spec.dtype))
        return em.dequantize(base, qin, s, z, list(w.shape), axis)

    def _emit_bias(
        self, unit: Unit, values: npt.NDArray[np.int32], scale: npt.NDArray[np.float32], per_channel: bool
    ) -> None:
        assert unit.bias is not None
        bnode, bidx = unit.bias
        em = self.em
        base = bnode.inputs[bidx].name
        q = em.const(f"{base}/q", values)
        sc = scale.reshape(-1) if per_channel else np.asarray(scale.reshape(-1)[0], np.float32)
        s = em.const(f"{base}/scale", np.asarray(sc, np.float32))
        axis = values.ndim - 1 if per_channel else None
        bnode.inputs[bidx] = em.dequantize(base, q, s, None, list(values.shape), axis)

    def constant_operand(self, node: gs.Node, index: int) -> None:
        """Quantize a float constant operand of Add/Mul/Concat per tensor with the activation type."""
        t = node.inputs[index]
        v = self.em.g.constant_value(t)
        assert v is not None
        finite_constant(v, t.name, node.name)
        spec = QuantSpec(dtype=self.act_dtype, symmetric=False)
        lo = float(v.min()) if v.size else 0.0
        hi = float(v.max()) if v.size else 0.0
        scale, zp = compute_scale_zero_point(lo, hi, spec)
        q = quantize(v.astype(np.float32), scale, zp, spec.dtype)
        em = self.em
        s = em.const(f"{t.name}/scale", scale)
        z = em.zero_point(t.name, storage(zp, spec.dtype))
        node.inputs[index] = em.dequantize(t.name, em.const(f"{t.name}/q", storage(q, spec.dtype)), s, z, list(v.shape))
