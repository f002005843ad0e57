"""Calibration: observers that pick activation ranges, the onnxruntime collector, the ranges file.

Typical use::

    from qgraph.calibrate import collect_ranges, read_ranges, write_ranges
    from qgraph.io.model_io import model_fingerprint

    cal = collect_ranges(model, ["conv1_out", "relu2_out"], feeds, method="entropy")
    write_ranges("ranges.json", cal, model_fingerprint=model_fingerprint(model))
    ranges = read_ranges("ranges.json", model_fingerprint(model)).ranges()  # overrides applied

All methods need a single pass over the data (histograms live on a global power-of-two
grid, see :mod:`qgraph.calibrate.histogram`), so ``feeds`` may be a one-shot iterator.
Plain ``minmax`` is reduced inside onnxruntime (:mod:`qgraph.calibrate.reduce`) and costs about
what inference costs; the other methods fetch the tensors and fold them in numpy.
"""

from qgraph.calibrate.auto import AutoChoice, AutoObserver
from qgraph.calibrate.bounded import BOUNDED_OPS, bounded_range
from qgraph.calibrate.collector import TensorCalibration, collect_ranges, observe
from qgraph.calibrate.observers import (
    EntropyObserver,
    HistogramSummary,
    MinMaxObserver,
    MseObserver,
    Observer,
    PercentileObserver,
)
from qgraph.calibrate.ranges_file import RangesFile, read_ranges, write_ranges
from qgraph.calibrate.registry import OBSERVERS, make_observer
from qgraph.calibrate.robust import ROBUST_PERCENTILE, RobustMagnitude
from qgraph.calibrate.summary import TensorFragility, fragility, most_fragile

__all__ = [
    "BOUNDED_OPS",
    "OBSERVERS",
    "ROBUST_PERCENTILE",
    "AutoChoice",
    "AutoObserver",
    "EntropyObserver",
    "HistogramSummary",
    "MinMaxObserver",
    "MseObserver",
    "Observer",
    "PercentileObserver",
    "RangesFile",
    "RobustMagnitude",
    "TensorCalibration",
    "TensorFragility",
    "bounded_range",
    "collect_ranges",
    "fragility",
    "make_observer",
    "most_fragile",
    "observe",
    "read_ranges",
    "write_ranges",
]
