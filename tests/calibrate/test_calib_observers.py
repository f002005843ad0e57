"""Observers against brute-force numpy references, batching invariance, errors."""

from __future__ import annotations

import numpy as np
import pytest
from calib_reference import ref_histogram, ref_kl, ref_mse_symmetric, ref_percentile, true_fake_quant_mse
from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph.calibrate.histogram import HistogramRow
from qgraph.calibrate.observers import (
    EntropyObserver,
    MinMaxObserver,
    MseObserver,
    PercentileObserver,
)
from qgraph.calibrate.registry import make_observer
from qgraph.calibrate.search import kl_divergences, mse_asymmetric
from qgraph.errors import DataError
from qgraph.quant.math import QuantSpec, compute_scale_zero_point

RNG = np.random.default_rng(42)
ACT = np.concatenate([RNG.standard_normal(4000), RNG.standard_normal(40) * 8]).astype(np.float32)
RELU = np.maximum(RNG.standard_normal(3000) * 2 + 0.5, 0).astype(np.float32)


def _fed(obs, x: np.ndarray, batch: int | None = None):
    if batch is None:
        obs.update(x, 0)
    else:
        for i in range(0, x.shape[0], batch):
            obs.update(x[i : i + batch], i)
    return obs


def test_minmax_per_tensor_and_channel() -> None:
    x = RNG.standard_normal((6, 4, 5)).astype(np.float32)
    r = _fed(MinMaxObserver(), x, 2).compute()
    assert (r.rmin, r.rmax) == (float(x.min()), float(x.max()))
    r = _fed(MinMaxObserver(symmetric=True), x).compute()
    a = float(np.abs(x).max())
    assert (r.rmin, r.rmax) == (-a, a)
    obs = _fed(MinMaxObserver(axis=1), x, 1)
    r = obs.compute()
    np.testing.assert_array_equal(r.rmin, x.min(axis=(0, 2)))
    np.testing.assert_array_equal(r.rmax, x.max(axis=(0, 2)))
    assert obs.clip_fraction() == 0.0
    r = _fed(MinMaxObserver(axis=-1), x).compute()
    np.testing.assert_array_equal(r.rmax, x.max(axis=(0, 1)))


def test_minmax_moving_average_reference() -> None:
    x = RNG.standard_normal((10, 8)).astype(np.float32) * np.arange(1, 11)[:, None]
    c = 0.3
    m_lo, m_hi = float(x[0].min()), float(x[0].max())
    for s in range(1, 10):
        m_lo += c * (float(x[s].min()) - m_lo)
        m_hi += c * (float(x[s].max()) - m_hi)
    for batch in (1, 3, 10):
        obs = _fed(MinMaxObserver(moving_average=True, averaging_constant=c), x, batch)
        r = obs.compute()
        assert r.rmin == pytest.approx(m_lo, rel=1e-12) and r.rmax == pytest.approx(m_hi, rel=1e-12)
        brute = np.mean((x < r.rmin) | (x > r.rmax))
        assert abs(obs.clip_fraction() - brute) < 0.02
    with pytest.raises(ValueError):
        MinMaxObserver(moving_average=True).merge(MinMaxObserver(moving_average=True))


@pytest.mark.parametrize("symmetric", [False, True])
def test_percentile_against_references(symmetric: bool) -> None:
    obs = _fed(PercentileObserver(percentile=99.9, symmetric=symmetric, num_bins=256), ACT, 333)
    r = obs.compute()
    if symmetric:
        a = np.abs(ACT)
        w, first, counts = ref_histogram(a, 256, True)
        t = ref_percentile(counts, first, w, 0.0, float(a.max()), 0.999)
        assert (r.rmin, r.rmax) == pytest.approx((-t, t), rel=1e-12)
        assert abs(t - np.percentile(a, 99.9)) <= 2 * w
        brute_clip = np.mean(a > t)
    else:
        w, first, counts = ref_histogram(ACT, 256, False)
        lo_ref = ref_percentile(counts, first, w, float(ACT.min()), float(ACT.max()), 0.0005)
        hi_ref = ref_percentile(counts, first, w, float(ACT.min()), float(ACT.max()), 0.9995)
        assert (r.rmin, r.rmax) == pytest.approx((lo_ref, hi_ref), rel=1e-12)
        assert abs(r.rmin - np.percentile(ACT, 0.05)) <= 2 * w
        assert abs(r.rmax - np.percentile(ACT, 99.95)) <= 2 * w
        brute_clip = np.mean((ACT < r.rmin) | (ACT > r.rmax))
    assert obs.clip_fraction() == pytest.approx(brute_clip, abs=5e-4)


