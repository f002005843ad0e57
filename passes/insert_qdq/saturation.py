"""u8 x s8 int16 saturation on x86 without VNNI: analysis from the real weights and a numpy kernel simulation.

AVX2 integer GEMM kernels (onnxruntime's MLAS without VNNI, FBGEMM) multiply unsigned 8-bit activations by
signed 8-bit weights with ``VPMADDUBSW``: adjacent products are summed *pairwise into a saturating int16*::

    p[i] = sat16(a[2i] * w[2i] + a[2i+1] * w[2i+1])        then  VPMADDWD(p, 1) -> int32 accumulation

With a in [0, 255] and w in [-128, 127] a pair can reach 255 x 127 x 2 = 64770 > 32767, and the saturated sum
silently corrupts the dot product. With 7-bit weights (``reduce_range``, w in [-64, 63]) the worst pair is
255 x 64 x 2 = 32640, which always fits. VNNI's ``VPDPBUSD`` accumulates the four products in int32 directly.

`analyze` bounds every pair of every output channel of every quantized layer over the activation codes the
calibrated range can produce, ``a in [q(rmin), q(rmax)]``: ``max = sum_j max(lo*w_j, hi*w_j)`` and likewise the
min; a pair can overflow when its bound leaves [-32768, 32767]. Pairs follow the kernel's reduction order: the
K axis of MatMul/Gemm, (kh, kw, c) for Conv (onnxruntime runs u8 convolutions channels-last).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from qgraph.quant import QuantDtype

from .emit import ActParams
from .placement import Plan, label
from .weights import QuantizedWeight

INT16_MIN, INT16_MAX = -32768, 32767


def vpmaddubsw(a: npt.NDArray[np.uint8], w: npt.NDArray[np.int8]) -> npt.NDArray[np.int16]:
    """Pairwise ``sat16(a[2i] w[2i] + a[2i+1] w[2i+1])`` along the last axis (zero-padded to even length)."""
    a32, w32 = _pad_even(a.astype(np.int32)), _pad_even(w.astype(np.int32))
    pairs = a32[..., 0::2] * w32[..., 0::2] + a32[..., 1::2] * w32[..., 1::2]
    out: npt.NDArray[np.int16] = np.clip(pairs, INT16_MIN, INT16_MAX).astype(np.int16)
    return out


def _pad_even(x: npt.NDArray[Any]) -> npt.NDArray[Any]:
    if x.shape[-1] % 2 == 0:
        return x
    pad = [(0, 0)] * (x.ndim - 1) + [(0, 1)]
    return np.pad(x, pad)


def simulate_u8s8_matmul(a: npt.NDArray[np.uint8], w: npt.NDArray[np.int8]) -> npt.NDArray[np.int32]:
    """``a (M, K) @ w (K, N)`` the way VPMADDUBSW + VPMADDWD compute it (int16 pair saturation, int32 sums)."""
    pairs = vpmaddubsw(a[:, None, :], np.ascontiguousarray(w.T)[None, :, :])  # (M, N, K/2) int16
    out: npt.NDArray[np.int32] = pairs.astype(np.int32).sum(axis=-1, dtype=np.int32)
    return out


def exact_u8s8_matmul(a: npt.NDArray[np.uint8], w: npt.NDArray[np.int8]) -> npt.NDArray[np.int32]:
    """The exact int32 product (what VNNI computes)."""
    return a.astype(np.int32) @ w.astype(np.int32)


@dataclass(frozen=True)
class LayerSaturation:
    """Saturation risk of one layer."""

    node: str
    op: str
    weight: str
    activation_codes: tuple[int, int]
    channels: int
    channels_at_risk: int
    pairs: int
    pairs_at_risk: int
    worst_pair_sum: int

    @property
    def at_risk(self) -> bool:
        """Whether any pair can leave the int16 range."""
        return self.pairs_at_risk > 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "node": self.node,
            "op": self.op,
            "weight": self.weight,
            "activation_codes": list(self.activation_codes),
            "channels_at_risk": self.channels_at_risk,
            "channels": self.channels,
            "pairs_at_risk": self.pairs_at_risk,
            "pairs": self.pairs,
            "worst_pair_sum": self.worst_pair_sum,
        }


def kernel_rows(w: QuantizedWeight) -> npt.NDArray[np.int32] | None:
    """The weight as (output channels, K) in the kernel's reduction order, or None if not analyzable."""
    v = np.asarray(w.values).astype(np.int32)
    if w.op == "Conv" and v.ndim >= 3:
        return v.transpose(0, *range(2, v.ndim), 1).reshape(v.shape[0], -1)
    if w.op == "ConvTranspose" and v.ndim >= 3:
        return v.transpose(1, *range(2, v.ndim), 0).reshape(v.shape[1], -1)
    if w.op == "Gemm" and v.ndim == 2:
        return v if w.transposed else v.T
    if w.op == "MatMul" and v.ndim >= 2:
        k, n = v.shape[-2], v.shape[-1]
        return v.reshape(-1, k, n).transpose(0, 2, 1).reshape(-1, k)
    return None


