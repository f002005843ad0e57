"""The arithmetic of folding inference BatchNormalization into neighbouring linear ops (pure numpy).

Inference BatchNormalization over channel axis 1 is an affine map per channel ``c``::

    BN(x)[:, c] = (x[:, c] - mean[c]) / sqrt(var[c] + eps) * scale[c] + bias[c] = x[:, c] * s[c] + t[c]
    s = scale / sqrt(var + eps)            t = bias - mean * s

Every function computes in float64 and returns arrays in the dtype of the weight it replaces, so a
float32 model gets correctly rounded float32 weights. Shapes follow the ONNX operator definitions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class BNAffine:
    """``BN(x) = x * s + t`` per channel, in float64."""

    s: np.ndarray
    t: np.ndarray

    @classmethod
    def from_params(
        cls, scale: np.ndarray, bias: np.ndarray, mean: np.ndarray, var: np.ndarray, epsilon: float
    ) -> BNAffine:
        """``s = scale / sqrt(var + eps)``, ``t = bias - mean * s``."""
        f = np.float64
        s = scale.astype(f) / np.sqrt(var.astype(f) + f(epsilon))
        return cls(s=s, t=bias.astype(f) - mean.astype(f) * s)

    @property
    def channels(self) -> int:
        """Number of channels C."""
        return int(self.s.shape[0])


def _channel_view(values: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = -1
    return values.reshape(shape)


# ---------------------------------------------------------------------------------------- BN after the op
def conv_then_bn(
    w: np.ndarray, b: np.ndarray | None, bn: BNAffine, *, group: int = 1, transpose: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Conv/ConvTranspose followed by BN → the same op with ``(w', b')``.

    Conv (w: ``[M, C/g, k...]``): ``w'[m] = w[m] * s[m]``, ``b' = (b - mean) * s + bias = b * s + t``.
    ConvTranspose (w: ``[C, M/g, k...]``, output channel ``m = g_i * M/g + j`` comes from
    ``w[g_i * C/g : (g_i+1) * C/g, j]``): the same per output channel, on that layout.
    """
    wf = w.astype(np.float64)
    if transpose:
        c_in, m_per_group = w.shape[0], w.shape[1]
        grouped = wf.reshape(group, c_in // group, m_per_group, *w.shape[2:])
        factor = bn.s.reshape(group, 1, m_per_group, *([1] * (w.ndim - 2)))
        w_new = (grouped * factor).reshape(w.shape)
    else:
        w_new = wf * _channel_view(bn.s, 0, w.ndim)
    b_new = bn.t if b is None else b.astype(np.float64) * bn.s + bn.t
    return w_new.astype(w.dtype), b_new.astype(w.dtype)


def gemm_then_bn(
    b_mat: np.ndarray, c: np.ndarray | None, bn: BNAffine, *, beta: float, trans_b: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Gemm ``alpha * A @ op(B) + beta * C`` followed by BN over its M columns → ``(B', C')`` with beta = 1.

    ``op(B)' = op(B) * s[None, :]`` (rows of B scaled when ``transB``), ``C' = beta * C * s + t``.
    """
    bf = b_mat.astype(np.float64)
    b_new = bf * bn.s[:, None] if trans_b else bf * bn.s[None, :]
    c_new = bn.t if c is None else np.float64(beta) * c.astype(np.float64) * bn.s + bn.t
    return b_new.astype(b_mat.dtype), c_new.astype(b_mat.dtype)


def matmul_then_bn(w: np.ndarray, bias: np.ndarray | None, bn: BNAffine) -> tuple[np.ndarray, np.ndarray]:
    """``X @ W (+ bias)`` (W: ``[K, M]``, X 2-D) followed by BN → ``X @ W' + bias'``.

    ``W' = W * s[None, :]``, ``bias' = bias * s + t`` (``t`` alone when there was no bias).
    """
    w_new = w.astype(np.float64) * bn.s[None, :]
    b_new = bn.t if bias is None else bias.astype(np.float64).reshape(-1) * bn.s + bn.t
    return w_new.astype(w.dtype), b_new.astype(w.dtype)


# --------------------------------------------------------------------------------------- BN before the op
def bn_then_conv(w: np.ndarray, b: np.ndarray | None, bn: BNAffine, *, group: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """BN followed by an unpadded Conv (w: ``[M, C/g, k...]``) → the Conv with ``(w', b')``.

    With ``S[m, c] = s[g(m) * C/g + c]`` (the input channel weight ``w[m, c]`` reads), and T likewise:
    ``w'[m, c, k] = w[m, c, k] * S[m, c]``, ``b'[m] = b[m] + sum_{c,k} w[m, c, k] * T[m, c]``.
    Exact only without zero padding (padding would pad BN(x) with 0, i.e. x with ``-t/s``).
    """
    m_out, c_per_group = w.shape[0], w.shape[1]
    groups_of_m = np.arange(m_out) // (m_out // group)
    s_in = bn.s.reshape(group, c_per_group)[groups_of_m]  # [M, C/g]
    t_in = bn.t.reshape(group, c_per_group)[groups_of_m]
    wf = w.astype(np.float64)
    spatial = (1,) * (w.ndim - 2)
    w_new = wf * s_in.reshape(m_out, c_per_group, *spatial)
    shift = (wf * t_in.reshape(m_out, c_per_group, *spatial)).reshape(m_out, -1).sum(axis=1)
    b_new = shift if b is None else b.astype(np.float64) + shift
    return w_new.astype(w.dtype), b_new.astype(w.dtype)


def bn_then_gemm(
    b_mat: np.ndarray, c: np.ndarray | None, bn: BNAffine, *, alpha: float, beta: float, trans_b: bool
) -> tuple[np.ndarray, np.ndarray]:
    """BN over the K columns of A followed by Gemm (transA = 0) → ``(B', C')`` with beta = 1.

    ``op(B)' = s[:, None] * op(B)``, ``C' = beta * C + alpha * t @ op(B)``.
    """
    bf = b_mat.astype(np.float64)
    op_b = bf.T if trans_b else bf
    b_new = bf * bn.s[None, :] if trans_b else bf * bn.s[:, None]
    shift = np.float64(alpha) * (bn.t @ op_b)
    c_new = shift if c is None else np.float64(beta) * c.astype(np.float64) + shift
    return b_new.astype(b_mat.dtype), c_new.astype(b_mat.dtype)


# ---------------------------------------------------------------------------------------------- standalone
def scale_shift(bn: BNAffine, rank: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(s, t)`` shaped ``[C, 1, ..., 1]`` (rank - 1 dims) for ``Add(Mul(x, s), t)`` on a rank-``rank`` x."""
    shape = (bn.channels,) + (1,) * (rank - 2)
    return bn.s.reshape(shape).astype(dtype), bn.t.reshape(shape).astype(dtype)
