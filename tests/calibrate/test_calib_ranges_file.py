"""Ranges file: round trip, atomic write, fingerprint check, overrides, validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qgraph.calibrate import RobustMagnitude, TensorCalibration, make_observer, read_ranges, write_ranges
from qgraph.errors import DataError
from qgraph.quant.math import ActivationRange

FP = "a" * 64


def _calibrations() -> dict[str, TensorCalibration]:
    rng = np.random.default_rng(0)
    ent = make_observer("entropy", "act", num_bins=256, num_levels=32)
    values = np.maximum(rng.standard_normal(5000), 0).astype(np.float32)  # ReLU: ~2,500 exact zeros
    ent.update(values, 0)
    robust = RobustMagnitude()
    robust.update(values)
    pc = make_observer("minmax", "pc", 1)
    pc.update(rng.standard_normal((4, 3)).astype(np.float32), 0)
    return {"act": TensorCalibration.from_observer(ent, robust), "pc": TensorCalibration.from_observer(pc)}


def test_round_trip(tmp_path: Path) -> None:
    cal = _calibrations()
    path = write_ranges(tmp_path / "sub" / "ranges.json", cal, model_fingerprint=FP, data_fingerprint="d" * 64)
    assert [p.name for p in path.parent.iterdir()] == ["ranges.json"]  # no temp file left
    doc = json.loads(path.read_text())
    assert doc["format"] == "qgraph-ranges" and doc["version"] == 1 and doc["method"] == "mixed"
    assert doc["tensors"]["pc"]["histogram"] is None
    assert sum(doc["tensors"]["act"]["histogram"]["counts"]) == 5000
    assert 2300 < doc["tensors"]["act"]["histogram"]["zeros"] < 2700
    assert doc["tensors"]["act"]["robust_absmax"] == cal["act"].robust_absmax > 0
    assert doc["tensors"]["pc"]["robust_absmax"] is None
    rf = read_ranges(path, expected_model_fingerprint=FP)
    assert rf.data_fingerprint == "d" * 64
    for name, c in cal.items():
        got = rf.tensors[name]
        np.testing.assert_array_equal(got.range.rmin, c.range.rmin)
        np.testing.assert_array_equal(got.range.rmax, c.range.rmax)
        np.testing.assert_array_equal(got.observed.rmax, c.observed.rmax)
        assert got.clip_fraction == c.clip_fraction and got.num_values == c.num_values
        assert got.axis == c.axis and got.method == c.method
    assert rf.tensors["act"].histogram == cal["act"].histogram
    assert rf.tensors["act"].robust_absmax == cal["act"].robust_absmax
    assert isinstance(rf.ranges()["pc"].rmin, np.ndarray)


def test_fingerprint_mismatch(tmp_path: Path) -> None:
    path = write_ranges(tmp_path / "r.json", _calibrations(), model_fingerprint=FP)
    with pytest.raises(DataError, match=r"different model.*aaaaaaaaaaaaaaaa.*bbbbbbbbbbbbbbbb.*[Rr]ecalibrate"):
        read_ranges(path, expected_model_fingerprint="b" * 64)
    read_ranges(path)  # no expectation: accepted


def test_overrides_win(tmp_path: Path) -> None:
    path = write_ranges(
        tmp_path / "r.json",
        _calibrations(),
        model_fingerprint=FP,
        overrides={"act": ActivationRange(-1.0, 2.0)},
    )
    doc = json.loads(path.read_text())
    doc["overrides"]["pc"] = {"min": [-1, -2, -3], "max": [1, 2, 3]}  # hand edit
    doc["overrides"]["extra"] = {"min": 0, "max": 6}
    path.write_text(json.dumps(doc))
    ranges = read_ranges(path).ranges()
    assert (ranges["act"].rmin, ranges["act"].rmax) == (-1.0, 2.0)
    np.testing.assert_array_equal(ranges["pc"].rmax, [1.0, 2.0, 3.0])
    assert (ranges["extra"].rmin, ranges["extra"].rmax) == (0.0, 6.0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["overrides"].update({"act": {"min": 3, "max": 1}}), "min must be <= max"),
        (lambda d: d["overrides"].update({"act": {"min": 0}}), "overrides.act.max"),
        (lambda d: d.update({"format": "other"}), "format"),
        (lambda d: d["tensors"]["act"].update({"bogus": 1}), "tensors.act.bogus"),
        (lambda d: d.update({"version": 99}), "newer than this qgraph supports"),
    ],
)
def test_invalid_files(tmp_path: Path, edit, message: str) -> None:
    path = write_ranges(tmp_path / "r.json", _calibrations(), model_fingerprint=FP)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError, match=message):
        read_ranges(path)


def test_unreadable(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        read_ranges(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not a readable JSON"):
        read_ranges(bad)