def _kl_against_reference(counts: np.ndarray, levels: int) -> tuple[np.ndarray, list[int], np.ndarray]:
    """`kl_divergences` asserted equal to the direct definition (same candidates, same infinities, finite values
    to 1e-7); returns (kl, reference candidates, reference values)."""
    cands, kl = kl_divergences(counts, levels)
    ref_c, ref_values = ref_kl(counts, levels)
    assert cands.tolist() == ref_c
    ref_arr = np.array(ref_values)
    assert np.array_equal(np.isinf(kl), np.isinf(ref_arr))
    fin = np.isfinite(ref_arr)
    np.testing.assert_allclose(kl[fin], ref_arr[fin], rtol=1e-7, atol=1e-10)
    return kl, ref_c, ref_arr


@pytest.mark.parametrize(("num_bins", "levels"), [(256, 16), (2048, 128)])
def test_kl_matches_slow_reference(num_bins: int, levels: int) -> None:
    a = np.abs(ACT)
    w, first, counts = ref_histogram(a, num_bins, True)
    assert first == 0
    kl, ref_c, ref_arr = _kl_against_reference(counts, levels)
    best_ref = int(np.argmin(ref_arr))
    obs = _fed(EntropyObserver(num_bins=num_bins, num_levels=levels, symmetric=True), ACT, 1000)
    t = obs.compute().rmax
    # same threshold, or a numerically tied one
    t_ref = min(ref_c[best_ref] * w, float(a.max()))
    assert t == t_ref or kl[round(t / w) - levels] <= ref_arr[best_ref] + 1e-9


@settings(max_examples=60, deadline=None)
@given(st.integers(130, 700), st.sampled_from([0.02, 0.1, 0.4]), st.integers(0, 2**32 - 1),
       st.sampled_from([8, 32, 128]))
def test_kl_on_sparse_rows_matches_slow_reference(n: int, density: float, seed: int, levels: int) -> None:
    """A small tensor's row is mostly empty bins; only candidates ending on an occupied bin are computed there
    (the others are +inf by definition): every candidate's KL still equals the direct definition."""
    rng = np.random.default_rng(seed)
    counts = ((rng.random(n) < density) * rng.integers(1, 40, n)).astype(np.int64)
    counts[rng.integers(0, n)] += 1
    _kl_against_reference(counts, levels)


def test_entropy_searches_from_the_data_not_from_zero() -> None:
    """Data bounded away from 0 (a pooled ReLU output): a candidate keeping one occupied bin has KL = 0 whatever it
    clips; the search starts num_levels bins past the first occupied bin (regression: 100% clipped on resnet50)."""
    x = np.random.default_rng(7).uniform(0.3, 3.6, 20000).astype(np.float32)
    obs = _fed(EntropyObserver(num_bins=2048, num_levels=128), x, 5000)
    r = obs.compute()
    assert obs.clip_fraction() < 0.01 and r.rmax > 3.3
    w, first, counts = ref_histogram(x, 2048, True)
    occupied = int(np.flatnonzero(counts)[0])
    assert first == 0 and occupied > 128  # an |x| histogram starts at 0; the data start far above
    cands, kl = ref_kl(counts, 128, start=occupied + 128)
    assert cands[0] == occupied + 128
    assert r.rmax == min(cands[int(np.argmin(kl))] * w, float(x.max()))
    # the degenerate candidate the old search picked: a single occupied bin kept, KL exactly 0
    degenerate, kl_all = ref_kl(counts, 128)
    assert kl_all[degenerate.index(occupied + 1)] == pytest.approx(0.0, abs=1e-12)


