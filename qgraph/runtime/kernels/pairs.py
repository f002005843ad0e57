"""u8 x s8 pair sums on x86 without VNNI: the arithmetic, and which weight pairs can leave int16.

onnxruntime's integer GEMM and convolution kernels on AVX2 (MLAS without VNNI) multiply unsigned 8-bit activation
codes by signed 8-bit weight codes with ``VPMADDUBSW``, which adds two adjacent products into a *saturating int16*::

    p[i] = sat16(a[2i] * w[2i] + a[2i+1] * w[2i+1])        then  VPMADDWD(p, 1) -> int32 accumulation

With ``a`` in [0, 255] and ``w`` in [-128, 127] a pair can reach 255 x 127 x 2 = 64770 > 32767. VNNI's
``VPDPBUSD`` (and ARM's dot products) accumulate in int32 with no int16 step: exact.

Measured against onnxruntime 1.32's AVX2 kernels (an AVX2-only CPU emulated by qemu-user; `tests/kernels`), the
kernels compute on the *raw* codes, so these rules are exact:

- pairs are adjacent elements of the reduction axis K: MatMul/Gemm's inner dimension; for Conv the kernel's
  ``(kh, kw, c)`` order within a group (onnxruntime runs u8 convolutions channels-last), padded with a zero to even
  length (a lone product cannot saturate);
- the weight zero point is not subtracted first: a raw code ``w`` is multiplied (asymmetric weights saturate more);
- s8 activations are shifted to u8 (``a + 128``) before the product (onnxruntime's QDQ s8->u8 conversion);
- padded convolution positions read the activation zero point;
- depthwise convolutions (one input and one output channel per group) use a kernel without pairs: exact;
- u8 x u8 (unsigned weights) widens to int16 first: exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from qgraph.quant.math import QuantDtype, dtype_range

INT16_MIN, INT16_MAX = dtype_range(QuantDtype.INT16)
#: The raw activation codes the AVX2 kernels multiply (u8, or s8 shifted by 128).
RAW_CODES = dtype_range(QuantDtype.UINT8)


def pad_even(x: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``x`` with a zero appended on the last axis when its length is odd (the kernels pack K to even)."""
    if x.shape[-1] % 2 == 0:
        return x
    pad = [(0, 0)] * (x.ndim - 1) + [(0, 1)]
    return np.pad(x, pad)


def vpmaddubsw(a: npt.NDArray[Any], w: npt.NDArray[Any]) -> npt.NDArray[np.int16]:
    """Pairwise ``sat16(a[2i] w[2i] + a[2i+1] w[2i+1])`` along the last axis (zero-padded to even length)."""
    a32, w32 = pad_even(np.asarray(a).astype(np.int32)), pad_even(np.asarray(w).astype(np.int32))
    pairs = a32[..., 0::2] * w32[..., 0::2] + a32[..., 1::2] * w32[..., 1::2]
    out: npt.NDArray[np.int16] = np.clip(pairs, INT16_MIN, INT16_MAX).astype(np.int16)
    return out


def simulate_u8s8_matmul(a: npt.NDArray[np.uint8], w: npt.NDArray[np.int8]) -> npt.NDArray[np.int32]:
    """``a (M, K) @ w (K, N)`` the way VPMADDUBSW + VPMADDWD compute it (int16 pair saturation, int32 sums)."""
    pairs = vpmaddubsw(a[:, None, :], np.ascontiguousarray(w.T)[None, :, :])  # (M, N, K/2) int16
    out: npt.NDArray[np.int32] = pairs.astype(np.int32).sum(axis=-1, dtype=np.int32)
    return out


def exact_u8s8_matmul(a: npt.NDArray[np.uint8], w: npt.NDArray[np.int8]) -> npt.NDArray[np.int32]:
    """The exact int32 product (what VNNI computes)."""
    out: npt.NDArray[np.int32] = a.astype(np.int32) @ w.astype(np.int32)
    return out


def kernel_rows(values: npt.ArrayLike, op: str, transposed: bool = False) -> npt.NDArray[Any] | None:
    """A weight as (output channels, K) in the kernel's reduction order (its dtype kept), or None when it cannot
    be read so.

    Conv ``(O, C/g, kh, kw)`` -> ``(O, kh·kw·C/g)`` (channels fastest; each row holds its own group's K);
    ConvTranspose ``(C, O/g, kh, kw)`` likewise on its output channels; Gemm ``(K, N)`` (``(N, K)`` with
    ``transposed``: transB); MatMul ``(..., K, N)`` -> ``(prod(...)·N, K)``."""
    v = np.asarray(values)
    if op == "Conv" and v.ndim >= 3:
        return v.transpose(0, *range(2, v.ndim), 1).reshape(v.shape[0], -1)
    if op == "ConvTranspose" and v.ndim >= 3:
        return v.transpose(1, *range(2, v.ndim), 0).reshape(v.shape[1], -1)
    if op == "Gemm" and v.ndim == 2:
        return v if transposed else v.T
    if op == "MatMul" and v.ndim >= 2:
        k, n = v.shape[-2], v.shape[-1]
        return v.reshape(-1, k, n).transpose(0, 2, 1).reshape(-1, k)
    return None


