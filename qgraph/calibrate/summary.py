"""Where calibration is fragile: the tensors whose chosen range clips most, or whose extremes are outliers.

Two numbers per tensor, both from a single calibration run:

* ``clip_fraction``: the fraction of observed values outside the chosen range (0 for minmax);
* ``outlier_ratio``: ``max|x| / robust_absmax`` (the 99.99th percentile of ``|x|``), when measured.  A
  ratio in the hundreds means a handful of values set a minmax scale and every other value gets a few
  quantization levels; a ratio near 1 means the range is well used.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from qgraph.calibrate.collector import TensorCalibration


@dataclass(frozen=True)
class TensorFragility:
    """One tensor's clipping and outlier numbers (per-channel tensors: the worst channel's extremes)."""

    tensor: str
    method: str
    range_min: float
    range_max: float
    observed_min: float
    observed_max: float
    clip_fraction: float
    outlier_ratio: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def fragility(c: TensorCalibration) -> TensorFragility:
    """The numbers of one calibrated tensor."""
    lo, hi = float(np.min(c.observed.rmin)), float(np.max(c.observed.rmax))
    absmax = max(abs(lo), abs(hi))
    ratio = None
    if c.robust_absmax is not None:
        ratio = absmax / c.robust_absmax if c.robust_absmax > 0 else (1.0 if absmax == 0 else float("inf"))
    return TensorFragility(
        c.name, c.chosen_method, float(np.min(c.range.rmin)), float(np.max(c.range.rmax)), lo, hi,
        float(c.clip_fraction), ratio,
    )


def most_fragile(calibrations: Mapping[str, TensorCalibration], top: int = 10) -> dict[str, list[TensorFragility]]:
    """The ``top`` tensors clipping the most values (only those clipping any) and the ``top`` with the largest
    outlier ratio (only where measured), worst first."""
    rows = [fragility(c) for c in calibrations.values()]
    clipped = sorted((r for r in rows if r.clip_fraction > 0), key=lambda r: (-r.clip_fraction, r.tensor))
    outliers = sorted(
        (r for r in rows if r.outlier_ratio is not None), key=lambda r: (-(r.outlier_ratio or 0.0), r.tensor)
    )
    return {"most_clipped": clipped[:top], "largest_outlier_ratio": outliers[:top]}


@dataclass(frozen=True)
class AutoRow:
    """``method: auto`` on one tensor: the winner, its gain over minmax, every candidate's expected error."""

    tensor: str
    winner: str
    gain_db: float
    errors: dict[str, float]


def auto_table(calibrations: Mapping[str, TensorCalibration], top: int = 10) -> tuple[dict[str, int], list[AutoRow]]:
    """Tensors per method ``auto`` chose (most frequent first), and the ``top`` tensors where the choice mattered
    most (largest ``gain_db``); both empty when no tensor was calibrated with ``auto``."""
    chosen = [(n, c.choice) for n, c in calibrations.items() if c.choice is not None]
    counts = dict(Counter(ch.winner for _, ch in chosen).most_common())
    rows = [AutoRow(n, ch.winner, ch.gain_db, dict(ch.errors)) for n, ch in chosen]
    rows.sort(key=lambda r: (-r.gain_db, r.tensor))
    return counts, rows[:top]
