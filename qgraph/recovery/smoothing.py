"""The INT8 error SmoothQuant's ``alpha: auto`` scores a smoothing choice by (the scales themselves:
`qgraph.recovery.equalize.smoothing_scales`).

For a group ``Y = X · W`` and per-channel scales ``s``: ``||X·W - Q(X / s)·Q(diag(s)·W)||² / ||X·W||²`` on sampled
rows of X, with the activations quantized per tensor (uint8 asymmetric over the exact smoothed range) and the
weights int8 symmetric per output column or per tensor, by `qgraph.quant.math`. `smoothing_errors_stacked`
scores many groups and candidates in one set of numpy calls, with the numbers of one call per candidate.
"""

from __future__ import annotations

import numpy as np

from qgraph.quant.math import QuantDtype, QuantSpec, compute_scale_zero_point, fake_quantize


def smoothing_error(
    x: np.ndarray,
    w: np.ndarray,
    s: np.ndarray,
    x_min: np.ndarray,
    x_max: np.ndarray,
    *,
    per_channel: bool = True,
) -> float:
    """Relative INT8 error ``||X·W - Q(X / s)·Q(diag(s)·W)||² / ||X·W||²`` of one smoothing choice.

    ``x``: sample rows ``[R, K]``; ``w``: ``[K, N]``; ``x_min``/``x_max``: the per-channel observed range of X over
    all calibration data, so the per-tensor activation range after smoothing is exactly
    ``[min_j x_min_j / s_j, max_j x_max_j / s_j]`` (uint8 asymmetric, as the x86 presets quantize activations);
    weights int8 symmetric per output column (``per_channel``) or per tensor. The quantization math is
    `qgraph.quant.math`'s. One group and candidate of `smoothing_errors_stacked`.
    """
    return float(smoothing_errors_stacked(x[None], w[None], np.asarray(s)[None, None, :], np.asarray(x_min)[None],
                                          np.asarray(x_max)[None], per_channel=per_channel)[0, 0])


def smoothing_errors_stacked(
    x: np.ndarray,
    w: np.ndarray,
    scales: np.ndarray,
    x_min: np.ndarray,
    x_max: np.ndarray,
    *,
    per_channel: bool = True,
) -> np.ndarray:
    """`smoothing_error` of ``G`` groups of the same shapes with ``C`` candidates each: ``x [G, R, K]``,
    ``w [G, K, N]``, ``scales [G, C, K]``, ``x_min``/``x_max`` ``[G, K]``; returns ``[G, C]`` float64.

    Why stacked: ``alpha: auto`` scores several αs per group on many groups, and one set of numpy calls over
    ``[G·C, R, K]`` costs little more than one candidate's. Every value is computed with the same elementwise
    operations as a one-candidate call, and each candidate's product and sum run over its own contiguous ``[R, N]``
    block, so the errors are the ones a loop over groups and candidates gives, bit for bit.
    """
    s = np.asarray(scales, dtype=np.float64)
    g, c, k = s.shape
    r, n = x.shape[1], w.shape[2]
    xs = x[:, None, :, :] / s[:, :, None, :]  # [G, C, R, K]
    ws = w[:, None, :, :] * s[:, :, :, None]  # [G, C, K, N]
    a_scale, a_zp = compute_scale_zero_point(np.min(x_min[:, None, :] / s, axis=2).reshape(-1),
                                             np.max(x_max[:, None, :] / s, axis=2).reshape(-1),
                                             QuantSpec(dtype=QuantDtype.UINT8))
    xq = fake_quantize(xs.reshape(g * c, r, k), a_scale, a_zp, QuantDtype.UINT8, axis=0).astype(np.float64)
    w_spec = QuantSpec(dtype=QuantDtype.INT8, symmetric=True, per_channel=per_channel, axis=1 if per_channel else None)
    if per_channel:  # one scale per (group, candidate, column): quantize the columns as rows of [G·C·N, K]
        absmax = np.abs(ws).max(axis=2)  # [G, C, N]
        w_scale, w_zp = compute_scale_zero_point(-absmax, absmax, w_spec)
        cols = np.ascontiguousarray(ws.transpose(0, 1, 3, 2)).reshape(g * c * n, k)
        wq = fake_quantize(cols, w_scale.reshape(-1), w_zp.reshape(-1), QuantDtype.INT8, axis=0)
        wq = np.ascontiguousarray(wq.reshape(g * c, n, k).transpose(0, 2, 1), dtype=np.float64)
    else:
        absmax = np.abs(ws).reshape(g * c, -1).max(axis=1)
        w_scale, w_zp = compute_scale_zero_point(-absmax, absmax, w_spec)
        wq = fake_quantize(ws.reshape(g * c, k, n), w_scale, w_zp, QuantDtype.INT8, axis=0).astype(np.float64)
    ref = x @ w  # [G, R, N]: numpy's matmul makes the same BLAS call per stacked item as for one 2-D product
    signal = np.sum(ref * ref, axis=(1, 2))  # pairwise over each contiguous [R, N] block, as a 2-D np.sum
    diff = ref[:, None, :, :] - (xq @ wq).reshape(g, c, r, n)
    errors = np.sum(diff**2, axis=(2, 3))
    live = signal > 0
    out = np.zeros((g, c))
    out[live] = errors[live] / signal[live, None]
    return out
