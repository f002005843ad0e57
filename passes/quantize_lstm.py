"""The ``quantize_lstm`` pass: ONNX ``LSTM`` nodes with constant weights become onnxruntime's
``com.microsoft.DynamicQuantizeLSTM`` (int8 weights, inputs quantized at run time), in every scope.

onnxruntime has no static (QDQ) LSTM kernel, so ``insert_qdq`` leaves LSTMs float. Its contrib op
``DynamicQuantizeLSTM`` takes the input and recurrent weights as int8 and quantizes each step's activations
itself: no calibration, hence it also works inside ``If``/``Loop`` bodies (a VAD's recurrent cell sits in a
shape-driven ``If``). Rewrite, per LSTM with constant ``W`` [D, 4H, I] and ``R`` [D, 4H, H] (``layout = 0``)::

    s_c = max_k |W[d, c, k]| / 127            per gate row c (per_channel) or one s for the tensor
    W_q[d, k, c] = round(W[d, c, k] / s_c)    int8, symmetric (zero point 0), transposed to [D, I, 4H]
    (the same for R), then  DynamicQuantizeLSTM(X, W_q, R_q, B, seq_lens, h0, c0, P, s_W, 0, s_R, 0)

Outputs, bias, peepholes, states and attributes are kept. An LSTM whose weights are not constants, or that uses
``layout = 1``, is skipped with the reason.

The op's GEMMs multiply u8 activations by these s8 weights, which on x86 without VNNI add adjacent products into a
saturating int16 (`qgraph.runtime.kernels.pairs`). ``saturation: auto`` (the default) raises the scale of just the gate
rows where a pair of codes could overflow (`qgraph.runtime.kernels.pairs.pair_safe_scales`) unless the target CPU is one
whose kernels are exact (``x86-vnni``, ``arm``): the model then deploys the same on any x86 CPU.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import onnx_graphsurgeon as gs
from pydantic import Field

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassResult, register
from qgraph.graph import const_value, is_default_domain
from qgraph.quant.math import QuantDtype, QuantSpec, compute_scale_zero_point, quantize
from qgraph.runtime.kernels.measure import target_family
from qgraph.runtime.kernels.pairs import pair_safe_scales

__all__ = ["QuantizeLSTM", "QuantizeLSTMConfig"]

MS_DOMAIN = "com.microsoft"


class QuantizeLSTMConfig(PassConfig):
    """Weight granularity."""

    per_channel: bool = Field(default=True, description="One scale per gate row (else one per weight tensor).")
    saturation: Literal["auto", "avoid", "off"] = Field(
        default="auto",
        description="avoid: raise the scale of the gate rows whose u8×s8 pairs could leave int16 on x86 without "
        "VNNI; auto: avoid unless the target CPU is x86-vnni or arm (exact kernels); off.")


def _quantized(w: np.ndarray, per_channel: bool, pair_safe: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(W_q [D, K, 4H] int8, scale [D, 4H], zero point [D, 4H] int8)`` for ``w`` [D, 4H, K] (module docs)."""
    absmax = np.abs(w).max(axis=2) if per_channel else np.full(w.shape[:2], np.abs(w).max())
    spec = QuantSpec(dtype=QuantDtype.INT8, symmetric=True)
    scale, zero = compute_scale_zero_point(-absmax, absmax, spec)
    rows = w.reshape(-1, w.shape[2])  # one row per (direction, gate row): per-channel along axis 0
    if pair_safe:  # the rows are the GEMM's output channels, K its reduction axis: the kernel's pairs
        raised = pair_safe_scales(rows, scale.reshape(-1), *spec.qrange)
        scale = (raised if per_channel else np.full_like(raised, raised.max())).reshape(scale.shape)
    codes = quantize(rows, scale.reshape(-1), zero.reshape(-1), QuantDtype.INT8, axis=0).reshape(w.shape)
    return np.ascontiguousarray(codes.transpose(0, 2, 1)), scale.astype(np.float32), zero.astype(np.int8)


@register
class QuantizeLSTM(Pass[QuantizeLSTMConfig]):
    """LSTM -> com.microsoft.DynamicQuantizeLSTM with int8 weights, in every scope (module docstring)."""

    name = "quantize_lstm"
    quantizes = True  # its skip reasons say why an LSTM stayed float
    config_class = QuantizeLSTMConfig
    preserves_float = False

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Rewrite every LSTM with constant weights (module docstring)."""
        res = PassResult()
        family = ctx.made_for if target_family(ctx.target.cpu) is None else target_family(ctx.target.cpu)
        self._pair_safe = self.config.saturation == "avoid" or (
            self.config.saturation == "auto" and family not in ("x86-vnni", "arm"))
        self._raised = 0
        for scope in graph.scopes():
            for node in scope.nodes:
                if node.op != "LSTM" or not is_default_domain(node.domain):
                    continue
                res.matched += 1
                why = self._rewrite(graph, node)
                if why:
                    res.skip(node.name, why)
                else:
                    res.rewritten += 1
        if res.rewritten:
            graph.import_domain(MS_DOMAIN)
            res.decisions.append(f"{res.rewritten} LSTM(s) run as com.microsoft.DynamicQuantizeLSTM (int8 "
                                 f"{'per-gate-row' if self.config.per_channel else 'per-tensor'} weights, "
                                 "activations quantized at run time by onnxruntime)")
            where = f"the target CPU is {family}" if family else "the recipe declares no CPU with exact kernels"
            res.decisions.append(
                f"saturation: {'avoid' if self._pair_safe else 'off'} ({where}): "
                + (f"{self._raised} weight tensor(s) had gate rows whose u8×s8 pairs could exceed int16 on x86 "
                   "without VNNI, their scales raised for those rows only" if self._pair_safe else
                   "8-bit weights as they are"))
        return res

    def _rewrite(self, graph: GraphHandle, node: gs.Node) -> str | None:
        """Turn ``node`` into DynamicQuantizeLSTM in place; the reason when it cannot."""
        if int(node.attrs.get("layout", 0)) != 0:
            return "layout = 1 (batch-first) is not supported by DynamicQuantizeLSTM"
        w, r = (const_value(node.inputs[i]) if len(node.inputs) > i else None for i in (1, 2))
        if w is None or r is None or w.ndim != 3 or r.ndim != 3:
            return "W and R are not constant 3-D tensors"
        new: list[gs.Tensor] = []
        for label, values in (("W", w), ("R", r)):
            codes, scale, zero = _quantized(np.asarray(values, np.float32), self.config.per_channel, self._pair_safe)
            if self._pair_safe:
                plain = _quantized(np.asarray(values, np.float32), self.config.per_channel)[1]
                self._raised += int(not np.array_equal(plain, scale))
            base = f"{node.name or node.outputs[0].name}/{label}"
            new += [gs.Constant(graph.unique_name(f"{base}_quantized", kind="tensor"), codes),
                    gs.Constant(graph.unique_name(f"{base}_scale", kind="tensor"), scale),
                    gs.Constant(graph.unique_name(f"{base}_zero_point", kind="tensor"), zero)]
        empty = gs.Variable.empty()
        rest: list[Any] = [*node.inputs[3:8], *[empty] * (8 - max(len(node.inputs), 3))]
        inputs = [node.inputs[0], new[0], new[3], *rest[:5], new[1], new[2], new[4], new[5]]
        node.inputs.clear()
        node.inputs.extend(inputs)
        node.op = "DynamicQuantizeLSTM"
        node.domain = MS_DOMAIN
        node.attrs.pop("layout", None)
        return None