def pair_bounds(rows: npt.NDArray[np.int32], lo: int, hi: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Largest and smallest pair sums per (channel, pair) for activation codes in [lo, hi]."""
    r = _pad_even(rows.astype(np.int64))
    w0, w1 = r[:, 0::2], r[:, 1::2]
    top = np.maximum(lo * w0, hi * w0) + np.maximum(lo * w1, hi * w1)
    bottom = np.minimum(lo * w0, hi * w0) + np.minimum(lo * w1, hi * w1)
    return top, bottom


def analyze_layer(w: QuantizedWeight, codes: tuple[int, int]) -> LayerSaturation | None:
    """Saturation risk of one quantized layer whose activation codes span ``codes``."""
    rows = kernel_rows(w)
    if rows is None or np.asarray(w.values).dtype != np.int8:
        return None
    lo, hi = codes
    top, bottom = pair_bounds(rows, lo, hi)
    risky = (top > INT16_MAX) | (bottom < INT16_MIN)
    tmax = int(top.max()) if top.size else 0
    bmin = int(bottom.min()) if bottom.size else 0
    return LayerSaturation(
        node=w.node,
        op=w.op,
        weight=w.name,
        activation_codes=(int(lo), int(hi)),
        channels=int(rows.shape[0]),
        channels_at_risk=int(risky.any(axis=1).sum()),
        pairs=int(risky.size),
        pairs_at_risk=int(risky.sum()),
        worst_pair_sum=tmax if tmax >= -bmin else bmin,
    )


def activation_codes(rmin: float, rmax: float, scale: float, zero_point: int) -> tuple[int, int]:
    """u8 codes ``[q(rmin), q(rmax)]`` of a calibrated range."""
    lo = int(np.clip(np.rint(rmin / scale) + zero_point, 0, 255))
    hi = int(np.clip(np.rint(rmax / scale) + zero_point, 0, 255))
    return lo, hi


def analyze(weights: list[QuantizedWeight], codes: dict[str, tuple[int, int]]) -> list[LayerSaturation]:
    """Analyze every layer whose node has activation codes; returns all results (``at_risk`` tells)."""
    out = []
    for w in weights:
        c = codes.get(w.node)
        if c is None:
            continue
        res = analyze_layer(w, c)
        if res is not None:
            out.append(res)
    return out


def saturation_details(plan: Plan, params: dict[str, ActParams], weights: list[QuantizedWeight]) -> dict[str, Any]:
    """The report of the u8 x s8 saturation analysis: per weighted unit with u8 activations, its input codes against
    its weights (``WeightQuantizer.weights``)."""
    codes: dict[str, tuple[int, int]] = {}
    for u in plan.units:
        if u.kind != "weighted" or not u.act_inputs:
            continue
        root = plan.tensors.get(u.act_inputs[0])
        p = params.get(root or "")
        if p is None or p.dtype != QuantDtype.UINT8:
            continue
        codes[label(u.node)] = activation_codes(p.rmin, p.rmax, p.scale, p.zero_point)
    results = analyze(weights, codes)
    risky = [r.to_dict() for r in results if r.at_risk]
    return {
        "kernel": "u8 x s8 VPMADDUBSW (AVX2 without VNNI)",
        "layers_analyzed": len(results),
        "layers_at_risk": risky,
        "advice": "set weights.reduce_range: true (7-bit weights) or run on a VNNI CPU" if risky else "",
    }
