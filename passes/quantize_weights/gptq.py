"""GPTQ (``algorithm: gptq``; Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): quantize input channels one at a time and push each one's error onto the channels
not yet quantized, weighted by the layer's input Hessian.

With ``X`` the layer's calibration inputs (rows) and ``H = 2 XᵀX / n`` (``[K, K]``, one streamed pass), the layer
error ``||X W - X W'||²`` is minimised greedily over input channels ``k`` (rows of ``W [K, N]``):

    H ← H + λ I,  λ = damping · mean(diag H)            (dead channels, H_kk = 0, get H_kk = 1 and W_k = 0)
    U = chol(H⁻¹)ᵀ (upper),                              for k = 0 .. K-1:
        w'_k = Q(w_k)                                    the block's scale/zero point, found at its first channel
        e_k  = (w_k - w'_k) / U_kk
        w_j ← w_j - e_k · U_kj   for j > k               (within a lazy batch of ``gptq_batch`` channels; the
                                                         rest gets ``W_rest -= E · U_batch,rest`` once per batch)

Each block's scale and zero point come from the clip search (`rtn`) on the block's *updated* weights weighted by
``diag H`` when the sweep reaches its first channel. ``act_order`` sweeps the channels by decreasing ``H_kk``
(the ones that matter most first, while the most channels are left to absorb their error); the block parameters
are then fixed beforehand from the float weights ("static groups"), so the stored layout stays block-sequential
and needs no ``g_idx``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from qgraph.quant.blockwise import BlockFormat, BlockQuant, channel_weights, search_clip, to_blocks

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class HessianFactor:
    """``U`` (upper) with ``H_π⁻¹ = UᵀU`` for the damped Hessian in sweep order ``π``, and the dead channels."""

    u: npt.NDArray[np.float32]
    dead: npt.NDArray[np.bool_]
    order: npt.NDArray[np.intp]


def inverse_hessian_factor(h: F64, damping: float, act_order: bool) -> HessianFactor:
    """The factor GPTQ sweeps with (module docstring): channels by decreasing ``H_kk`` with ``act_order``, else in
    order; the permutation is applied to ``H`` before factorising (the factor of a permuted matrix is not the
    permuted factor)."""
    h = np.array(h, np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(h.shape[0])
    h = h[np.ix_(order, order)]
    damp = damping * float(np.mean(np.diag(h)))
    h[np.diag_indices_from(h)] += damp
    for _ in range(6):  # a near-singular H (few samples): more damping until the factorisation exists
        try:
            # H = R Rᵀ with R upper (Cholesky of the reversed matrix, reversed back), so H⁻¹ = UᵀU, U = R⁻¹:
            # one factorisation and one triangular inverse instead of inverting H and factorising H⁻¹
            r = np.linalg.cholesky(h[::-1, ::-1])[::-1, ::-1]
            # the sweep runs in float32 (its precision; half the time of float64)
            u: npt.NDArray[np.float32] = np.linalg.inv(r.astype(np.float32)).astype(np.float32)
            if np.all(np.isfinite(u)):
                return HessianFactor(u, dead, order)
            raise np.linalg.LinAlgError("float32 inverse overflowed")
        except np.linalg.LinAlgError:
            h[np.diag_indices_from(h)] += damp * 10
            damp *= 10
    raise np.linalg.LinAlgError("Hessian not positive definite after damping")


def quantize_gptq(w: npt.NDArray[np.floating], fmt: BlockFormat, factor: HessianFactor, h_diag: F64,
                  ratios: Sequence[float], batch: int) -> BlockQuant:
    """``W [K, N]`` quantized by GPTQ with ``factor = inverse_hessian_factor(H, damping, act_order)`` and
    ``diag H`` (module docstring)."""
    k, n = w.shape
    bs, nb = fmt.block_size, fmt.n_blocks(k)
    u_p, dead, order = factor.u, factor.dead, factor.order
    act_order = bool(np.any(order != np.arange(k)))
    diag = np.asarray(h_diag, np.float32)
    wt = np.zeros((n, nb * bs), np.float32)  # rows = outputs, columns = input channels (zero-padded)
    wt[:, :k] = np.asarray(w, np.float32).T
    wt[:, :k][:, dead] = 0.0
    scale = np.zeros((n, nb), np.float32)
    zero = np.zeros((n, nb), np.float32)
    if act_order:  # static groups: block parameters from the float weights, fixed before the sweep
        blocks = to_blocks(wt[:, :k].T, bs)
        scale, zero = search_clip(blocks, fmt, ratios, channel_weights(diag, k, bs))
    work = wt[:, order]  # channels in sweep order
    codes = np.zeros((n, nb * bs), np.uint8)
    batch = max(bs, -(-batch // bs) * bs)
    for i1 in range(0, k, batch):
        i2 = min(i1 + batch, k)
        w1 = work[:, i1:i2].copy()
        err = np.zeros_like(w1)
        for j in range(i2 - i1):
            ch = int(order[i1 + j])
            blk = ch // bs
            if not act_order and ch % bs == 0:  # first channel of a block: its parameters from updated weights
                end = min(bs, k - ch)
                part = np.zeros((n, 1, bs), np.float32)
                part[:, 0, :end] = w1[:, j:j + end]
                s, z = search_clip(part, fmt, ratios, channel_weights(diag[ch:ch + end], end, bs))
                scale[:, blk], zero[:, blk] = s[:, 0], z[:, 0]
            col = w1[:, j]
            q = np.clip(np.rint(col / scale[:, blk] + zero[:, blk]), 0, fmt.qmax)
            codes[:, ch] = q.astype(np.uint8)
            deq = (q - zero[:, blk]) * scale[:, blk]
            e = (col - deq) / u_p[i1 + j, i1 + j]
            w1[:, j:] -= np.outer(e, u_p[i1 + j, i1 + j:i2])
            err[:, j] = e
        work[:, i2:] -= err @ u_p[i1:i2, i2:]
    pad = np.arange(k, nb * bs)
    if pad.size:  # zero-padded channels: the code that dequantizes to 0 (or nearest)
        pad_blocks = pad // bs
        codes[:, pad] = np.clip(np.rint(zero[:, pad_blocks]), 0, fmt.qmax).astype(np.uint8)
    return BlockQuant(fmt, k, codes.reshape(n, nb, bs), scale, zero)
