"""Range searches on a single histogram row (percentile, KL entropy, MSE).

All functions are vectorized over candidate thresholds; none loops over bins in Python.

Exact zeros: 0 is exactly representable at any scale (the zero point is an integer), so it
contributes no quantization error and carries no information about where to clip.  The
entropy and MSE searches therefore run on :meth:`HistogramRow.without_zeros`.  This matters
for ReLU outputs, about half of whose values are exactly 0: kept in, that spike sits in the
first quantization level, whose mass ``Q`` spreads evenly over ``i / num_levels`` bins, which
costs about ``p_0 * log(i / num_levels)`` of KL for threshold bin ``i``.  That term grows with
the threshold and outweighs the clipping cost: the search then stops at a small multiple of
``num_levels`` bins (a ReLU of N(0, 1) was clipped at 2.0, cutting 2.3% of its values).
Adding any number of exact zeros to the data never changes an entropy or MSE threshold.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

from qgraph.calibrate.histogram import HistogramRow
from qgraph.quant.math import QuantSpec, compute_scale_zero_point

F64 = npt.NDArray[np.float64]


def percentile_value(row: HistogramRow, q: float) -> float:
    """Inverse CDF of the histogram at fraction ``q`` in ``[0, 1]``.

    With bin counts ``h_j``, cumulative ``E_j = sum_{i<j} h_i`` and target mass ``m = q * N``,
    the bin ``j`` with ``E_j < m <= E_{j+1}`` is found and the value is interpolated
    uniformly inside it: ``(first + j + (m - E_j) / h_j) * width``, clamped to the exact
    observed ``[lo, hi]``.
    """
    total = row.total
    if total == 0:
        return 0.0
    if q <= 0.0:
        return row.lo
    if q >= 1.0:
        return row.hi
    m = q * total
    cum = np.concatenate([[0.0], np.cumsum(row.counts, dtype=np.float64)])
    j = int(np.searchsorted(cum, m, side="left")) - 1
    j = min(max(j, 0), row.counts.size - 1)
    h = float(row.counts[j])
    frac = (m - cum[j]) / h if h > 0 else 0.0
    value = (row.first + j + frac) * row.width
    return float(min(max(value, row.lo), row.hi))


def kl_divergences(
    hist: npt.NDArray[np.int64], num_levels: int, start: int | None = None
) -> tuple[npt.NDArray[np.int64], F64]:
    """TensorRT-style KL divergence of every clipping threshold, vectorized.

    ``hist`` is a histogram of ``|x|`` starting at 0.  For each candidate ``i`` (bins kept,
    ``start <= i <= len(hist)``, ``start`` defaulting to ``num_levels`` as in TensorRT):

    * reference ``P``: ``P_j = h_j`` for ``j < i - 1`` and ``P_{i-1} = h_{i-1} + O_i`` with the
      outliers ``O_i = sum_{j >= i} h_j``;
    * candidate ``Q``: bin ``j < i`` belongs to level ``g(j) = floor(j * L / i)``
      (``L = num_levels``); ``Q_j = S_g / n_g`` if ``h_j > 0`` else 0, where ``S_g`` and
      ``n_g`` are the count sum and number of non-empty bins of level ``g``;
    * ``KL_i = sum_j p_j log(p_j / q_j)`` with ``p = P / sum(P)``, ``q = Q / sum(Q)``;
      ``+inf`` when some ``p_j > 0`` has ``q_j = 0`` (only possible at ``j = i - 1``).

    Expanding the sums gives, with ``N = sum(h)``,
    ``KL_i = (sum_j P_j log P_j - sum_g S_g log(S_g / n_g) - O_i log Q_{i-1}) / N + log((N - O_i) / N)``,
    which prefix sums evaluate for all ``i`` at once in ``O(len(hist) * L)``.

    Returns ``(candidates i, KL_i)``.
    """
    h = hist.astype(np.float64)
    n = h.size
    L = num_levels
    cand = np.arange(max(L, start or L), n + 1, dtype=np.int64)
    if cand.size == 0:
        return cand, np.zeros(0)
    total = h.sum()
    cs = np.concatenate([[0.0], np.cumsum(h)])
    nzc = np.concatenate([[0], np.cumsum(h > 0)]).astype(np.float64)
    xlogx = np.where(h > 0, h * np.log(np.where(h > 0, h, 1.0)), 0.0)
    ce = np.concatenate([[0.0], np.cumsum(xlogx)])

    outliers = total - cs[cand]
    h_last = h[cand - 1]
    invalid = (h_last == 0) & (outliers > 0)
    kl = np.full(cand.size, np.inf)
    # Only candidates whose last kept bin is occupied (or that clip nothing) have a finite KL: on the sparse rows
    # of small tensors that is a few hundred of ~2,000, so the O(L) level sums run for those alone (each row of
    # the level sums is computed on its own, so the finite values are bit for bit those of the full search)
    valid = np.flatnonzero(~invalid)
    if valid.size == 0:
        return cand, kl
    plogq, s_last, n_last = _level_sums(cs, nzc, L, cand[valid])
    cand_v, outliers, h_last = cand[valid], outliers[valid], h_last[valid]
    q_last = s_last / np.where(n_last > 0, n_last, 1.0)
    with np.errstate(divide="ignore"):
        plogq += np.where(outliers > 0, outliers * np.log(np.where(q_last > 0, q_last, 1.0)), 0.0)
    p_last = h_last + outliers
    plogp = ce[cand_v - 1] + np.where(p_last > 0, p_last * np.log(np.where(p_last > 0, p_last, 1.0)), 0.0)
    inside = total - outliers
    with np.errstate(divide="ignore"):
        kl[valid] = (plogp - plogq) / total + np.log(np.where(inside > 0, inside, 1.0) / total)
    return cand, kl


#: Candidates per block of `_level_sums`: a block's (rows x levels) arrays stay in the CPU cache.
_BLOCK = 128


def _level_sums(cs: F64, nzc: F64, num_levels: int, cand: npt.NDArray[np.int64]) -> tuple[F64, F64, F64]:
    """For the candidates ``cand`` (increasing, each ``>= num_levels``): ``sum_g S_g log(S_g / n_g)`` and the last
    level's ``S`` and ``n`` (:func:`kl_divergences`), from the prefix sums of the counts ``cs`` and of the non-empty
    bins ``nzc``. Computed in blocks of `_BLOCK` candidates, each row exactly as a single (candidates x levels)
    array would."""
    count = cand.size
    table = _level_bounds(num_levels, 1 << (int(cand[-1]) - 1).bit_length())
    rows = cand - num_levels
    contiguous = int(cand[-1] - cand[0]) + 1 == count
    plogq, s_last, n_last = np.empty(count), np.empty(count), np.empty(count)
    for a in range(0, count, _BLOCK):
        b = min(a + _BLOCK, count)
        # ceil(g * i / L), rows of candidates: a slice where the candidates are consecutive (no copy)
        bounds = table[rows[a]:rows[a] + b - a] if contiguous else table[rows[a:b]]
        gathered = np.take(cs, bounds)  # np.take: the same values as cs[bounds], a third faster
        s_g = gathered[:, 1:] - gathered[:, :-1]
        gathered = np.take(nzc, bounds)
        n_g = gathered[:, 1:] - gathered[:, :-1]
        # S_g / n_g where occupied, 1 where empty (S_g = 0 iff n_g = 0: the counts are non-negative integers);
        # adding 0 or 1 is exact, so this equals a divide masked with `where=` at two thirds of its cost
        ratio = (s_g + (s_g == 0)) / (n_g + (n_g == 0))
        np.log(ratio, out=ratio)
        ratio *= s_g  # 0 where S_g = 0 (log 1 = 0)
        plogq[a:b] = np.sum(ratio, axis=1)
        s_last[a:b], n_last[a:b] = s_g[:, -1], n_g[:, -1]
    return plogq, s_last, n_last


@functools.lru_cache(maxsize=8)
def _level_bounds(num_levels: int, max_bins: int) -> npt.NDArray[np.int64]:
    """``ceil(g * i / L)`` for ``i = L .. max_bins`` (rows) and ``g = 0 .. L`` (columns), computed once per shape:
    the integer divisions cost as much as the rest of a KL search. Read-only (shared by every call)."""
    i = np.arange(num_levels, max(max_bins, num_levels) + 1, dtype=np.int64)
    g = np.arange(num_levels + 1, dtype=np.int64)
    out = (g[None, :] * i[:, None] + num_levels - 1) // num_levels
    out.flags.writeable = False
    return out


def entropy_threshold(row: HistogramRow, num_levels: int = 128) -> float:
    """Threshold ``t`` minimizing the KL divergence (see :func:`kl_divergences`) on a ``|x|`` row.

    ``t = i* * width`` for the minimizing ``i*`` (first minimum), capped at the exact maximum
    ``row.hi``.  Exact zeros are left out (module docstring).

    Candidates start ``num_levels`` bins past the first occupied bin ``f`` (TensorRT starts at
    ``num_levels``, the same when data reach down to 0).  Data bounded away from 0 (a pooled
    ReLU output in [0.3, 3.6]) otherwise has candidates keeping a single occupied bin: ``P`` (all
    the clipped mass folded into that bin) and ``Q`` are then the same one-bin distribution,
    ``KL = 0`` whatever fraction is clipped, and the search picks it (measured: 100% of a resnet50
    pooling output clipped).  With at least ``num_levels`` bins of the data's own support kept,
    heavy clipping leaves a spike in ``P``'s last bin that ``Q`` cannot follow, and KL sees it.
    If the data occupy fewer than ``f + num_levels`` bins no clipping can help and ``t = row.hi``.
    """
    nonzero = row.without_zeros()
    if nonzero.total == 0:
        return row.hi
    occupied = np.flatnonzero(nonzero.counts)
    cand, kl = kl_divergences(nonzero.counts, num_levels, start=int(occupied[0]) + num_levels)
    if cand.size == 0 or not np.any(np.isfinite(kl)):
        return row.hi
    best = int(cand[int(np.argmin(kl))])
    return float(min((row.first + best) * row.width, row.hi))


def mse_symmetric(row: HistogramRow, levels: float, num_candidates: int = 1024) -> tuple[float, F64]:
    """Threshold ``t`` of a ``|x|`` row minimizing the expected quantization MSE.

    Candidates ``t_k = hi * k / K`` (``k = 1..K``).  With bin centers ``c_j`` (clamped to the
    observed ``[lo, hi]``), counts ``h_j``
    and step ``s = t / levels`` (``levels`` = positive integer levels, e.g. 127 for int8):
    ``MSE(t) = [ s**2 / 12 * sum_{c_j <= t} h_j + sum_{c_j > t} h_j (c_j - t)**2 ] / N``,
    i.e. uniform rounding noise inside the range plus squared clipping distance outside.  The
    sums run over the row without its exact zeros (they quantize without error); ``N`` counts
    every value.  A single-valued row (``lo == hi``) returns ``t = hi``: the value is then
    exactly representable, which the uniform-noise model cannot see.
    Returns ``(t, MSE of every candidate)``.
    """
    if row.total == 0 or row.hi <= 0:
        return 0.0, np.zeros(0)
    nz = row.without_zeros()
    if row.lo == row.hi or nz.total == 0:
        return row.hi, np.zeros(0)
    t = row.hi * np.arange(1, num_candidates + 1, dtype=np.float64) / num_candidates
    bins = _occupied(nz)
    err = _clip_error_above(bins, t) + (t / levels) ** 2 / 12.0 * (nz.total - _count_above(bins, t))
    mse = err / row.total
    return float(t[int(np.argmin(mse))]), mse


def mse_asymmetric(row: HistogramRow, num_steps: int, num_candidates: int = 1024) -> tuple[tuple[float, float], F64]:
    """Range ``[a, b]`` of a signed row minimizing the expected quantization MSE.

    Candidates shrink the zero-extended range ``[lo0, hi0] = [min(lo, 0), max(hi, 0)]``
    uniformly: ``(a, b) = alpha_k * (lo0, hi0)``, ``alpha_k = k / K``.  With step
    ``s = (b - a) / num_steps`` (``num_steps = qmax - qmin``):
    ``MSE = [ s**2/12 * #{a <= c_j <= b} + sum_{c_j < a} h_j (a - c_j)**2``
    ``+ sum_{c_j > b} h_j (c_j - b)**2 ] / N``, the sums without exact zeros (see
    :func:`mse_symmetric`; every candidate range contains 0).
    A single-valued row returns the full range (see :func:`mse_symmetric`).
    Returns ``((a, b), MSE of every candidate)``.
    """
    lo0, hi0 = min(row.lo, 0.0), max(row.hi, 0.0)
    if row.total == 0 or hi0 - lo0 <= 0 or row.lo == row.hi:
        return (lo0, hi0), np.zeros(0)
    nz = row.without_zeros()
    alpha = np.arange(1, num_candidates + 1, dtype=np.float64) / num_candidates
    a, b = alpha * lo0, alpha * hi0
    bins = _occupied(nz)
    above = _clip_error_above(bins, b)
    below = _clip_error_below(bins, a)
    inside = nz.total - _count_above(bins, b) - _count_below(bins, a)
    err = above + below + ((b - a) / num_steps) ** 2 / 12.0 * inside
    mse = err / row.total
    k = int(np.argmin(mse))
    return (float(a[k]), float(b[k])), mse


def _centers(row: HistogramRow) -> F64:
    """Bin centers clamped to the exact observed ``[lo, hi]`` (the end bins' values lie inside it)."""
    c = (row.first + np.arange(row.counts.size, dtype=np.float64) + 0.5) * row.width
    return np.clip(c, row.lo, row.hi)


def _occupied(row: HistogramRow) -> tuple[F64, F64]:
    """Centers (clamped, `_centers`) and counts of the occupied bins only. The prefix and suffix sums below add
    bins in order, and an empty bin adds an exact 0, so every sum over the occupied bins is bit for bit the sum
    over all bins: a small tensor's row (a few hundred values over ~2,000 bins) is searched at its own size."""
    keep = np.flatnonzero(row.counts)
    return _centers(row)[keep], row.counts[keep].astype(np.float64)


def _suffix(x: F64) -> F64:
    """``out[i] = sum(x[i:])``, length ``len(x) + 1``."""
    return np.concatenate([np.cumsum(x[::-1])[::-1], [0.0]])


def _prefix(x: F64) -> F64:
    """``out[i] = sum(x[:i])``, length ``len(x) + 1``."""
    return np.concatenate([[0.0], np.cumsum(x)])


def _clip_error_above(bins: tuple[F64, F64], t: F64) -> F64:
    c, h = bins
    idx = np.searchsorted(c, t, side="right")  # first center > t
    s0, s1, s2 = _suffix(h)[idx], _suffix(h * c)[idx], _suffix(h * c * c)[idx]
    return np.maximum(s2 - 2.0 * t * s1 + t * t * s0, 0.0)


def _clip_error_below(bins: tuple[F64, F64], t: F64) -> F64:
    c, h = bins
    idx = np.searchsorted(c, t, side="left")  # centers < t are c[:idx]
    p0, p1, p2 = _prefix(h)[idx], _prefix(h * c)[idx], _prefix(h * c * c)[idx]
    return np.maximum(p2 - 2.0 * t * p1 + t * t * p0, 0.0)


def _count_above(bins: tuple[F64, F64], t: F64) -> F64:
    c, h = bins
    return _suffix(h)[np.searchsorted(c, t, side="right")]


def _count_below(bins: tuple[F64, F64], t: F64) -> F64:
    c, h = bins
    return _prefix(h)[np.searchsorted(c, t, side="left")]


def expected_error(row: HistogramRow, lo: F64, hi: F64, spec: QuantSpec) -> F64:
    """Expected squared fake-quant error ``E[(x - Q(x))**2]`` of a signed row for candidate ranges ``[lo_k, hi_k]``.

    Each range goes through :func:`qgraph.quant.math.compute_scale_zero_point` with ``spec`` (the exact grid
    insert_qdq will use: scale ``s``, zero point ``z``), so ``Q(x) = s * clip(round(x / s), L, U)`` with
    ``L = qmin - z``, ``U = qmax - z``.  With ``a = L s`` and ``b = U s`` the error is
    ``e(x) = x - a`` below ``a``, ``x - b`` above ``b`` and the rounding sawtooth ``s * (y - round(y))``,
    ``y = x / s``, between.  Values are taken uniform inside each bin (the end bins clamped to the observed
    ``[lo, hi]``), so a bin ``[u, v)`` holding ``h`` values contributes ``h * (Phi(v) - Phi(u)) / (v - u)``
    with the continuous antiderivative ``Phi`` of ``e**2``:

    * ``Phi(x) = (x - a)**3 / 3`` for ``x <= a``;
    * ``Phi(x) = s**3 * (H(x / s) - H(L))`` on ``[a, b]``, ``H(y) = n / 12 + r**3 / 3 + 1 / 24`` with
      ``n = floor(y + 1/2)``, ``r = y - n`` (the integral of the squared sawtooth, ``1/12`` per period);
    * ``Phi(x) = Phi(b) + (x - b)**3 / 3`` for ``x >= b``.

    Exact zeros contribute nothing (0 is on every grid); the sum is divided by all ``N`` values.  A
    zero-width bin (single-valued data) contributes ``h * e(u)**2``.  Returns one error per candidate.
    """
    lo_a, hi_a = np.atleast_1d(np.asarray(lo, np.float64)), np.atleast_1d(np.asarray(hi, np.float64))
    if row.total == 0:
        return np.zeros(lo_a.shape)
    scale32, zp = compute_scale_zero_point(lo_a, hi_a, spec)
    s = scale32.astype(np.float64)[:, None]
    qmin, qmax = spec.qrange
    low = (qmin - zp.astype(np.float64))[:, None]
    up = (qmax - zp.astype(np.float64))[:, None]
    nz = row.without_zeros()
    edges = np.clip(nz.edges(), row.lo, row.hi)[None, :]
    width = edges[:, 1:] - edges[:, :-1]
    h = nz.counts.astype(np.float64)[None, :]
    occupied = np.flatnonzero(nz.counts)
    if 2 * occupied.size < nz.counts.size and np.all(width > 0):
        return _sparse_error(edges, width, h, occupied, (s, low, up), row.total)
    phi = _error_antiderivative(edges, s, low, up)
    per_bin = (phi[:, 1:] - phi[:, :-1]) / np.where(width > 0, width, 1.0)
    if not np.all(width > 0):  # zero-width bins (single-valued data) only: the point error costs a third of the call
        point = (edges[:, :-1] - s * np.clip(np.rint(edges[:, :-1] / s), low, up)) ** 2
        per_bin = np.where(width > 0, per_bin, point)
    return np.asarray(np.sum(h * np.maximum(per_bin, 0.0), axis=1) / row.total, dtype=np.float64)


def _sparse_error(edges: F64, width: F64, h: F64, occupied: npt.NDArray[np.intp], grid: tuple[F64, F64, F64],
                  total: int) -> F64:
    """:func:`expected_error` of a row whose occupied bins are under half of its bins (a small tensor's row):
    ``Phi`` only at the edges of the occupied bins. The per-bin terms are the same element-wise operations and
    the sum runs over the same full-length rows (empty bins add an exact 0), so the result is bit for bit that of
    the dense path."""
    s, low, up = grid
    phi_lo = _error_antiderivative(edges[:, occupied], s, low, up)
    phi_hi = _error_antiderivative(edges[:, occupied + 1], s, low, up)
    terms = np.zeros((s.shape[0], h.shape[1]))
    terms[:, occupied] = h[:, occupied] * np.maximum((phi_hi - phi_lo) / width[:, occupied], 0.0)
    return np.asarray(np.sum(terms, axis=1) / total, dtype=np.float64)


def _error_antiderivative(x: F64, s: F64, low: F64, up: F64) -> F64:
    """``Phi(x)`` of :func:`expected_error` (broadcast over candidates x points)."""
    a, b = low * s, up * s

    def saw(y: F64) -> F64:
        n = np.floor(y + 0.5)
        r = y - n
        return n / 12.0 + r**3 / 3.0 + 1.0 / 24.0

    base = saw(low)
    inner = s**3 * (saw(np.clip(x, a, b) / s) - base)
    below = np.minimum(x - a, 0.0) ** 3 / 3.0
    above = np.maximum(x - b, 0.0) ** 3 / 3.0
    return np.asarray(inner + below + above, dtype=np.float64)
