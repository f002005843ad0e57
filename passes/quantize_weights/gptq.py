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

import numpy as np
import numpy.typing as npt

from qgraph.blockwise import BlockFormat, BlockQuant, channel_weights, search_clip, to_blocks

F64 = npt.NDArray[np.float64]


def inverse_hessian_factor(h: F64, damping: float) -> tuple[F64, npt.NDArray[np.bool_]]:
    """``U`` (upper) with ``H⁻¹ = UᵀU`` after damping, and the dead channels (``H_kk = 0``)."""
    h = np.array(h, np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    damp = damping * float(np.mean(np.diag(h)))
    h[np.diag_indices_from(h)] += damp
    for _ in range(6):  # a near-singular H (few samples): more damping until the factorisation exists
        try:
            low = np.linalg.cholesky(h)
            inv = np.linalg.inv(low)
            return np.linalg.cholesky(inv.T @ inv).T, dead
        except np.linalg.LinAlgError:
            h[np.diag_indices_from(h)] += damp * 10
            damp *= 10
    raise np.linalg.LinAlgError("Hessian not positive definite after damping")


def quantize_gptq(w: npt.NDArray[np.floating], fmt: BlockFormat, h: F64, ratios: Sequence[float], damping: float,
                  batch: int, act_order: bool) -> BlockQuant:
    """``W [K, N]`` quantized by GPTQ against the Hessian ``h [K, K]`` (module docstring)."""
    k, n = w.shape
    bs, nb = fmt.block_size, fmt.n_blocks(k)
    u, dead = inverse_hessian_factor(h, damping)
    diag = np.diag(h).astype(np.float32)
    wt = np.zeros((n, nb * bs), np.float64)  # rows = outputs, columns = input channels (zero-padded)
    wt[:, :k] = np.asarray(w, np.float64).T
    wt[:, :k][:, dead] = 0.0
    scale = np.zeros((n, nb), np.float32)
    zero = np.zeros((n, nb), np.float32)
    if act_order:
        blocks = to_blocks(wt[:, :k].T, bs)
        scale, zero = search_clip(blocks, fmt, ratios, channel_weights(diag, k, bs))
        order = np.argsort(-diag, kind="stable")
    else:
        order = np.arange(k)
    u_p = u[np.ix_(order, order)]
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
