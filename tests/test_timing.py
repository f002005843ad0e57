"""Every pass's time against the calibration's (qgraph.pipeline.timing), from fake records and from a real run."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from qgraph.passes.correct_bias import CorrectBias
from qgraph.passes.insert_qdq import InsertQDQ

from qgraph import PassResult, Pipeline
from qgraph.pipeline.timing import BUDGET, run_timing

sys.path.insert(0, str(Path(__file__).parent / "passes"))
from insert_qdq_helpers import feeds_for, source, tiny_cnn


@dataclass
class Record:
    name: str
    seconds: float
    result: PassResult = field(default_factory=PassResult)


def test_passes_against_the_calibration_slowest_first() -> None:
    qdq = Record("insert_qdq", 5.0, PassResult(calibration_seconds=4.0))
    records = [Record("fold_constants", 0.1), qdq, Record("correct_bias", 6.0), Record("tune_ranges", 48.0)]
    t = run_timing(records)
    assert t is not None and t.calibration_seconds == 4.0 and t.calibrated_by == "insert_qdq"
    assert [(p.name, p.seconds, p.ratio) for p in t.passes] == [
        ("tune_ranges", 48.0, 12.0), ("correct_bias", 6.0, 1.5), ("insert_qdq (besides calibrating)", 1.0, 0.25),
        ("fold_constants", 0.1, pytest.approx(0.025))]
    assert [p.name for p in t.over_budget] == ["tune_ranges"] and BUDGET == 10.0
    line = t.line()
    assert line.startswith("time against calibration (4.0 s: the float model over the calibration data, in insert_qdq)")
    assert "tune_ranges 48.0 s (12.0x)" in line and line.endswith("over 10x: tune_ranges")
    assert "(+1 more, each 0.03x or less)" in line  # fold_constants: negligible, counted
    assert run_timing([Record("fold_constants", 0.1)]) is None  # nothing calibrated from data


def test_a_real_run_reports_its_calibration_and_the_correction_against_it() -> None:
    m = tiny_cnn()
    res = Pipeline([InsertQDQ(preset="ort-x86-vnni"), CorrectBias()]).run(m, calibration_data=source(feeds_for(m, 16)))
    cal = res.records[0].result.calibration_seconds
    assert cal is not None and 0 < cal < res.records[0].seconds
    t = run_timing(res.records)
    assert t is not None and {p.name for p in t.passes} == {"insert_qdq (besides calibrating)", "correct_bias"}
    bias = next(p for p in t.passes if p.name == "correct_bias")
    assert bias.ratio == pytest.approx(res.records[1].seconds / cal)
    assert t.to_dict()["passes"][0]["x_calibration"] == max(p.ratio for p in t.passes)
