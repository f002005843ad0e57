"""Slow, loop-based reference implementations the calibration tests compare against.

Written independently of qgraph's vectorized code: plain Python loops, per-candidate numpy.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np


def ref_histogram(values: np.ndarray, num_bins: int, include_zero: bool) -> tuple[float, int, np.ndarray]:
    """(bin width, first bin index, counts) of the smallest power-of-two grid fitting the data."""
    vals = [float(v) for v in np.asarray(values, dtype=np.float64).ravel()]
    lo, hi = min(vals), max(vals)
    if include_zero:
        lo = min(lo, 0.0)
    k = -149
    while True:
        w = 2.0**k
        n = math.floor(hi / w) - math.floor(lo / w) + 1
        if n <= num_bins and max(abs(lo), abs(hi)) / w < 2.0**62:
            break
        k += 1
    idx = Counter(math.floor(v / w) for v in vals)
    first = math.floor(lo / w)
    last = max(idx)
    counts = np.zeros(last - first + 1, dtype=np.int64)
    for j, c in idx.items():
        counts[j - first] += c
    if not include_zero:
        # trim leading empty bins (qgraph's rows start at the first occupied bin)
        nz = np.nonzero(counts)[0][0]
        counts, first = counts[nz:], first + int(nz)
    return w, first, counts


def ref_percentile(counts: np.ndarray, first: int, width: float, lo: float, hi: float, q: float) -> float:
    """Inverse CDF with uniform interpolation inside a bin, by walking the bins."""
    total = int(counts.sum())
    target = q * total
    acc = 0.0
    for j, c in enumerate(counts):
        if c > 0 and acc + c >= target:
            value = (first + j + (target - acc) / c) * width
            return min(max(value, lo), hi)
        acc += c
    return hi


def ref_kl(hist: np.ndarray, num_levels: int, start: int | None = None) -> tuple[list[int], list[float]]:
    """TensorRT / pytorch-quantization style KL search, one candidate at a time, from bin ``start``."""
    hist = np.asarray(hist, dtype=np.float64)
    cands, kls = [], []
    for i in range(max(num_levels, start or num_levels), hist.size + 1):
        p = hist[:i].copy()
        p[i - 1] += hist[i:].sum()
        group = np.arange(i) * num_levels // i
        kept = hist[:i]
        level_sum = np.bincount(group, weights=kept, minlength=num_levels)
        level_nonempty = np.bincount(group, weights=(kept > 0).astype(float), minlength=num_levels)
        q = np.where(kept > 0, level_sum[group] / np.maximum(level_nonempty[group], 1), 0.0)
        pn = p / p.sum()
        qn = q / q.sum() if q.sum() > 0 else q
        support = pn > 0
        if np.any(qn[support] == 0):
            kl = math.inf
        else:
            kl = float(np.sum(pn[support] * np.log(pn[support] / qn[support])))
        cands.append(i)
        kls.append(kl)
    return cands, kls


def ref_mse_symmetric(values: np.ndarray, counts: np.ndarray, first: int, width: float, levels: float, k: int):
    """Histogram MSE formula of every candidate t = max|x| * n / k, one candidate at a time."""
    hi = float(np.max(np.abs(values)))
    centers = np.clip((first + np.arange(counts.size) + 0.5) * width, 0.0, hi)
    out = []
    for n in range(1, k + 1):
        t = hi * n / k
        s = t / levels
        err = 0.0
        for c, h in zip(centers, counts, strict=True):
            err += h * ((c - t) ** 2 if c > t else s * s / 12.0)
        out.append((t, err / counts.sum()))
    return out


def true_fake_quant_mse(x: np.ndarray, lo: float, hi: float, steps: int) -> float:
    """Mean squared error of uniform quantization of x to `steps` steps on [lo, hi] (clipping outside)."""
    s = (hi - lo) / steps
    q = np.clip(np.round((x - lo) / s), 0, steps) * s + lo
    return float(np.mean((x - q) ** 2))
