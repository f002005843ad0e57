"""smooth_quant's batched work gives the numbers of the one-at-a-time work, bit for bit (issue #34): the stacked
``alpha: auto`` scoring (`smoothing_errors_stacked`, many groups at once) against a per-candidate loop written out
from the formula, the activation statistics folded many samples at a time against a fold after every sample, and
the report's max/median ratios against `np.median`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from qgraph.passes.smooth_quant.measure import ChannelStats, _Pending

from qgraph import PassError
from qgraph.quant.math import QuantDtype, QuantSpec, compute_scale_zero_point, fake_quantize
from qgraph.recovery.equalize import smoothing_scales
from qgraph.recovery.smoothing import smoothing_errors_stacked


def _one_candidate(x: np.ndarray, w: np.ndarray, s: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                   per_channel: bool) -> float:
    """The relative INT8 error of one smoothing choice, candidate by candidate (the loop the stacked call replaces)."""
    xs, ws = x / s[None, :], w * s[:, None]
    a_scale, a_zp = compute_scale_zero_point(float(np.min(lo / s)), float(np.max(hi / s)),
                                             QuantSpec(dtype=QuantDtype.UINT8))
    xq = fake_quantize(xs, a_scale, a_zp, QuantDtype.UINT8).astype(np.float64)
    absmax = np.abs(ws).max(axis=0) if per_channel else np.array(np.abs(ws).max())
    spec = QuantSpec(dtype=QuantDtype.INT8, symmetric=True, per_channel=per_channel, axis=1 if per_channel else None)
    w_scale, w_zp = compute_scale_zero_point(-absmax, absmax, spec)
    wq = fake_quantize(ws, w_scale, w_zp, QuantDtype.INT8, axis=1 if per_channel else None).astype(np.float64)
    ref = x @ w
    signal = float(np.sum(ref * ref))
    return float(np.sum((ref - xq @ wq) ** 2)) / signal if signal > 0 else 0.0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 40), k=st.integers(1, 24), n=st.integers(1, 24),
       per_channel=st.booleans(), positive=st.booleans())
def test_stacked_candidates_score_exactly_as_one_by_one(seed: int, rows: int, k: int, n: int, per_channel: bool,
                                                        positive: bool) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)) * np.exp(rng.normal(0, 2, k))  # outlier channels
    x = np.abs(x) if positive else x
    w = rng.standard_normal((k, n)) * np.exp(rng.normal(0, 1, (k, 1)))
    # calibrated ranges a little wider than the rows, relative to each channel's magnitude (an absolute margin could
    # make a single tiny row smaller than half a step: all of it rounds to the zero point)
    mag = np.abs(x).max(0)
    lo, hi = x.min(0) - rng.random(k) * mag, x.max(0) + rng.random(k) * mag
    a, wr = np.maximum(np.abs(lo), np.abs(hi)), np.abs(w).max(1)
    cands = np.stack([np.ones(k), *(smoothing_scales(a, wr, al, 1e-5, 1e5) for al in (0.3, 0.5, 0.8))])
    got = smoothing_errors_stacked(x[None], w[None], cands[None], lo[None], hi[None], per_channel=per_channel)[0]
    assert got.tolist() == [_one_candidate(x, w, s, lo, hi, per_channel) for s in cands]
    # a real INT8 error, not a degenerate zero; the best candidate's is small (unsmoothed, outlier channels can lose
    # more than half of the output's energy: that is what smoothing is for)
    assert np.all(got > 0) and got.min() < 0.5


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), groups=st.integers(1, 6), rows=st.integers(1, 20), k=st.integers(1, 12),
       n=st.integers(1, 12), per_channel=st.booleans())
def test_groups_stacked_score_exactly_as_one_by_one(seed: int, groups: int, rows: int, k: int, n: int,
                                                    per_channel: bool) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((groups, rows, k)) * np.exp(rng.normal(0, 2, (groups, 1, k)))
    w = rng.standard_normal((groups, k, n))
    lo, hi = x.min(1) - rng.random((groups, k)), x.max(1) + rng.random((groups, k))
    cands = np.exp(rng.normal(0, 1, (groups, 4, k)))
    got = smoothing_errors_stacked(x, w, cands, lo, hi, per_channel=per_channel)
    assert got.shape == (groups, 4)
    for g in range(groups):
        assert got[g].tolist() == [_one_candidate(x[g], w[g], s, lo[g], hi[g], per_channel) for s in cands[g]]


def test_the_scorer_scores_each_shape_in_bounded_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    from qgraph.passes.smooth_quant import choose

    calls: list[int] = []
    stacked = choose.smoothing_errors_stacked

    def counted(x: np.ndarray, *a: Any, **k: Any) -> np.ndarray:
        calls.append(len(x))
        return stacked(x, *a, **k)

    monkeypatch.setattr(choose, "smoothing_errors_stacked", counted)
    monkeypatch.setattr(choose, "STACK_VALUES", 3 * 2 * 4 * 5)  # three groups of [2 candidates, 4 rows, 5 channels]
    rng = np.random.default_rng(0)
    scorer = choose.CandidateScorer(per_channel=True)
    shapes = [(4, 5, 3)] * 7 + [(2, 5, 3)] * 2  # seven groups of one shape, two of another
    items = []
    for i, (r, k, n) in enumerate(shapes):
        x, w = rng.standard_normal((r, k)), rng.standard_normal((k, n))
        item = (x, w, np.exp(rng.normal(0, 1, (2, k))), x.min(0), x.max(0))
        items.append(item)
        scorer.add(i, *item)
    scorer.flush()
    assert sorted(calls) == [1, 2, 3, 3]  # 3 + 3 + 1 of the first shape, 2 of the second
    for i, (x, w, cands, lo, hi) in enumerate(items):
        assert scorer.errors[i].tolist() == stacked(x[None], w[None], cands[None], lo[None], hi[None])[0].tolist()


def _feed(stats: ChannelStats, batches: list[np.ndarray]) -> ChannelStats:
    for i, b in enumerate(batches):
        stats.update(b, i)
    return stats


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), counts=st.lists(st.sampled_from([1, 1, 1, 2, 3, 7]), min_size=1, max_size=60),
       rows=st.integers(1, 6))
def test_statistics_folded_together_equal_a_fold_per_sample(seed: int, counts: list[int], rows: int) -> None:
    rng = np.random.default_rng(seed)
    batches = [rng.standard_normal((c, 4)).astype(np.float32) for c in counts]  # runs of one-row batches, thinning
    every = _feed(ChannelStats("x", rows, pending=_Pending(limit=0)), batches)  # folded after each sample
    together = _feed(ChannelStats("x", rows), batches)
    for a, b in ((every.low, together.low), (every.high, together.high)):
        assert a is not None and b is not None and a.tolist() == b.tolist()
    assert every.kept == together.kept <= 4 * rows + 7
    assert every.rows_sample().tolist() == together.rows_sample().tolist()
    assert every.rng.bit_generator.state == together.rng.bit_generator.state
    flat = np.concatenate(batches)
    assert together.absmax.tolist() == np.abs(flat).max(axis=0).astype(np.float64).tolist()


def test_shared_budget_folds_every_tensor_and_bad_values_name_their_sample() -> None:
    pending = _Pending(limit=3 * 16 * 4)  # three [4, 4] float32 batches over both tensors
    a, b = ChannelStats("a", 2, pending=pending), ChannelStats("b", 2, pending=pending)
    a.update(np.ones((4, 4), np.float32), 0)
    b.update(np.ones((4, 4), np.float32), 0)
    assert a._batches and b._batches  # kept, not yet reduced
    a.update(np.full((4, 4), 2, np.float32), 1)
    a.update(np.full((4, 4), 3, np.float32), 2)  # over the budget: both fold
    assert not a._batches and not b._batches and pending.used == 0
    b.update(np.full((1, 4), np.nan, np.float32), 7)
    with pytest.raises(PassError, match="tensor 'b' holds NaN/Inf on calibration sample 7"):
        b.fold()
    assert a.absmax.tolist() == [3.0] * 4


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.floats(0.0, 1e6), min_size=5, max_size=5), min_size=1, max_size=4),
       k=st.integers(1, 5))
def test_report_ratios_are_numpys_max_over_median(rows: list[list[float]], k: int) -> None:
    from qgraph.passes.smooth_quant import max_over_median

    v = np.array(rows)[:, :k]
    want = []
    for row in v:
        med = float(np.median(row))
        want.append(round(float(row.max()) / med, 3) if med > 0 else float("inf"))
    assert max_over_median(v) == want


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.one_of(st.floats(0.0, 1e6), st.just(np.inf)), min_size=1, max_size=12), data=st.data(),
       bounds=st.sampled_from([(0.0, np.inf), (1e-5, 1e5), (0.5, 2.0)]))
def test_a_grid_of_alphas_gives_each_alphas_scales(a: list[float], data: st.DataObject,
                                                    bounds: tuple[float, float]) -> None:
    from qgraph.recovery.equalize import smoothing_scales_grid

    w = np.array(data.draw(st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1e3)), min_size=len(a), max_size=len(a))))
    grid = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.0, 1.0)
    got = smoothing_scales_grid(np.array(a), w, grid, *bounds)
    assert got.shape == (len(grid), len(a))
    for row, alpha in zip(got, grid, strict=True):
        assert row.tobytes() == smoothing_scales(np.array(a), w, alpha, *bounds).tobytes()
