"""Segmented runs of very large graphs live in `qgraph.runtime.segments` (calibration and weight correction both run
long graphs slice by slice); this module keeps the names calibration code has always imported."""

from __future__ import annotations

from qgraph.runtime.segments import SEGMENT_NODES, SEGMENT_THRESHOLD, observe_segmented, plan_segments, segmentable

__all__ = ["SEGMENT_NODES", "SEGMENT_THRESHOLD", "observe_segmented", "plan_segments", "segmentable"]
