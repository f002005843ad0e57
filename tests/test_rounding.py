"""The adaptive-rounding solver and the int32 bias fold (qgraph.recovery.rounding,
qgraph.quant.math.shift_int32_bias)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph.quant.math import shift_int32_bias
from qgraph.recovery.rounding import optimize_rounding, rounding_objective, second_moments


def _problem(seed: int, rows: int, k: int, groups: int, offset: float, qrange: tuple[int, int]) -> tuple:
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 1, (rows * groups, k)) * rng.uniform(0.01, 1.0, (rows * groups, 1))
    x = rng.normal(offset, 1, (groups, 64, k))
    qmin, qmax = qrange
    scale = np.abs(w).max(axis=1, keepdims=True) / (qmax - qmin) * 2.2  # a little clipping at the ends
    zp = np.full_like(scale, (qmin + qmax + 1) // 2)
    codes = np.clip(np.rint(w / scale) + zp, qmin, qmax)
    h, _ = second_moments(x, centered=False, shrink=False)
    group = np.arange(rows * groups) // rows
    return w, scale, zp, codes, h, group


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 6), k=st.integers(1, 24), groups=st.integers(1, 3),
       offset=st.floats(-1.0, 1.0), signed=st.booleans(), steps=st.sampled_from([None, 1, 3]))
def test_objective_never_worse_than_nearest_and_codes_stay_in_floor_ceil_and_range(
        seed: int, rows: int, k: int, groups: int, offset: float, signed: bool, steps: int | None) -> None:
    qrange = (-128, 127) if signed else (0, 255)
    w, scale, zp, codes, h, group = _problem(seed, rows, k, groups, offset, qrange)
    r = optimize_rounding(w, scale, zp, codes, h, *qrange, group=group, max_steps=steps)
    nearest = rounding_objective(w, scale, zp, codes, h, group)
    chosen = rounding_objective(w, scale, zp, r.codes, h, group)
    np.testing.assert_allclose(r.before, nearest, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(r.after, chosen, rtol=1e-9, atol=1e-12)
    assert np.all(chosen <= nearest * (1 + 1e-9) + 1e-12)
    t = w / scale + zp
    lo, hi = np.clip(np.floor(t), *qrange), np.clip(np.ceil(t), *qrange)
    assert np.all((r.codes >= lo) & (r.codes <= hi))
    assert r.codes.min() >= qrange[0] and r.codes.max() <= qrange[1]
    assert r.flips == int(np.count_nonzero(r.codes != codes))


def test_descent_reaches_a_local_optimum_that_beats_nearest_on_a_correlated_problem() -> None:
    w, scale, zp, codes, h, group = _problem(3, 32, 27, 1, 0.8, (-128, 127))
    scale = scale * 8  # coarse grid: rounding matters
    codes = np.clip(np.rint(w / scale) + zp, -128, 127)
    r = optimize_rounding(w, scale, zp, codes, h, -128, 127, group=group)
    assert r.complete and r.flips > 0
    assert r.after.sum() < 0.8 * r.before.sum()
    again = optimize_rounding(w, scale, zp, r.codes, h, -128, 127, group=group)
    assert again.flips == 0  # no single flip improves any row any more


def test_on_grid_weights_are_left_alone() -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(-128, 128, (8, 12)).astype(np.float64)
    scale = np.full((8, 1), 0.01)
    w = codes * scale
    h, _ = second_moments(rng.normal(0, 1, (1, 50, 12)), centered=True)
    r = optimize_rounding(w, scale, 0, codes, h, -128, 127)
    assert r.flips == 0 and np.allclose(r.after, 0)


def test_deadline_in_the_past_returns_the_start() -> None:
    w, scale, zp, codes, h, _group = _problem(1, 4, 9, 1, 0.5, (-128, 127))
    r = optimize_rounding(w, scale, zp, codes, h, -128, 127, deadline=0.0)
    assert not r.complete and r.flips == 0 and np.array_equal(r.codes, codes)


def test_centered_second_moment_is_the_covariance() -> None:
    x = np.random.default_rng(0).normal(2.0, 1.0, (2, 500, 3))
    h, mu = second_moments(x, centered=True, shrink=False)
    for g in range(2):
        np.testing.assert_allclose(h[g], np.cov(x[g].T, bias=True), atol=1e-12)
        np.testing.assert_allclose(mu[g], x[g].mean(axis=0))


@settings(max_examples=60, deadline=None)
@given(codes=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=8),
       scale=st.floats(1e-9, 1e3), delta=st.floats(-1e6, 1e6))
def test_int32_bias_shift_moves_by_delta_within_half_a_step_or_saturates(codes: list[int], scale: float,
                                                                         delta: float) -> None:
    q = np.array(codes, np.int32)
    new, clipped = shift_int32_bias(q, scale, np.full(q.shape, delta))
    assert new.dtype == np.int32
    moved = (new.astype(np.float64) - q) * scale
    exact = np.abs(moved - delta) <= 0.5 * scale * (1 + 1e-9)
    at_limit = (new == np.iinfo(np.int32).min) | (new == np.iinfo(np.int32).max)
    assert np.all(exact | at_limit)
    assert clipped == int(np.count_nonzero(~exact))
