"""``method: auto``: per tensor, the calibration method whose range quantizes that tensor best.

One signed histogram per tensor (the global power-of-two grid of :mod:`qgraph.calibrate.histogram`, the same
single streaming pass and bounded state as every histogram method) yields every candidate range:

* ``minmax``: the exact observed ``[min, max]``;
* ``percentile:P`` for each ``P`` in ``percentiles``: the inverse CDF of the *nonzero* values at
  ``(1 -+ P/100) / 2`` (symmetric: at ``P/100`` of ``|x|``), so that, like the searches, they do not move
  when exact zeros are added;
* ``mse``: :func:`~qgraph.calibrate.search.mse_asymmetric` (symmetric: :func:`mse_symmetric`);
* ``entropy``: the KL threshold :func:`~qgraph.calibrate.search.entropy_threshold` on the row folded to
  ``|x|`` (bin ``j < 0`` of ``x`` is bin ``-j - 1`` of ``|x|`` on the same grid), intersected with the
  observed range (``[-t, t]`` when symmetric).

Each candidate is scored with :func:`~qgraph.calibrate.search.expected_error`: ``E[(x - Q(x))**2]`` on the
histogram, ``Q`` using the exact scale and zero point :func:`qgraph.quant.math.compute_scale_zero_point` gives
that range for the target ``dtype``/``symmetric``/``narrow_range``/``reduce_range``.  The winner is the
smallest error, except that ``minmax`` (the only range that clips nothing) is kept unless another
candidate lowers the error by more than ``min_gain`` (a fraction): the histogram estimate is good to
about 0.5%, and a clipped range is a bet that the calibration data's tails are representative.
Cost: the candidates are O(num_bins * num_levels) per tensor, computed once; folding the data costs what
one histogram method costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from qgraph.calibrate.histogram import HistogramRow
from qgraph.calibrate.observers import HistogramObserver
from qgraph.calibrate.search import (
    entropy_threshold,
    expected_error,
    mse_asymmetric,
    mse_symmetric,
    percentile_value,
)
from qgraph.quant.math import QuantDtype, QuantSpec, dtype_range, symmetric_zero_point

F64 = npt.NDArray[np.float64]

#: Percentile candidates of ``method: auto`` (each is ``percentile:P`` in reports).
DEFAULT_PERCENTILES: tuple[float, ...] = (99.9, 99.99, 99.999)


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` chose for one tensor: the winning candidate and every candidate's range and error.

    ``errors[name]`` is the expected squared error per value; ``gain_db`` is ``10 log10(error of minmax /
    error of the winner)``, how much the choice mattered.
    """

    winner: str
    errors: dict[str, float]
    ranges: dict[str, tuple[float, float]]

    @property
    def gain_db(self) -> float:
        """``10 log10(errors['minmax'] / errors[winner])`` (0 when both are 0)."""
        best, base = self.errors[self.winner], self.errors["minmax"]
        if base <= 0 or best <= 0:
            return 0.0
        return float(10.0 * np.log10(base / best))


def fold_abs(row: HistogramRow) -> HistogramRow:
    """The ``|x|`` histogram of a signed row on the same grid (bin 0 is ``[0, w)``), zeros kept."""
    idx = row.first + np.arange(row.counts.size, dtype=np.int64)
    folded = np.where(idx >= 0, idx, -idx - 1)
    # Counted from the lowest occupied |x| bin, not from 0: a row far from 0 on a fine grid (a constant 0.74 has
    # a bin index near 1e9) would otherwise allocate every empty bin in between.
    base = int(folded.min())
    counts = np.bincount(folded - base, weights=row.counts)
    hi = max(abs(row.lo), abs(row.hi))
    lo = 0.0 if row.lo <= 0.0 <= row.hi else min(abs(row.lo), abs(row.hi))
    return HistogramRow(np.rint(counts).astype(np.int64), base, row.width, min(lo, 0.0), hi, row.zeros)


