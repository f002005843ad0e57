"""Dynamic quantization of MatMul/Gemm with constant weights: activations quantized at run time.

``Y = MatMul(X, W)`` (or ``Gemm(X, W, C)``) becomes the standard-op form onnxruntime fuses into its
``DynamicQuantizeMatMul`` kernel (u8 activations x s8 weights, one pass over X for range and quantization)::

    X -> DynamicQuantizeLinear `X/dynq` -> (X/q, X/scale, X/zero_point)     shared by every MatMul reading X
    MatMulInteger `<node>/matmul_int`(X/q, W/q, X/zero_point, W/zero_point) -> int32
    Cast -> float;  Mul(X/scale, W/scale) -> per-column scale;  Mul -> Y   (+ Add(beta x C) for Gemm)

Weights are quantized per output column (``W/scale`` of shape (N,)) or per tensor; Gemm's ``alpha`` is folded
into ``W/scale`` and ``transB`` into the stored ``W/q``. No calibration data is needed, so this also works inside
If/Loop/Scan bodies, whose activations cannot be calibrated.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qgraph.quant.math import QuantDtype, QuantSpec, quantize

from .pairsafe import PairSafeLayer, pair_safe_layer
from .units import Unit
from .weights import Emitter, finite_constant, quantize_weight_values, release_float
from .wmath import lopsided


class DynamicQuantizer:
    """Rewrites dynamic units; one DynamicQuantizeLinear per activation tensor (per graph)."""

    def __init__(self, em: Emitter, spec: QuantSpec) -> None:
        self.em = em
        self.spec = spec
        self._dynq: dict[tuple[int, str], tuple[gs.Variable, gs.Variable, gs.Variable]] = {}
        self.replaced: set[int] = set()  # ids of the MatMul/Gemm nodes replaced (removed by the caller)
        self.auto_symmetric = False
        self.asym_gain = 1.25
        #: ``saturation: avoid``: raise the scales of columns whose u8 x s8 pairs could leave int16 (AVX2).
        self.pair_safe = False
        self.rescaled: list[PairSafeLayer] = []

    def _quantize_input(self, target: gs.Graph, x: gs.Tensor) -> tuple[gs.Variable, gs.Variable, gs.Variable]:
        key = (id(target), x.name)
        got = self._dynq.get(key)
        if got is None:
            em = self.em
            q = gs.Variable(em.name(f"{x.name}/q"), dtype=np.uint8)
            s = gs.Variable(em.name(f"{x.name}/scale"), dtype=np.float32, shape=[])
            z = gs.Variable(em.name(f"{x.name}/zero_point"), dtype=np.uint8, shape=[])
            em.node("DynamicQuantizeLinear", f"{x.name}/dynq", [x], [q, s, z], target=target)
            got = (q, s, z)
            self._dynq[key] = got
        return got

    def unit(self, unit: Unit, target: gs.Graph) -> None:
        """Replace ``unit.node`` (MatMul or Gemm with constant input 1) by the dynamic form."""
        node = unit.node
        em = self.em
        w_t = node.inputs[1]
        w = em.g.constant_value(w_t)
        assert w is not None
        finite_constant(w, w_t.name, node.name)
        w = w.astype(np.float32, copy=False)
        alpha = 1.0
        bias: gs.Tensor | None = None
        if node.op == "Gemm":
            if int(node.attrs.get("transB", 0)):
                w = np.ascontiguousarray(w.T)
            alpha = float(node.attrs.get("alpha", 1.0))
            if len(node.inputs) > 2 and node.inputs[2].name:
                bias = node.inputs[2]
                beta = float(node.attrs.get("beta", 1.0))
                if beta != 1.0:
                    c = em.g.constant_value(bias)
                    if c is None:
                        raise AssertionError("Gemm bias with beta != 1 must be constant for dynamic mode")
                    bias = em.const(f"{bias.name}/beta", (c * beta).astype(np.float32))
        axis = 1 if (self.spec.per_channel and w.ndim == 2) else None
        symmetric = not lopsided(w, axis, self.asym_gain) if self.auto_symmetric else self.spec.symmetric
        spec = self.spec.model_copy(update={"per_channel": axis is not None, "axis": axis, "symmetric": symmetric})
        scale, zp = quantize_weight_values(w, spec)
        qw = quantize(w, scale, zp, spec.dtype, axis)
        if self.pair_safe and symmetric and spec.dtype == QuantDtype.INT8 and w.ndim == 2:
            # the weight is (K, N) here whatever the node (transB undone above): its kernel rows are MatMul's
            fixed = pair_safe_layer(gs.Node("MatMul", name=node.name), w, qw, np.asarray(scale, np.float32), spec)
            if fixed is not None:
                self.rescaled.append(fixed)
                scale = fixed.scale
                qw = quantize(w, scale, zp, spec.dtype, axis)
        base = w_t.name
        wq = em.const(f"{base}/q", qw)
        ws = em.const(f"{base}/scale", (np.asarray(scale, np.float64) * alpha).astype(np.float32))
        wz = em.zero_point(base, np.asarray(zp))
        xq, xs, xz = self._quantize_input(target, node.inputs[0])
        y = node.outputs[0]
        name = node.name or y.name
        acc = gs.Variable(em.name(f"{y.name}/int32"), dtype=np.int32)
        em.node("MatMulInteger", f"{name}/matmul_int", [xq, wq, xz, wz], [acc], target=target)
        accf = gs.Variable(em.name(f"{y.name}/int32_float"), dtype=np.float32)
        em.node("Cast", f"{name}/cast", [acc], [accf], target=target, to=1)
        sc = gs.Variable(em.name(f"{y.name}/scale"), dtype=np.float32)
        em.node("Mul", f"{name}/scale_mul", [xs, ws], [sc], target=target)
        node.outputs.clear()
        node.inputs.clear()
        release_float(em, w_t)
        self.replaced.add(id(node))
        if bias is None:
            em.node("Mul", f"{name}/rescale", [accf, sc], [y], target=target)
            return
        mid = gs.Variable(em.name(f"{y.name}/no_bias"), dtype=np.float32)
        em.node("Mul", f"{name}/rescale", [accf, sc], [mid], target=target)
        em.node("Add", f"{name}/bias", [mid, bias], [y], target=target)
