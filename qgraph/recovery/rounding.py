"""Adaptive rounding of quantized weights: choose floor or ceil per weight to minimise a layer's output error.

The problem is AdaRound's (Nagel et al. 2020, "Up or Down? Adaptive Rounding for Post-Training Quantization"):
for a layer ``y = W x`` with weight rows ``w_r`` (one per output channel, ``K`` inputs each), scales ``s`` and zero
points ``z`` fixed, pick integer codes ``q_r`` with ``floor(w/s + z) <= q <= ceil(w/s + z)`` (clipped to the
integer range) minimising the expected output error over the layer's inputs ``x``::

    L_r(q) = E[(w_r·x - ŵ_r·x)²] = e_r^T H e_r,   e_r = w_r - s_r (q_r - z_r),   H = E[x x^T]

Rows are independent given ``H`` (one ``H`` per convolution group). With the bias free to absorb the mean error
(``b_r += e_r·μ``, ``μ = E[x]``), the residual error is ``e_r^T (H - μμ^T) e_r``: pass the covariance instead.

**Solver: greedy coordinate descent on the exact objective** (not AdaRound's rectified-sigmoid relaxation).
Flipping weight ``j`` of row ``r`` to its other rounding moves ``ŵ_rj`` by ``δ = s_rj (q'_rj - q_rj)`` and changes
the objective by exactly ``Δ_rj = -2 δ (H e_r)_j + δ² H_jj``. Each step applies, in every row that still improves,
the flip with the most negative ``Δ`` and updates ``g_r = H e_r`` in O(K). Why this and not the relaxation: it
optimises the true objective (no temperature, regulariser annealing or learning rate to tune), decreases it
monotonically (so the result is never worse than the starting, nearest rounding, and stopping at a time budget
leaves a valid, improved layer), is deterministic, and costs O(K²) per row for ``H e`` plus O(K) per flip in
numpy. Like AdaRound it stays within floor/ceil; it finds a local optimum of the same objective AdaRound's
relaxation approximates (GPTQ/OBQ-style solvers share the quadratic form).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float64]


@dataclass
class RoundingResult:
    """Codes chosen by `optimize_rounding`, with the objective per row before and after."""

    codes: npt.NDArray[np.int64]
    before: Array  # (R,) e^T H e with the starting codes
    after: Array  # (R,) with the chosen codes (<= before, row by row)
    flips: int  # weights whose code changed
    steps: int  # descent steps taken
    complete: bool  # False when stopped by max_steps or the deadline (codes still valid and no worse)


def _times_h(err: Array, h: Array, group: npt.NDArray[np.intp]) -> Array:
    """``H_{group[r]} e_r`` for every row (one matrix product when there is one group)."""
    if h.shape[0] == 1:
        out: Array = err @ h[0]
        return out
    out_g: Array = np.einsum("rk,rkl->rl", err, h[group], optimize=False)
    return out_g


def rounding_objective(
    weight: npt.ArrayLike, scale: npt.ArrayLike, zero_point: npt.ArrayLike, codes: npt.ArrayLike,
    h: npt.ArrayLike, group: npt.ArrayLike | None = None,
) -> Array:
    """``e_r^T H e_r`` per row, ``e = w - s (q - z)`` (all ``(R, K)`` or broadcastable; ``h`` is ``(G, K, K)`` or
    ``(K, K)``, ``group[r]`` the matrix of row ``r``)."""
    w = np.asarray(weight, np.float64)
    err = w - np.broadcast_to(np.asarray(scale, np.float64), w.shape) * (
        np.asarray(codes, np.float64) - np.asarray(zero_point, np.float64))
    hh = np.asarray(h, np.float64)
    hh = hh[None] if hh.ndim == 2 else hh
    gid = np.zeros(w.shape[0], np.intp) if group is None else np.asarray(group, np.intp)
    out: Array = np.sum(err * _times_h(err, hh, gid), axis=1)
    return out


def optimize_rounding(
    weight: npt.ArrayLike,
    scale: npt.ArrayLike,
    zero_point: npt.ArrayLike,
    codes: npt.ArrayLike,
    h: npt.ArrayLike,
    qmin: int,
    qmax: int,
    *,
    group: npt.ArrayLike | None = None,
    max_steps: int | None = None,
    deadline: float | None = None,
) -> RoundingResult:
    """Greedy coordinate descent of ``e_r^T H e_r`` over floor/ceil codes (module docstring).

    ``weight`` is the float weight as rows ``(R, K)``; ``scale``/``zero_point`` broadcast to it; ``codes`` are the
    starting integer codes (nearest rounding); ``h`` is ``(K, K)`` or ``(G, K, K)`` (symmetric PSD, e.g. ``X^T X /
    n``); ``group[r]`` selects row ``r``'s matrix. Each code ends at ``floor`` or ``ceil`` of ``w/s + z`` clipped to
    ``[qmin, qmax]`` (a starting code elsewhere may stay where it is). ``max_steps`` (default ``4 K``) and
    ``deadline`` (a `time.perf_counter` value) stop early with valid codes no worse than the start.
    """
    w = np.asarray(weight, np.float64)
    s = np.broadcast_to(np.asarray(scale, np.float64), w.shape)
    z = np.broadcast_to(np.asarray(zero_point, np.float64), w.shape)
    q = np.array(codes, dtype=np.int64).reshape(w.shape)
    hh = np.asarray(h, np.float64)
    hh = hh[None] if hh.ndim == 2 else hh
    gid = np.zeros(w.shape[0], np.intp) if group is None else np.asarray(group, np.intp)
    t = w / s + z
    lo = np.clip(np.floor(t), qmin, qmax).astype(np.int64)
    hi = np.clip(np.ceil(t), qmin, qmax).astype(np.int64)
    alt = np.where(q == lo, hi, lo)
    err = w - s * (q - z)
    g = _times_h(err, hh, gid)
    before = np.sum(err * g, axis=1)
    diag = np.einsum("gkk->gk", hh)
    # A flip must gain more than float noise, relative to the row's objective (prevents cycling on ties).
    tol = 1e-12 * np.maximum(before, np.finfo(np.float64).tiny)
    active = np.arange(w.shape[0])
    limit = 4 * w.shape[1] if max_steps is None else max_steps
    steps, complete = 0, True
    while active.size:
        if steps >= limit or (deadline is not None and time.perf_counter() > deadline):
            complete = False
            break
        d = s[active] * (alt[active] - q[active])
        gain = -2.0 * d * g[active] + d * d * diag[gid[active]]
        j = np.argmin(gain, axis=1)
        best = gain[np.arange(active.size), j]
        improving = best < -tol[active]
        active, j = active[improving], j[improving]
        if not active.size:
            break
        step = d[improving, j]
        old = q[active, j]
        q[active, j] = alt[active, j]
        alt[active, j] = old
        err[active, j] -= step
        g[active] -= step[:, None] * hh[gid[active], j, :]
        steps += 1
    after = np.sum(err * _times_h(err, hh, gid), axis=1)  # recomputed: no drift from the incremental updates
    flips = int(np.count_nonzero(q != np.asarray(codes, np.int64).reshape(w.shape)))
    return RoundingResult(q, before, after, flips, steps, complete)


def second_moments(rows: npt.ArrayLike, *, centered: bool, shrink: bool = True) -> tuple[Array, Array]:
    """``(H, μ)`` of sampled inputs ``rows`` ``(G, n, K)``: ``H = X^T X / n`` per group, or the covariance
    ``X^T X / n - μ μ^T`` when ``centered`` (the bias then absorbs the mean error, see module docstring).

    ``shrink``: with few rows the sample matrix is a noisy (for ``n < K`` singular) estimate and the descent would
    fit the noise; it is shrunk towards its diagonal, ``H' = (1 - α) H + α diag(H)`` with ``α = K / (n + K)``. A
    diagonal ``H`` makes nearest rounding optimal, so thin samples pull the result towards nearest rounding.
    """
    x = np.asarray(rows, np.float64)
    n, k = max(x.shape[1], 1), x.shape[2]
    mu: Array = x.mean(axis=1)
    h: Array = np.matmul(np.swapaxes(x, 1, 2), x) / n
    if centered:
        h = h - mu[:, :, None] * mu[:, None, :]
    h = 0.5 * (h + np.swapaxes(h, 1, 2))
    if shrink:
        alpha = k / (n + k)
        diag = np.einsum("gkk->gk", h).copy()
        h *= 1.0 - alpha
        h[:, np.arange(k), np.arange(k)] += alpha * diag
    return h, mu
