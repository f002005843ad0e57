"""RobustMagnitude: the nearest-rank percentile of |x| over a bounded strided subsample."""

from __future__ import annotations

import numpy as np
import pytest

from qgraph.calibrate import RobustMagnitude


def test_strided_subsample_and_nearest_rank() -> None:
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((3, 1000 + 777 * i)).astype(np.float32) for i in range(6)]
    whole, pre = RobustMagnitude(99.0, per_update=512), RobustMagnitude(99.0, per_update=512)
    kept = []
    for b in batches:
        whole.update(b)
        flat = b.ravel()
        sub = flat[:: max(1, flat.size // 512)]
        pre.add_subsample(sub)
        kept.append(np.abs(sub))
    values = np.sort(np.concatenate(kept))
    assert whole.value() == pre.value() == float(values[int(np.ceil(0.99 * values.size)) - 1])
    assert 512 * 6 <= values.size <= 2 * 512 * 6


def test_bounded_memory_and_validity() -> None:
    r = RobustMagnitude(99.0, per_update=1000, limit=5000)
    rng = np.random.default_rng(1)
    for _ in range(100):
        r.update(rng.standard_normal(10_000))
    assert 2500 <= r.size <= 5000 and r.value() == pytest.approx(2.576, abs=0.15)  # 99th pct of |N(0, 1)|
    assert RobustMagnitude().value() is None
    with pytest.raises(ValueError):
        RobustMagnitude(0.0)


def test_thinning_keeps_every_update_equally_represented() -> None:
    """Update i holds only the value i: after many halvings each update keeps about the same share."""
    r = RobustMagnitude(100.0, per_update=1000, limit=4000)
    for i in range(1, 201):
        r.update(np.full(1000, float(i)))
    counts = np.bincount(r.buffer[: r.size].astype(int), minlength=201)[1:]
    assert r.level >= 5 and counts.min() >= 0.5 * counts.mean() and counts.max() <= 2 * counts.mean()
    assert r.value() == 200.0