def test_entropy_relu_output_is_not_dragged_down_by_its_zeros() -> None:
    """Half of ReLU(N(0, 1)) is exactly 0; the threshold is that of the positive half alone."""
    x = np.random.default_rng(8).standard_normal(400_000).astype(np.float32)
    relu = np.maximum(x, 0)
    obs = _fed(EntropyObserver(), relu, 100_000)
    positive = _fed(EntropyObserver(), relu[relu > 0], 100_000)
    assert obs.compute().rmax == positive.compute().rmax
    assert obs.clip_fraction() < 1e-4  # the zero spike used to clip at 2.0: 2.3% of the values


_finite = st.floats(-50, 50, allow_nan=False, width=32).filter(lambda v: v != 0)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(_finite, min_size=20, max_size=300), zeros=st.integers(1, 2000))
def test_exact_zeros_never_move_entropy_or_mse(values: list[float], zeros: int) -> None:
    """0 quantizes exactly at any scale: adding exact zeros leaves the searched thresholds where they were."""
    x = np.array(values, dtype=np.float32)
    with_zeros = np.concatenate([x, np.zeros(zeros, np.float32)])
    cases = [("entropy", {"num_bins": 128, "num_levels": 16}), ("mse", {"num_bins": 128, "symmetric": True})]
    if x.min() < 0 < x.max():  # an asymmetric grid depends on [min, max], which zeros then leave alone
        cases.append(("mse", {"num_bins": 128, "dtype": "uint8"}))
    for method, opts in cases:
        a = _fed(make_observer(method, "t", **opts), x).compute()
        b = _fed(make_observer(method, "t", **opts), with_zeros, 97).compute()
        assert (a.rmin, a.rmax) == (b.rmin, b.rmax), (method, opts)


def test_entropy_nonnegative_tensor_gets_zero_lower_bound() -> None:
    r = _fed(EntropyObserver(num_bins=512, num_levels=32), RELU, 500).compute()
    assert r.rmin == 0.0 and 0 < r.rmax <= float(RELU.max())


def test_mse_against_references() -> None:
    obs = _fed(MseObserver(dtype="int8", symmetric=True, num_bins=128, num_candidates=64), ACT, 999)
    r = obs.compute()
    a = np.abs(ACT)
    w, first, counts = ref_histogram(a, 128, True)
    ref = ref_mse_symmetric(a, counts, first, w, 127.0, 64)
    best_t = min(ref, key=lambda p: p[1])[0]
    assert r.rmax == pytest.approx(best_t, rel=1e-12) and r.rmin == -r.rmax
    # the histogram model picks a range whose true fake-quant MSE is close to the best candidate's
    true = [true_fake_quant_mse(ACT.astype(np.float64), -t, t, 254) for t, _ in ref]
    assert true_fake_quant_mse(ACT.astype(np.float64), -r.rmax, r.rmax, 254) <= 1.15 * min(true)
    assert r.rmax < float(a.max())  # outliers clipped


