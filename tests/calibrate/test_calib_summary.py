"""Where calibration is fragile: clip fractions and outlier ratios, ranked."""

from __future__ import annotations

import numpy as np
import pytest

from qgraph.calibrate import RobustMagnitude, TensorCalibration, make_observer
from qgraph.calibrate.summary import fragility, most_fragile


def _cal(name: str, x: np.ndarray, method: str = "minmax", robust: bool = True, **opts) -> TensorCalibration:
    obs = make_observer(method, name, **opts)
    obs.update(x, 0)
    rob = RobustMagnitude() if robust else None
    if rob is not None:
        rob.update(x)
    return TensorCalibration.from_observer(obs, rob)


def test_outlier_ratio_and_ranking() -> None:
    rng = np.random.default_rng(0)
    normal = rng.standard_normal(200_000).astype(np.float32)
    spiky = normal.copy()
    spiky[123] = 1000.0  # one value sets a minmax scale 250x larger than the bulk needs
    cals = {
        "normal": _cal("normal", normal),
        "spiky": _cal("spiky", spiky),
        "clipped": _cal("clipped", normal, "percentile", percentile=99.0, num_bins=512),
        "unmeasured": _cal("unmeasured", normal, robust=False),
    }
    f = fragility(cals["spiky"])
    assert f.observed_max == 1000.0 and f.clip_fraction == 0.0
    p9999 = float(np.sort(np.abs(spiky))[int(np.ceil(0.9999 * spiky.size)) - 1])
    # estimated on a ~4,200-value strided subsample: within 20% of the exact percentile
    assert f.outlier_ratio == pytest.approx(1000.0 / p9999, rel=0.2) and f.outlier_ratio > 200
    assert fragility(cals["normal"]).outlier_ratio == pytest.approx(float(np.abs(normal).max()) / 3.9, rel=0.2)
    worst = most_fragile(cals, top=2)
    # "clipped" and "normal" hold the same values: equal ratios, ties broken by name
    assert [r.tensor for r in worst["largest_outlier_ratio"]] == ["spiky", "clipped"]
    assert [r.tensor for r in worst["most_clipped"]] == ["clipped"]  # minmax clips nothing
    assert worst["most_clipped"][0].clip_fraction == pytest.approx(0.01, abs=0.002)
    assert fragility(cals["unmeasured"]).outlier_ratio is None
    assert set(worst["most_clipped"][0].to_dict()) >= {"tensor", "clip_fraction", "outlier_ratio"}
