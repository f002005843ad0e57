"""``saturation: avoid``: weight scales raised just where a u8 x s8 pair could leave int16 (x86 AVX2 without VNNI).

A pair of adjacent products ``a[2i] w[2i] + a[2i+1] w[2i+1]`` (`qgraph.runtime.kernels.pairs`) can only overflow
when both activation codes are large. With ``saturation_codes: calibrated`` each pair is bounded by the raw codes
its two input channels took on the calibration data (each channel's observed ``[min, max]``, measured in the
calibration pass, and the zero point a padded position reads); with ``any`` by every code ``[0, 255]``. Input
channels rarely all reach the tensor's top code: on YOLOv8n 4,238 of 5,447 output channels are at risk for any codes
and 484 for the calibrated ones, so 4 in 5 of the raised scales (up to 6 dB of weight resolution each) were spent on
pairs the data never fills. Codes beyond the calibrated ones on other inputs can still saturate a pair; `qgraph check`
counts, per layer, the pair sums that did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_graphsurgeon as gs

from qgraph.quant.math import QuantSpec, dtype_range
from qgraph.runtime.kernels.pairs import RAW_CODES, kernel_rows, pair_safe_scales, risky_pairs

from .units import Unit, label

#: Per input channel of a layer: the lowest and highest raw activation code (int64 arrays of the channel count).
ChannelCodes = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]
#: Raw codes in the kernel's reduction order, broadcastable to the weight's ``(rows, K)``: lows, highs.
KernelCodes = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]


@dataclass
class PairSafeLayer:
    """A layer whose weight scales were raised on the channels where a u8 x s8 pair could leave int16."""

    node: str
    scale: npt.NDArray[np.float32]
    channels: int
    of: int
    pairs_at_risk: int
    max_factor: float
    #: Weight SQNR (dB) with the range's scales and with the raised ones.
    sqnr_before: float
    sqnr_after: float
    #: What bounded the activation codes: ``calibrated`` (each input channel's codes on the data) or ``any``.
    bound: str = "any"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"node": self.node, "channels": self.channels, "of": self.of, "pairs_at_risk": self.pairs_at_risk,
                "max_factor": self.max_factor, "weight_sqnr_db": self.sqnr_before,
                "weight_sqnr_pair_safe_db": self.sqnr_after, "codes": self.bound}


def _weight_sqnr(w: npt.NDArray[np.float32], rows_q: npt.NDArray[Any], scale: npt.NDArray[Any]) -> float:
    """SQNR (dB) of a symmetric per-row quantization of ``w`` (as rows) with codes ``rows_q``."""
    err = float(np.sum((w - rows_q * scale.reshape(-1, 1)) ** 2))
    return 10.0 * float(np.log10(float(np.sum(w.astype(np.float64) ** 2)) / err)) if err > 0 else float("inf")


def kernel_codes(node: gs.Node, w_shape: tuple[int, ...], codes: ChannelCodes) -> KernelCodes | None:
    """Per-input-channel ``codes`` laid out as the kernel reads them (`kernel_rows`): a Conv row is its group's
    ``(kh, kw, c)`` with channels fastest, a MatMul/Gemm row is K (the input's last axis). None where the layout
    is another (a Gemm with transA, a channel count that does not match)."""
    lo, hi = (np.asarray(c, np.int64) for c in codes)
    if node.op == "Conv":
        out, per_group = w_shape[0], w_shape[1]
        groups = int(node.attrs.get("group", 1))
        if lo.size != per_group * groups or out % groups:
            return None
        taps = int(np.prod(w_shape[2:]))

        def rows(c: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
            per = np.tile(c.reshape(groups, per_group), (1, taps))  # (groups, K): channels fastest, as the rows
            return per[0] if groups == 1 else np.repeat(per, out // groups, axis=0)

        return rows(lo), rows(hi)
    transposed_a = node.op == "Gemm" and bool(int(node.attrs.get("transA", 0)))
    k = w_shape[-1] if node.op == "Gemm" and bool(int(node.attrs.get("transB", 0))) else w_shape[-2]
    if node.op not in ("MatMul", "Gemm") or transposed_a or lo.size != k:
        return None
    return lo, hi


def pair_safe_layer(node: gs.Node, w: npt.NDArray[np.float32], qw: npt.NDArray[Any], scale: npt.NDArray[np.float32],
                    spec: QuantSpec, codes: ChannelCodes | None = None) -> PairSafeLayer | None:
    """New scales for a symmetric s8 layer whose weight pairs could overflow an AVX2 u8 x s8 kernel's int16
    (`qgraph.runtime.kernels.pairs.pair_safe_scales`), or None when no pair can (or the kernel has no pairs:
    depthwise). ``codes``: the raw codes each input channel takes (module docstring); None: any code."""
    transposed = node.op == "Gemm" and bool(int(node.attrs.get("transB", 0)))
    if node.op not in ("Conv", "MatMul", "Gemm") or (node.op == "MatMul" and w.ndim != 2):
        return None
    if node.op == "Conv" and w.shape[1] == 1 and int(node.attrs.get("group", 1)) == w.shape[0]:
        return None  # depthwise: onnxruntime's depthwise kernel widens to int16 first
    rows_q = kernel_rows(qw, node.op, transposed)
    rows_w = kernel_rows(w, node.op, transposed)
    if rows_q is None or rows_w is None:
        return None
    bounds = kernel_codes(node, w.shape, codes) if codes is not None else None
    lo, hi = bounds if bounds is not None else (np.int64(RAW_CODES[0]), np.int64(RAW_CODES[1]))
    risky = risky_pairs(rows_q.astype(np.int32), lo, hi)
    if not risky.count:
        return None
    per_row = np.broadcast_to(scale, (rows_w.shape[0],)) if scale.ndim == 0 else scale
    qmin, qmax = dtype_range(spec.dtype, spec.narrow_range, spec.reduce_range)
    raised = pair_safe_scales(rows_w, per_row, qmin, qmax, lo, hi)
    if scale.ndim == 0:
        raised = np.full_like(raised, raised.max())
    factor = raised / per_row
    after = np.clip(np.rint(rows_w / raised.reshape(-1, 1)), qmin, qmax)
    return PairSafeLayer(label(node), np.asarray(raised.max(), np.float32) if scale.ndim == 0 else raised,
                         int((factor > 1).sum()), int(factor.size), risky.count, float(factor.max()),
                         _weight_sqnr(rows_w, rows_q, per_row), _weight_sqnr(rows_w, after, raised),
                         "any" if bounds is None else "calibrated")


def pair_axes(units: list[Unit]) -> dict[str, int]:
    """The inputs of the layers a u8 x s8 kernel runs with pairs, and the axis their channels lie on (the K that
    `kernel_codes` lays out): a Conv's (not depthwise) axis 1, a MatMul's or Gemm's (not transA) last axis."""
    axes: dict[str, int] = {}
    for u in units:
        node = u.node
        if u.kind != "weighted" or not u.act_inputs or u.weight_index is None:
            continue
        if node.op == "Conv":
            w = node.inputs[u.weight_index]
            depthwise = len(w.shape or ()) > 1 and w.shape[1] == 1 and int(node.attrs.get("group", 1)) > 1
            if not depthwise:
                axes.setdefault(u.act_inputs[0], 1)
        elif node.op == "MatMul" or (node.op == "Gemm" and not int(node.attrs.get("transA", 0))):
            axes.setdefault(u.act_inputs[0], -1)
    return axes