def test_mse_asymmetric_true_error() -> None:
    x = np.concatenate([RELU, -RELU[:50] * 0.1]).astype(np.float32)
    obs = _fed(MseObserver(dtype="uint8", num_bins=512, num_candidates=128), x, 400)
    r = obs.compute()
    lo0, hi0 = min(float(x.min()), 0.0), float(x.max())
    true = [true_fake_quant_mse(x.astype(np.float64), lo0 * k / 128, hi0 * k / 128, 255) for k in range(1, 129)]
    assert true_fake_quant_mse(x.astype(np.float64), r.rmin, r.rmax, 255) <= 1.15 * min(true)
    row = HistogramRow(np.array([0, 5, 0], dtype=np.int64), 0, 1.0, 1.2, 1.7)
    (a, b), _ = mse_asymmetric(row, 255, 8)
    assert a == 0.0 and 1.0 < b <= 1.7


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy", "mse"])
def test_per_channel_equals_per_tensor_per_channel(method: str) -> None:
    x = RNG.standard_normal((50, 3, 7)).astype(np.float32) * np.array([1.0, 0.01, 100.0])[None, :, None]
    opts = {"num_bins": 128} if method != "minmax" else {}
    if method == "entropy":
        opts["num_levels"] = 16
    r = _fed(make_observer(method, "t", 1, **opts), x, 9).compute()
    for c in range(3):
        rc = _fed(make_observer(method, "t", None, **opts), x[:, c], 9).compute()
        assert (r.rmin[c], r.rmax[c]) == (rc.rmin, rc.rmax)


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy", "mse"])
def test_zero_and_constant_tensors_give_valid_scales(method: str) -> None:
    for value in (0.0, 2.5, -1.0):
        obs = _fed(make_observer(method, "z"), np.full((4, 4), value, dtype=np.float32), 1)
        r = obs.compute()
        assert r.rmin <= r.rmax
        for sym in (False, True):
            scale, _ = compute_scale_zero_point(r.rmin, r.rmax, QuantSpec(dtype="uint8", symmetric=sym))
            assert np.isfinite(scale) and scale > 0
        assert obs.clip_fraction() == pytest.approx(0.0, abs=1e-12)
    assert make_observer(method).compute().rmax == 0.0  # nothing observed


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy", "mse"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_raises_data_error(method: str, bad: float) -> None:
    obs = make_observer(method, "conv1_out")
    obs.update(np.ones(4, dtype=np.float32), 0)
    x = np.ones(4, dtype=np.float32)
    x[2] = bad
    with pytest.raises(DataError, match=r"conv1_out.*sample 17"):
        obs.update(x, 17)


def test_channel_mismatch_and_bad_options() -> None:
    obs = MinMaxObserver("t", axis=1)
    obs.update(np.ones((2, 3)), 0)
    with pytest.raises(DataError, match="channels"):
        obs.update(np.ones((2, 4)), 1)
    with pytest.raises(ValueError, match="unknown calibration method"):
        make_observer("kl")
    with pytest.raises(ValueError, match="invalid options"):
        make_observer("entropy", bins=12)


obs_cases = st.sampled_from(
    [
        ("minmax", {}),
        ("minmax", {"symmetric": True}),
        ("minmax", {"moving_average": True, "averaging_constant": 0.2}),
        ("percentile", {"num_bins": 64, "percentile": 99.0}),
        ("percentile", {"num_bins": 64, "percentile": 95.0, "symmetric": True}),
        ("entropy", {"num_bins": 64, "num_levels": 8}),
        ("mse", {"num_bins": 64, "num_candidates": 32}),
        ("mse", {"num_bins": 64, "num_candidates": 32, "symmetric": True, "dtype": "int4"}),
    ]
)


@settings(max_examples=60, deadline=None)
@given(
    case=obs_cases,
    data=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=7, max_size=120),
    per_channel=st.booleans(),
)
def test_batching_invariance(case: tuple[str, dict], data: list[float], per_channel: bool) -> None:
    method, opts = case
    n = len(data) // 7 * 7
    x = np.array(data[:n], dtype=np.float32).reshape(-1, 7)
    axis = 1 if per_channel else None
    results = []
    for batch in (1, 7, x.shape[0]):
        obs = _fed(make_observer(method, "t", axis, **opts), x, batch)
        r = obs.compute()
        results.append((np.asarray(r.rmin), np.asarray(r.rmax), obs.clip_fraction()))
    for other in results[1:]:
        np.testing.assert_allclose(other[0], results[0][0], rtol=1e-12, atol=0)
        np.testing.assert_allclose(other[1], results[0][1], rtol=1e-12, atol=0)
        assert other[2] == pytest.approx(results[0][2], abs=1e-12)
    if not opts.get("moving_average"):
        a = make_observer(method, "t", axis, **opts)
        b = make_observer(method, "t", axis, **opts)
        _fed(a, x[: x.shape[0] // 2])
        _fed(b, x[x.shape[0] // 2 :])
        a.merge(b)
        r = a.compute()
        np.testing.assert_allclose(np.asarray(r.rmin), results[0][0], rtol=1e-12, atol=0)
        np.testing.assert_allclose(np.asarray(r.rmax), results[0][1], rtol=1e-12, atol=0)
