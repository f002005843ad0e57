"""Weight and bias arithmetic, one layer at a time or stacked over layers of the same shape.

Both paths compute exactly the same numbers (`qgraph.quant.math` elementwise formulas on float32 scales); the
stacked path only removes the per-call numpy overhead, which dominates on graphs with thousands of small
layers (a 100k-node MLP chain has 33k of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from qgraph.quant.math import QuantSpec, compute_scale_zero_point, quantize, quantize_bias


@dataclass
class WeightMath:
    """A layer's integer weight, its scale/zero point and (optionally) its int32 bias with scale."""

    qw: npt.NDArray[Any]
    scale: npt.NDArray[np.float32]  # () per tensor, (C,) per channel
    zero_point: npt.NDArray[Any]
    bias_q: npt.NDArray[np.int32] | None = None  # flat (N,)
    bias_scale: npt.NDArray[np.float32] | None = None  # flat (N,)
    adjusted: bool = False


def _ranges(w: npt.NDArray[np.float32], axis: int | None, lead: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """Min/max over everything but the ``lead`` leading axes and the channel axis (shifted by ``lead``)."""
    keep = set(range(lead)) | ({axis % (w.ndim - lead) + lead} if axis is not None else set())
    axes = tuple(i for i in range(w.ndim) if i not in keep)
    return w.min(axis=axes), w.max(axis=axes)


def lopsided(w: npt.NDArray[np.float32], axis: int | None, gain: float) -> bool:
    """Whether a zero point would make ``w``'s codes at least ``gain`` times finer on average over channels:
    symmetric step ``max|w| / 127.5`` vs asymmetric ``(max - min) / 255``, i.e. ratio ``2 max|w| / (max - min)``."""
    if not w.size:
        return False
    lo, hi = _ranges(w, axis, 0)
    lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    span = np.maximum(hi - lo, 1e-30)
    ratio = 2.0 * np.maximum(-lo, hi) / span
    return bool(np.mean(ratio) >= gain)


def layer_math(
    w: npt.NDArray[np.float32],
    spec: QuantSpec,
    bias: npt.NDArray[np.float32] | None,
    input_scale: float | None,
    scale: npt.NDArray[np.float32] | None = None,
) -> WeightMath:
    """One layer: per-channel (``spec.axis``) or per-tensor weight, int32 bias with ``input_scale x w_scale``;
    ``scale`` replaces the weight scale the range gives (a symmetric spec: the zero point does not depend on it)."""
    axis = spec.axis if spec.per_channel else None
    lo, hi = _ranges(w, axis, 0) if w.size else (np.zeros(()), np.zeros(()))
    ranged, zp = compute_scale_zero_point(lo, hi, spec)
    scale = ranged if scale is None else np.asarray(scale, np.float32).reshape(ranged.shape)
    out = WeightMath(np.empty(0), scale, zp)
    if bias is not None and input_scale is not None:
        n = bias.size
        wscale = np.broadcast_to(scale, (n,)) if scale.ndim == 0 else scale
        qb = quantize_bias(bias.reshape(-1), input_scale, wscale)
        if np.any(qb.adjusted):
            out.adjusted = True
            scale = qb.weight_scale if scale.ndim else np.asarray(qb.weight_scale.max(), np.float32)
            if scale.ndim == 0:  # per tensor: one scale for every channel, recompute the bias with it
                qb = quantize_bias(bias.reshape(-1), input_scale, np.full((n,), scale, np.float32))
            out.scale = scale
        out.bias_q, out.bias_scale = qb.values, qb.scale
    out.qw = quantize(w, out.scale, zp, spec.dtype, axis if out.scale.ndim else None)
    return out


def stacked_math(
    ws: list[npt.NDArray[np.float32]],
    spec: QuantSpec,
    biases: list[npt.NDArray[np.float32]] | None,
    input_scales: list[float] | None,
) -> list[WeightMath | None]:
    """`layer_math` for layers of one shape at once; None where a bias forces a weight-scale adjustment (the
    caller then uses `layer_math` for that layer)."""
    axis = spec.axis if spec.per_channel else None
    stack = np.stack(ws)
    g = stack.shape[0]
    lo, hi = _ranges(stack, axis, 1)
    scale, zp = compute_scale_zero_point(lo, hi, spec)  # (G,) or (G, C)
    ok: npt.NDArray[np.bool_] = np.ones(g, dtype=bool)
    bias_q = bias_scale = None
    if biases is not None and input_scales is not None:
        b = np.stack([x.reshape(-1) for x in biases])  # (G, N)
        n = b.shape[1]
        per = np.broadcast_to(scale.reshape(g, -1), (g, n)).astype(np.float32)
        s_in = np.asarray(input_scales, np.float32).reshape(g, 1)
        combined = (per * s_in).astype(np.float32)  # == float32(input_scale * weight_scale), as layer_math
        qb = quantize_bias(b.reshape(-1), np.float32(1.0), combined.reshape(-1))
        ok = np.asarray(~qb.adjusted.reshape(g, n).any(axis=1), dtype=bool)
        bias_q, bias_scale = qb.values.reshape(g, n), qb.scale.reshape(g, n)
    moved = np.moveaxis(stack, axis % ws[0].ndim + 1, 1) if axis is not None else stack
    flat = moved.reshape(g * (scale.shape[1] if scale.ndim > 1 else 1), -1)
    q = quantize(flat, scale.reshape(-1), zp.reshape(-1), spec.dtype, 0).reshape(moved.shape)
    qw = np.moveaxis(q, 1, axis % ws[0].ndim + 1) if axis is not None else q
    out: list[WeightMath | None] = []
    for i in range(g):
        if not ok[i]:
            out.append(None)
            continue
        m = WeightMath(np.ascontiguousarray(qw[i]), scale[i], zp[i])
        if bias_q is not None and bias_scale is not None:
            m.bias_q, m.bias_scale = bias_q[i], bias_scale[i]
        out.append(m)
    return out