class AutoObserver(HistogramObserver):
    """Per tensor, the candidate range with the smallest expected quantization error (module docstring)."""

    method = "auto"

    def __init__(
        self,
        name: str = "",
        axis: int | None = None,
        *,
        dtype: QuantDtype | str = QuantDtype.UINT8,
        symmetric: bool = False,
        narrow_range: bool = False,
        reduce_range: bool = False,
        percentiles: tuple[float, ...] | list[float] = DEFAULT_PERCENTILES,
        num_bins: int = 2048,
        num_levels: int = 128,
        num_candidates: int = 1024,
        min_gain: float = 0.01,
    ) -> None:
        if axis is not None:
            raise ValueError("method auto is per tensor (activations); use a fixed method for per-channel ranges")
        super().__init__(name, axis, num_bins=num_bins)
        if not all(0.0 < p < 100.0 for p in percentiles):
            raise ValueError("percentiles must be in (0, 100)")
        if not 0.0 <= min_gain < 1.0:
            raise ValueError("min_gain must be in [0, 1)")
        self.spec = QuantSpec(dtype=QuantDtype(dtype), symmetric=symmetric, narrow_range=narrow_range,
                              reduce_range=reduce_range)
        self.percentiles = tuple(float(p) for p in percentiles)
        self.num_levels = num_levels
        self.num_candidates = num_candidates
        self.min_gain = min_gain
        self._choice: AutoChoice | None = None

    def options(self) -> dict[str, Any]:
        """See the class and module docstrings."""
        return {
            "dtype": self.spec.dtype.value,
            "symmetric": self.spec.symmetric,
            "narrow_range": self.spec.narrow_range,
            "reduce_range": self.spec.reduce_range,
            "percentiles": list(self.percentiles),
            "num_bins": self.num_bins,
            "num_levels": self.num_levels,
            "num_candidates": self.num_candidates,
            "min_gain": self.min_gain,
        }

    def choice(self) -> AutoChoice | None:
        """The decision (``None`` before any value was observed)."""
        if self.channels is None:
            return None
        self._range()
        return self._choice

    def _interval(self, row: HistogramRow) -> tuple[float, float]:
        cands = self.candidates(row)
        names = list(cands)
        lo = np.array([cands[n][0] for n in names])
        hi = np.array([cands[n][1] for n in names])
        err = expected_error(row, lo, hi, self.spec)
        best = int(np.argmin(err))
        if err[best] >= (1.0 - self.min_gain) * err[0]:  # names[0] is minmax: keep it unless clearly beaten
            best = 0
        self._choice = AutoChoice(names[best], {n: float(e) for n, e in zip(names, err, strict=True)},
                                  {n: (float(a), float(b)) for n, (a, b) in cands.items()})
        return float(lo[best]), float(hi[best])

    def candidates(self, row: HistogramRow) -> dict[str, tuple[float, float]]:
        """Every candidate range of a signed row, ``minmax`` first (module docstring)."""
        qmin, qmax = dtype_range(self.spec.dtype, self.spec.narrow_range, self.spec.reduce_range)
        absrow = fold_abs(row)
        nz = row.without_zeros() if row.zeros < row.total else row
        t_ent = entropy_threshold(absrow, self.num_levels)
        if self.spec.symmetric:
            zp = symmetric_zero_point(self.spec.dtype, self.spec.narrow_range, self.spec.reduce_range)
            abs_nz = absrow.without_zeros() if absrow.zeros < absrow.total else absrow
            ts = {"minmax": absrow.hi}
            ts.update({f"percentile:{p:g}": percentile_value(abs_nz, p / 100.0) for p in self.percentiles})
            ts["mse"] = mse_symmetric(absrow, float(min(qmax - zp, zp - qmin)), self.num_candidates)[0]
            ts["entropy"] = t_ent
            return {n: (-t, t) for n, t in ts.items()}
        out = {"minmax": (row.lo, row.hi)}
        for p in self.percentiles:
            cut = (1.0 - p / 100.0) / 2.0
            out[f"percentile:{p:g}"] = (percentile_value(nz, cut), percentile_value(nz, 1.0 - cut))
        out["mse"] = mse_asymmetric(row, qmax - qmin, self.num_candidates)[0]
        out["entropy"] = (max(row.lo, -t_ent), min(row.hi, t_ent))
        return out
