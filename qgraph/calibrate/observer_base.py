"""Observer base class: per-channel input handling, min/max tracking, NaN/Inf checks, caching.

See :mod:`qgraph.calibrate.observers` for the concrete observers and their formulas.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from qgraph.errors import DataError
from qgraph.quant.math import ActivationRange

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class HistogramSummary:
    """Compact histogram of a per-tensor observer: bin ``j`` is ``[(first + j) * width, ...)``.

    ``kind`` is ``"abs"`` (histogram of ``|x|``) or ``"signed"``; ``zeros`` counts the values that
    are exactly 0 (also counted in their bin).
    """

    kind: str
    width: float
    first: int
    counts: tuple[int, ...]
    zeros: int = 0


def _scalar_or_array(v: F64) -> float | F64:
    return float(v[0]) if v.shape == (1,) else v.copy()


class Observer(abc.ABC):
    """Base class: tracks per-channel min/max and the number of values/updates."""

    method: ClassVar[str] = ""

    def __init__(self, name: str = "", axis: int | None = None) -> None:
        self.name = name
        self.axis = axis
        self.channels: int | None = None
        self.vmin: F64 = np.zeros(0)
        self.vmax: F64 = np.zeros(0)
        self.num_values = 0
        self.num_updates = 0
        self._cached: tuple[F64, F64] | None = None

    # -- input handling ---------------------------------------------------------------
    def _rows(self, x: npt.NDArray[Any], sample_index: int | None) -> npt.NDArray[Any]:
        """``x`` as a ``(C, M)`` array (C = 1 per tensor)."""
        if self.axis is None:
            return x.reshape(1, -1)
        if x.ndim == 0 or not -x.ndim <= self.axis < x.ndim:
            raise DataError(
                f"tensor {self.name!r} (sample {sample_index}): channel axis {self.axis} is out of "
                f"range for shape {x.shape}"
            )
        return np.moveaxis(x, self.axis, 0).reshape(x.shape[self.axis], -1)

    def _check_channels(self, c: int, sample_index: int | None) -> None:
        if self.channels is None:
            self.channels = c
            self.vmin = np.full(c, np.inf)
            self.vmax = np.full(c, -np.inf)
            self._init_state(c)
        elif self.channels != c:
            raise DataError(
                f"tensor {self.name!r} (sample {sample_index}): {c} channels on axis {self.axis}, "
                f"earlier samples had {self.channels}"
            )

    def update(self, x: npt.ArrayLike, sample_index: int | None = None) -> None:
        """Fold one batch ``x`` (any shape) into the state.

        Raises:
            DataError: NaN/Inf values, or a channel count different from earlier batches.
        """
        self._cached = None
        arr = x if isinstance(x, np.ndarray) else np.asarray(x)
        if arr.dtype.kind != "f" or arr.dtype.itemsize < 4:
            arr = arr.astype(np.float32)
        self.num_updates += 1
        if arr.size == 0:
            return
        rows = self._rows(arr, sample_index)
        if self.channels != rows.shape[0]:
            self._check_channels(rows.shape[0], sample_index)
        if rows.shape[0] == 1:  # per tensor: Python floats, a third of the numpy calls (one update per tensor per
            lo, hi = float(rows.min()), float(rows.max())  # sample on a 3,000-node chain)
            finite = math.isfinite(lo) and math.isfinite(hi)
            bmin, bmax = np.array([lo]), np.array([hi])
        else:
            bmin = rows.min(axis=1).astype(np.float64)
            bmax = rows.max(axis=1).astype(np.float64)
            finite = bool(np.isfinite(bmin).all() and np.isfinite(bmax).all())
        if not finite:
            where = "" if sample_index is None else f" in sample {sample_index}"
            raise DataError(f"tensor {self.name!r} contains NaN or Inf values{where}")
        self._fold(arr, rows, bmin, bmax)
        self.vmin = np.minimum(self.vmin, bmin)
        self.vmax = np.maximum(self.vmax, bmax)
        self.num_values += arr.size

    def merge(self, other: Observer) -> None:
        """Fold the state of ``other`` (same class, options, axis and channels) into this one."""
        if type(other) is not type(self) or other.axis != self.axis or other.options() != self.options():
            raise ValueError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        if other.channels is None:
            return
        self._check_channels(other.channels, None)
        self._cached = None
        self._merge(other)
        self.vmin = np.minimum(self.vmin, other.vmin)
        self.vmax = np.maximum(self.vmax, other.vmax)
        self.num_values += other.num_values
        self.num_updates += other.num_updates

    # -- results -----------------------------------------------------------------------
    def observed(self) -> ActivationRange:
        """Exact ``[min, max]`` of everything observed (``[0, 0]`` if nothing was)."""
        if self.channels is None:
            return ActivationRange(0.0, 0.0)
        return ActivationRange(_scalar_or_array(self.vmin), _scalar_or_array(self.vmax))

    def compute(self) -> ActivationRange:
        """The calibrated range (``[0, 0]`` if nothing was observed)."""
        if self.channels is None:
            return ActivationRange(0.0, 0.0)
        lo, hi = self._range()
        return ActivationRange(_scalar_or_array(lo), _scalar_or_array(hi))

    def _range(self) -> tuple[F64, F64]:
        """``_compute()``, cached until the next update or merge."""
        if self._cached is None:
            self._cached = self._compute()
        return self._cached

    def clip_fraction(self) -> float:
        """Fraction of all observed values outside :meth:`compute`'s range (0 if none observed)."""
        if self.channels is None or self.num_values == 0:
            return 0.0
        return self._clipped() / self.num_values

    def histogram_summary(self) -> HistogramSummary | None:
        """Histogram of a per-tensor observer (``None`` when per-channel or histogram-less)."""
        return None

    def options(self) -> dict[str, Any]:
        """Constructor options (without name/axis); used for merging and the ranges file."""
        return {}

    # -- hooks ---------------------------------------------------------------------------
    def _init_state(self, channels: int) -> None:  # noqa: B027 - optional hook
        """Allocate state for ``channels`` rows."""

    @abc.abstractmethod
    def _fold(self, arr: npt.NDArray[Any], rows: npt.NDArray[Any], bmin: F64, bmax: F64) -> None: ...

    @abc.abstractmethod
    def _merge(self, other: Any) -> None: ...

    @abc.abstractmethod
    def _compute(self) -> tuple[F64, F64]: ...

    @abc.abstractmethod
    def _clipped(self) -> float: ...