#: Activation codes a pair is bounded with: one for every K position, or per position (``(K,)`` or ``(rows, K)``).
Codes = int | np.integer[Any] | npt.NDArray[Any]


def _halves(codes: Codes) -> tuple[Any, Any]:
    """The codes of each pair's first and second element (a scalar serves both)."""
    c = np.asarray(codes, np.int64)
    if c.ndim == 0:
        return c, c
    c = pad_even(c)
    return c[..., 0::2], c[..., 1::2]


def pair_bounds(rows: npt.NDArray[Any], lo: Codes, hi: Codes) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Largest and smallest pair sums per (channel, pair) for activation codes in [lo, hi] (scalars, or per K
    position)."""
    r = pad_even(np.asarray(rows).astype(np.int64))
    w0, w1 = r[:, 0::2], r[:, 1::2]
    (lo0, lo1), (hi0, hi1) = _halves(lo), _halves(hi)
    top = np.maximum(lo0 * w0, hi0 * w0) + np.maximum(lo1 * w1, hi1 * w1)
    bottom = np.minimum(lo0 * w0, hi0 * w0) + np.minimum(lo1 * w1, hi1 * w1)
    return top, bottom


@dataclass(frozen=True)
class RiskyPairs:
    """The (channel, pair) positions of a weight whose pair sum can leave int16, sorted by channel."""

    #: Output channel of each risky pair, ascending.
    channel: npt.NDArray[np.int64]
    #: Index of the pair's first element on K (the second is ``first + 1``).
    first: npt.NDArray[np.int64]
    #: The two raw weight codes of each pair.
    w0: npt.NDArray[np.int64]
    w1: npt.NDArray[np.int64]
    #: Pairs per channel row (``ceil(K / 2)``) and channels: ``pairs * channels`` pair sums per output position.
    pairs: int
    channels: int
    #: The largest-magnitude pair sum the codes can reach (signed), 0 when nothing is at risk.
    worst: int

    @property
    def count(self) -> int:
        """How many pairs can saturate."""
        return int(self.channel.size)

    @property
    def channels_at_risk(self) -> int:
        """Output channels with at least one such pair."""
        return int(np.unique(self.channel).size)


def risky_pairs(rows: npt.NDArray[Any], lo: Codes = RAW_CODES[0], hi: Codes = RAW_CODES[1]) -> RiskyPairs:
    """Every pair of ``rows`` (output channels x K, `kernel_rows`) whose sum can leave [-32768, 32767] for
    activation codes in ``[lo, hi]`` (scalars, or per K position; row-major: sorted by channel, then by position
    on K)."""
    top, bottom = pair_bounds(rows, lo, hi)
    risky = (top > INT16_MAX) | (bottom < INT16_MIN)
    channel, pair = np.nonzero(risky)
    r = pad_even(np.asarray(rows).astype(np.int64))
    worst_top = int(top.max()) if top.size else 0
    worst_bottom = int(bottom.min()) if bottom.size else 0
    worst = (worst_top if worst_top >= -worst_bottom else worst_bottom) if channel.size else 0
    return RiskyPairs(channel.astype(np.int64), (2 * pair).astype(np.int64), r[channel, 2 * pair],
                      r[channel, 2 * pair + 1], int(top.shape[1]) if top.ndim == 2 else 0, int(r.shape[0]), worst)


def pair_safe_scales(rows: npt.NDArray[Any], scale: npt.NDArray[Any], qmin: int, qmax: int,
                     lo: Codes = RAW_CODES[0], hi: Codes = RAW_CODES[1],
                     max_rounds: int = 32) -> npt.NDArray[np.float32]:
    """Per-channel symmetric weight scales (``rows``: float weights, output channels x K in the kernel's order;
    ``scale``: their scales, one per row) raised just enough on the channels where a pair of codes could leave
    int16 for activation codes in [lo, hi] (scalars, or per K position): ``|q0 + q1| <= 128`` for same-sign pairs
    of u8 codes up to 255. A channel without such a pair keeps its scale; one that has them loses
    ``20 log10(factor)`` dB of resolution, at most 6 dB (``reduce_range`` costs every channel 6 dB)."""
    s = np.asarray(scale, np.float64).reshape(-1).copy()
    w = np.asarray(rows, np.float64)
    for _ in range(max_rounds):
        q = np.clip(np.rint(w / s[:, None]), qmin, qmax)
        top, bottom = pair_bounds(q, lo, hi)
        over = np.maximum(top.max(axis=1, initial=0) / INT16_MAX, bottom.min(axis=1, initial=0) / INT16_MIN)
        bad = over > 1.0
        if not bad.any():
            break
        # codes shrink in proportion to 1/s; the margin covers the rounding of the codes that decide the bound
        s[bad] *= np.maximum(over[bad], 1.0 + 1.0 / 256)
    return s.astype(np.float32)
