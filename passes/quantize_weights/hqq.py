"""HQQ-style data-free scale/zero optimisation (``algorithm: hqq``; Badri & Shaji 2023, "Half-Quadratic
Quantization of Large Machine Learning Models").

Per block, with the codes ``Q(W) = clamp(round(W / s + z), 0, 2^b - 1)`` and ``W' = (Q(W) - z) · s``, HQQ
minimises the sparsity-promoting ``||W - W'||_p^p`` (``p = hqq_lp_norm`` < 1: a few large errors are cheaper than
many small ones) by half-quadratic splitting with an auxiliary error ``W_e``, alternating for ``hqq_iterations``
steps with ``β ← κ · β`` (β₀ = 10, κ = 1.01):

    W_e ← shrink_p(W - W', β),   shrink_p(x, β) = sign(x) · max(|x| - |x|^(p-1) / β, 0)
    z   ← mean_k( Q(W)_k - (W_k - W_e,k) / s )

starting from the block's min/max (``s = (max - min) / (2^b - 1)``, ``z = round(-min / s)``), keeping each block's
best ``z`` by mean ``|W - W'|``. The zero point ends up fractional, which MatMulNBits stores as a float zero point
(as onnxruntime's HQQ does); the ``qdq`` format (integer zero points) rounds it and re-derives the codes.
Symmetric formats have no zero point to optimise, so ``s`` is refit instead: ``s ← Σ w·(q - z) / Σ (q - z)²``
with the codes fixed, then the codes re-derived.

Last, per block, the result is compared with the clip-searched RTN (`rtn`) by squared error and the better one
kept: hqq is never worse than rtn on the weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from qgraph.quant.blockwise import (
    MIN_BLOCK_SCALE,
    BlockFormat,
    BlockQuant,
    block_error,
    block_params,
    quantize_blocks,
    search_clip,
    to_blocks,
)

F32 = npt.NDArray[np.float32]


def _shrink(x: F32, beta: float, p: float) -> F32:
    return np.asarray(np.sign(x) * np.maximum(np.abs(x) - np.power(np.abs(x) + 1e-8, p - 1) / beta, 0.0), np.float32)


def _optimise_zero(blocks: F32, fmt: BlockFormat, iterations: int, p: float) -> tuple[F32, F32]:
    lo, hi = blocks.min(axis=-1), blocks.max(axis=-1)
    scale = np.maximum((hi - lo) / fmt.qmax, MIN_BLOCK_SCALE).astype(np.float32)
    zero = np.round(-lo / scale).astype(np.float32)
    best_z, best_err = zero.copy(), np.full(zero.shape, np.inf, np.float32)
    beta, s3 = 10.0, scale[..., None]
    for _ in range(iterations):
        q = np.clip(np.rint(blocks / s3 + zero[..., None]), 0, fmt.qmax)
        w_r = (q - zero[..., None]) * s3
        err = np.abs(blocks - w_r).mean(axis=-1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_z = np.where(better, zero, best_z)
        w_e = _shrink(blocks - w_r, beta, p)
        zero = np.mean(q - (blocks - w_e) / s3, axis=-1).astype(np.float32)
        beta *= 1.01
    return scale, best_z


def _refit_scale(blocks: F32, fmt: BlockFormat, iterations: int) -> tuple[F32, F32]:
    scale, zero = block_params(blocks, fmt)
    for _ in range(min(iterations, 8)):
        q = np.clip(np.rint(blocks / scale[..., None]) + zero[..., None], 0, fmt.qmax) - zero[..., None]
        den = (q * q).sum(axis=-1)
        fit = np.where(den > 0, (blocks * q).sum(axis=-1) / np.maximum(den, 1e-30), scale)
        scale = np.maximum(fit, MIN_BLOCK_SCALE).astype(np.float32)
    return scale, zero


def quantize_hqq(w: npt.NDArray[np.floating], fmt: BlockFormat, ratios: Sequence[float], iterations: int,
                 p: float, float_zero: bool) -> BlockQuant:
    """``W [K, N]`` block-quantized by HQQ (module docstring); ``float_zero``: keep fractional zero points."""
    k = w.shape[0]
    blocks = to_blocks(w, fmt.block_size)
    if fmt.symmetric:
        scale, zero = _refit_scale(blocks, fmt, iterations)
    else:
        scale, zero = _optimise_zero(blocks, fmt, iterations, p)
        if not float_zero:
            zero = np.clip(np.round(zero), 0, fmt.qmax).astype(np.float32)
    rs, rz = search_clip(blocks, fmt, ratios)
    better = block_error(blocks, rs, rz, fmt.qmax) < block_error(blocks, scale, zero, fmt.qmax)
    scale, zero = np.where(better, rs, scale), np.where(better, rz, zero)
    return BlockQuant(fmt, k, quantize_blocks(blocks, scale, zero, fmt.qmax), scale, zero)
