"""Robust magnitude: a high percentile of ``|x|`` from a bounded strided subsample.

Outlier reporting and screening compare a tensor's exact ``max|x|`` (from its observer) with the
99.99th percentile of ``|x|``: a ratio of hundreds means a few extreme values (masking constants,
outlier channels) would set the scale and crush every other value.  The percentile is estimated on a
subsample, since the rare extremes themselves are not needed in it, which keeps cost and memory bounded:

* each update keeps every ``k``-th value of the flattened tensor, ``k = max(1, size // per_update)``
  (between ``per_update`` and ``2 * per_update`` values); the in-graph collector takes the same
  values with ``Slice`` (:mod:`qgraph.calibrate.reduce`), so both paths give the same estimate;
* at most ``limit`` values are kept, in one buffer grown by doubling (about 1 MB at its bound, so a model with
  hundreds of tensors calibrated on a few samples does not pay the bound for each): when it is full, every other kept
  value is dropped and later updates are thinned by twice as much (``2**level``), so all updates stay
  equally represented.  Each value is touched O(1) times on average: cost is linear in the data.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

#: Percentile of ``|x|`` used for outlier screening and reporting.
ROBUST_PERCENTILE = 99.99
#: Values kept per update.
PER_UPDATE = 4096


class RobustMagnitude:
    """The ``percentile`` of ``|x|`` over a bounded strided subsample (see module docstring)."""

    def __init__(self, percentile: float = ROBUST_PERCENTILE, per_update: int = PER_UPDATE,
                 limit: int = 1 << 18) -> None:
        if not 0.0 < percentile <= 100.0:
            raise ValueError("percentile must be in (0, 100]")
        if limit < 2 * per_update:
            raise ValueError("limit must hold at least two updates")
        self.percentile, self.per_update, self.limit = percentile, per_update, limit
        self.buffer = np.empty(0, dtype=np.float32)  # grown as values come
        self.size = 0
        self.level = 0  # later updates keep every (2 ** level)-th of their values

    def update(self, x: npt.ArrayLike, sample_index: int | None = None) -> None:
        """Fold one whole tensor (any shape)."""
        flat = np.asarray(x).ravel()
        self.add_subsample(flat[:: max(1, flat.size // self.per_update)])

    def add_subsample(self, values: npt.ArrayLike) -> None:
        """Fold values already taken with :meth:`update`'s stride."""
        chunk = np.asarray(values).ravel()[:: 1 << self.level]
        if chunk.size == 0:
            return
        end = self.size + chunk.size
        if end > self.buffer.size:  # grown by doubling up to its bound: a few updates of hundreds of tensors stay small
            grown = np.empty(max(end, min(2 * self.buffer.size, self.limit + 2 * self.per_update)), np.float32)
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        np.abs(chunk, out=self.buffer[self.size : end], casting="unsafe")
        self.size = end
        while self.size > self.limit:
            kept = (self.size + 1) // 2
            self.buffer[:kept] = self.buffer[: self.size : 2]
            self.size = kept
            self.level += 1

    def value(self) -> float | None:
        """The percentile (nearest rank), or None before any value."""
        if self.size == 0:
            return None
        values = self.buffer[: self.size].copy()
        k = min(values.size - 1, max(int(np.ceil(values.size * self.percentile / 100.0)) - 1, 0))
        return float(np.partition(values, k)[k])
