"""Connected components of a binary image in numpy: runs per row, joined across rows (8-connectivity).

Runs ``[start, end)`` are found with one ``diff`` per image; two runs in adjacent rows touch when
``start_b <= end_a`` and ``start_a <= end_b`` (diagonal neighbours included), found for all runs at once with
``searchsorted`` on keys ``row * (W + 2) + column``; the component of each run is the fixed point of
"take the smallest label of a neighbour" with pointer jumping. No Python loop over pixels or runs.
"""

from __future__ import annotations

import numpy as np


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row, start and end (exclusive) of every horizontal run of True, row-major."""
    padded = np.zeros((mask.shape[0], mask.shape[1] + 2), np.int8)
    padded[:, 1:-1] = mask
    d = np.diff(padded, axis=1)
    rows, starts = np.nonzero(d == 1)
    _, ends = np.nonzero(d == -1)
    return rows, starts, ends


def _labels(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Component label (the smallest member index) of each of ``n`` nodes joined by edges ``a[i] - b[i]``."""
    label = np.arange(n)
    while True:
        before = label.copy()
        low = np.minimum(label[a], label[b])
        np.minimum.at(label, a, low)
        np.minimum.at(label, b, low)
        label = label[label]  # pointer jumping: halve every chain
        if np.array_equal(label, before):
            return label


def components(mask: np.ndarray) -> np.ndarray:
    """Bounding boxes ``[k, 4]`` as ``(y0, x0, y1, x1)`` (half-open) of the 8-connected components of ``mask``."""
    mask = np.asarray(mask, bool)
    rows, starts, ends = _runs(mask)
    if not len(rows):
        return np.zeros((0, 4), np.int64)
    width = mask.shape[1] + 2
    start_key, end_key = rows * width + starts, rows * width + ends
    nxt = (rows + 1) * width
    lo = np.searchsorted(end_key, nxt + starts, side="left")  # first run of the next row with end >= start
    hi = np.searchsorted(start_key, nxt + ends, side="right")  # past the last with start <= end
    count = np.maximum(hi - lo, 0)
    a = np.repeat(np.arange(len(rows)), count)
    offsets = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    b = np.repeat(lo, count) + offsets
    label = _labels(len(rows), a, b)
    ids, comp = np.unique(label, return_inverse=True)
    k = len(ids)
    y0 = np.full(k, mask.shape[0]); x0 = np.full(k, mask.shape[1])  # noqa: E702
    y1 = np.zeros(k, np.int64); x1 = np.zeros(k, np.int64)  # noqa: E702
    np.minimum.at(y0, comp, rows)
    np.minimum.at(x0, comp, starts)
    np.maximum.at(y1, comp, rows + 1)
    np.maximum.at(x1, comp, ends)
    return np.stack([y0, x0, y1, x1], axis=1).astype(np.int64)
