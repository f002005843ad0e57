"""Calibration observers: fold activation batches into bounded state and pick a range.

Every observer has ``update(x, sample_index=None)``, ``merge(other)``, ``compute() ->
ActivationRange`` and ``clip_fraction()`` (fraction of observed values outside the computed
range).  State never grows with the number of samples: min/max per channel, plus for the
histogram observers ``C x num_bins`` counts on the global power-of-two grid of
:mod:`qgraph.calibrate.histogram`.

Batching invariance: feeding the same values in one batch, in batches of 7 or one at a time
gives the same ranges (exactly, not just within tolerance) -- min/max trivially, histograms
because their grid depends only on the global extremes.  The only exception by design is
the moving-average min/max, which is an exponential average over *samples* (axis 0 of each
update), hence invariant to how samples are grouped into updates but not to splitting a
sample.

Clip fractions of histogram observers are estimated at bin resolution (values spread
uniformly inside the bin that straddles a range bound) and are exactly 0 when the range
covers the observed ``[min, max]``.

Per-channel observers (``axis`` given) keep one row per index of that axis; per-tensor
ranges are floats, per-channel ranges ``float64`` arrays of shape ``(C,)``.
Non-finite values raise :class:`qgraph.errors.DataError` naming the tensor and sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from qgraph.calibrate.histogram import AlignedHistogram, HistogramRow
from qgraph.calibrate.observer_base import HistogramSummary, Observer
from qgraph.calibrate.search import entropy_threshold, mse_asymmetric, mse_symmetric, percentile_value
from qgraph.quant.math import QuantDtype, dtype_range, symmetric_zero_point

F64 = npt.NDArray[np.float64]


def _symmetrize(lo: F64, hi: F64) -> tuple[F64, F64]:
    a = np.maximum(np.abs(lo), np.abs(hi))
    return -a, a


class MinMaxObserver(Observer):
    """``range = [min(x), max(x)]`` over all observed values.

    ``symmetric``: ``[-a, a]`` with ``a = max(|min|, |max|)``.  ``moving_average``: per sample
    ``s`` (index along axis 0 of each update, in order) ``m <- m + c * (m_s - m)`` for both
    the sample min and max, initialised with the first sample (``c = averaging_constant``);
    clip fraction is then estimated from a signed histogram kept for that purpose.
    """

    method = "minmax"

    def __init__(
        self,
        name: str = "",
        axis: int | None = None,
        *,
        symmetric: bool = False,
        moving_average: bool = False,
        averaging_constant: float = 0.01,
        num_bins: int = 2048,
    ) -> None:
        super().__init__(name, axis)
        if not 0.0 < averaging_constant <= 1.0:
            raise ValueError("averaging_constant must be in (0, 1]")
        self.symmetric = symmetric
        self.moving_average = moving_average
        self.averaging_constant = averaging_constant
        self.num_bins = num_bins
        self.ema_min: F64 = np.zeros(0)
        self.ema_max: F64 = np.zeros(0)
        self.hist: AlignedHistogram | None = None

    def options(self) -> dict[str, Any]:
        """See class docstring."""
        return {
            "symmetric": self.symmetric,
            "moving_average": self.moving_average,
            "averaging_constant": self.averaging_constant,
        }

    def _init_state(self, channels: int) -> None:
        if self.moving_average:
            self.ema_min = np.full(channels, np.nan)
            self.ema_max = np.full(channels, np.nan)
            self.hist = AlignedHistogram(channels, self.num_bins)

    def _fold(self, arr: npt.NDArray[Any], rows: npt.NDArray[Any], bmin: F64, bmax: F64) -> None:
        if not self.moving_average or self.hist is None:
            return
        self.hist.update(rows, bmin, bmax)
        per_sample = arr.reshape(1, *arr.shape) if arr.ndim == 0 else arr
        if self.axis is None:
            flat = per_sample.reshape(per_sample.shape[0], 1, -1)
        else:
            ax = self.axis % arr.ndim
            if ax == 0:
                flat = per_sample.reshape(1, per_sample.shape[0], -1)
            else:
                flat = np.moveaxis(per_sample, ax, 1).reshape(per_sample.shape[0], per_sample.shape[ax], -1)
        smin = flat.min(axis=2).astype(np.float64)
        smax = flat.max(axis=2).astype(np.float64)
        c = self.averaging_constant
        for s in range(smin.shape[0]):  # sequential by definition; O(batch) scalar-vector ops
            first = np.isnan(self.ema_min)
            self.ema_min = np.where(first, smin[s], self.ema_min + c * (smin[s] - self.ema_min))
            self.ema_max = np.where(first, smax[s], self.ema_max + c * (smax[s] - self.ema_max))

    def fold_range(self, lo: float, hi: float, num_values: int, num_updates: int) -> None:
        """Fold extremes measured elsewhere (the in-graph collector) over ``num_values`` values in
        ``num_updates`` batches; per tensor, without ``moving_average`` only.

        Raises:
            DataError: ``lo``/``hi`` not finite.
        """
        if self.axis is not None or self.moving_average:
            raise ValueError("fold_range needs a per-tensor observer without moving_average")
        if num_values == 0:
            self.num_updates += num_updates
            return
        self.update(np.array([lo, hi], dtype=np.float64))
        self.num_values += num_values - 2
        self.num_updates += num_updates - 1

    def merge(self, other: Observer) -> None:
        """Fold ``other`` in; not possible with ``moving_average`` (order dependent)."""
        if self.moving_average:
            raise ValueError("moving-average min/max depends on sample order and cannot be merged")
        super().merge(other)

    def _merge(self, other: Any) -> None:
        pass

    def _compute(self) -> tuple[F64, F64]:
        lo, hi = (self.ema_min, self.ema_max) if self.moving_average else (self.vmin, self.vmax)
        return _symmetrize(lo, hi) if self.symmetric else (lo.copy(), hi.copy())

    def _clipped(self) -> float:
        if not self.moving_average or self.hist is None:
            return 0.0
        lo, hi = self._range()
        rows = [self.hist.row(c) for c in range(self.hist.channels)]
        return float(sum(r.mass_below(float(lo[c])) + r.mass_above(float(hi[c])) for c, r in enumerate(rows)))


#: Per-tensor updates below this many values are buffered and folded together (`HistogramObserver`).
BUFFER_VALUES = 1 << 16


class HistogramObserver(Observer):
    """Base of the histogram observers: a ``|x|`` histogram (``absolute``) or a signed one.

    Per-tensor updates smaller than `BUFFER_VALUES` values are buffered and folded into the histogram together
    (when the buffer fills, or when anything reads ``hist``): a histogram update costs ~25 us of numpy calls
    whatever its size, and histograms are batching-invariant (module docstring), so the counts are exactly those
    of one update per batch while a 3,000-node chain's 32 samples x 1,000 small tensors cost one update per tensor.
    """

    absolute: bool = False

    def __init__(self, name: str = "", axis: int | None = None, *, num_bins: int = 2048) -> None:
        super().__init__(name, axis)
        if num_bins < 16:
            raise ValueError("num_bins must be >= 16")
        self.num_bins = num_bins
        self._hist: AlignedHistogram | None = None
        self._pending: list[npt.NDArray[Any]] = []
        self._pending_values = 0

    @property
    def hist(self) -> AlignedHistogram | None:
        """The histogram, every buffered update folded in."""
        if self._pending:
            self._flush()
        return self._hist

    def _init_state(self, channels: int) -> None:
        self._hist = AlignedHistogram(channels, self.num_bins, include_zero=self.absolute)

    def _flush(self) -> None:
        assert self._hist is not None
        rows = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending, axis=1)
        self._pending, self._pending_values = [], 0
        self._hist.update(rows, absolute=self.absolute)

    def _fold(self, arr: npt.NDArray[Any], rows: npt.NDArray[Any], bmin: F64, bmax: F64) -> None:
        assert self._hist is not None
        if rows.shape[0] == 1 and rows.shape[1] < BUFFER_VALUES:
            self._pending.append(rows.copy())  # the caller may reuse its array
            self._pending_values += rows.shape[1]
            if self._pending_values >= BUFFER_VALUES:
                self._flush()
            return
        if self._pending:
            self._flush()
        self._hist.update(rows, bmin, bmax, absolute=self.absolute)

    def _merge(self, other: Any) -> None:
        assert self.hist is not None and other.hist is not None
        self.hist.merge(other.hist)

    def _rows_hist(self) -> list[HistogramRow]:
        assert self.hist is not None
        return [self.hist.row(c) for c in range(self.hist.channels)]

    def _compute(self) -> tuple[F64, F64]:
        rows = self._rows_hist()
        if self.absolute:
            t = np.array([self._threshold(r) for r in rows])
            if getattr(self, "symmetric", True):
                return -t, t
            return np.maximum(self.vmin, -t), np.minimum(self.vmax, t)
        pairs = np.array([self._interval(r) for r in rows], dtype=np.float64).reshape(-1, 2)
        return pairs[:, 0], pairs[:, 1]

    def _threshold(self, row: HistogramRow) -> float:
        raise NotImplementedError

    def _interval(self, row: HistogramRow) -> tuple[float, float]:
        raise NotImplementedError

    def _clipped(self) -> float:
        rows = self._rows_hist()
        lo, hi = self._range()
        if self.absolute:
            t = np.maximum(-lo, hi)
            return float(sum(r.mass_above(float(t[c])) for c, r in enumerate(rows)))
        return float(sum(r.mass_below(float(lo[c])) + r.mass_above(float(hi[c])) for c, r in enumerate(rows)))

    def histogram_summary(self) -> HistogramSummary | None:
        """The single row of a per-tensor observer, trimmed to occupied bins."""
        if self.hist is None or self.hist.channels != 1 or self.axis is not None:
            return None
        r = self.hist.row(0)
        kind = "abs" if self.absolute else "signed"
        return HistogramSummary(kind, r.width, r.first, tuple(r.counts.tolist()), r.zeros)


class PercentileObserver(HistogramObserver):
    """Percentile range from the histogram (``p = percentile / 100``).

    symmetric: ``t = Q_|x|(p)``, range ``[-t, t]``; asymmetric: ``(100 - percentile) / 2``
    percent is cut from each tail, ``[Q_x((1 - p) / 2), Q_x((1 + p) / 2)]``, where ``Q`` is
    the histogram inverse CDF (:func:`percentile_value`), clamped to the observed range.
    """

    method = "percentile"

    def __init__(
        self,
        name: str = "",
        axis: int | None = None,
        *,
        percentile: float = 99.999,
        symmetric: bool = False,
        num_bins: int = 2048,
    ) -> None:
        super().__init__(name, axis, num_bins=num_bins)
        if not 0.0 < percentile <= 100.0:
            raise ValueError("percentile must be in (0, 100]")
        self.percentile = percentile
        self.symmetric = symmetric
        self.absolute = symmetric

    def options(self) -> dict[str, Any]:
        """See class docstring."""
        return {"percentile": self.percentile, "symmetric": self.symmetric, "num_bins": self.num_bins}

    def _threshold(self, row: HistogramRow) -> float:
        return percentile_value(row, self.percentile / 100.0)

    def _interval(self, row: HistogramRow) -> tuple[float, float]:
        cut = (1.0 - self.percentile / 100.0) / 2.0
        return percentile_value(row, cut), percentile_value(row, 1.0 - cut)


class EntropyObserver(HistogramObserver):
    """TensorRT-style entropy calibration: the ``|x|`` threshold minimizing KL(P || Q).

    See :func:`qgraph.calibrate.search.kl_divergences` for the formula.  ``symmetric``:
    ``[-t, t]``; otherwise the threshold is intersected with the observed range,
    ``[max(min, -t), min(max, t)]`` (so non-negative tensors get ``[0, t]``).
    """

    method = "entropy"
    absolute = True

    def __init__(
        self,
        name: str = "",
        axis: int | None = None,
        *,
        num_bins: int = 2048,
        num_levels: int = 128,
        symmetric: bool = False,
    ) -> None:
        super().__init__(name, axis, num_bins=num_bins)
        if not 2 <= num_levels <= num_bins // 2:
            raise ValueError("num_levels must be in [2, num_bins / 2]")
        self.num_levels = num_levels
        self.symmetric = symmetric

    def options(self) -> dict[str, Any]:
        """See class docstring."""
        return {"num_bins": self.num_bins, "num_levels": self.num_levels, "symmetric": self.symmetric}

    def _threshold(self, row: HistogramRow) -> float:
        return entropy_threshold(row, self.num_levels)


class MseObserver(HistogramObserver):
    """Range minimizing the expected MSE of quantizing to ``dtype`` (histogram based).

    symmetric: threshold ``t`` of ``|x|`` with step ``t / min(qmax - zp, zp - qmin)`` (see
    :func:`mse_symmetric`), range ``[-t, t]``; asymmetric: ``alpha * [min(x, 0), max(x, 0)]``
    with step ``range / (qmax - qmin)`` (see :func:`mse_asymmetric`).
    """

    method = "mse"

    def __init__(
        self,
        name: str = "",
        axis: int | None = None,
        *,
        dtype: QuantDtype | str = QuantDtype.INT8,
        symmetric: bool = False,
        narrow_range: bool = False,
        reduce_range: bool = False,
        num_bins: int = 2048,
        num_candidates: int = 1024,
    ) -> None:
        super().__init__(name, axis, num_bins=num_bins)
        self.dtype = QuantDtype(dtype)
        self.symmetric = symmetric
        self.absolute = symmetric
        self.narrow_range = narrow_range
        self.reduce_range = reduce_range
        self.num_candidates = num_candidates
        qmin, qmax = dtype_range(self.dtype, narrow_range, reduce_range)
        zp = symmetric_zero_point(self.dtype, narrow_range, reduce_range)
        self._levels = float(min(qmax - zp, zp - qmin))
        self._steps = qmax - qmin

    def options(self) -> dict[str, Any]:
        """See class docstring."""
        return {
            "dtype": self.dtype.value,
            "symmetric": self.symmetric,
            "narrow_range": self.narrow_range,
            "reduce_range": self.reduce_range,
            "num_bins": self.num_bins,
            "num_candidates": self.num_candidates,
        }

    def _threshold(self, row: HistogramRow) -> float:
        return mse_symmetric(row, self._levels, self.num_candidates)[0]

    def _interval(self, row: HistogramRow) -> tuple[float, float]:
        return mse_asymmetric(row, self._steps, self.num_candidates)[0]


__all__ = [
    "EntropyObserver",
    "HistogramObserver",
    "HistogramSummary",
    "MinMaxObserver",
    "MseObserver",
    "Observer",
    "PercentileObserver",
]
