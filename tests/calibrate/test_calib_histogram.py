"""AlignedHistogram: exact equality with a brute-force histogram, batching invariance, merging."""

from __future__ import annotations

import numpy as np
import pytest
from calib_reference import ref_histogram
from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph.calibrate import histogram
from qgraph.calibrate.histogram import AlignedHistogram, required_exponent

values_st = st.lists(st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=200)


def _feed(h: AlignedHistogram, x: np.ndarray, batch: int) -> None:
    for i in range(0, x.size, batch):
        h.update(x[i : i + batch].reshape(1, -1).astype(np.float64))


@pytest.mark.parametrize("include_zero", [False, True])
@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e5])
def test_matches_brute_force(include_zero: bool, scale: float) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(3000) * scale + 3 * scale).astype(np.float32)
    if include_zero:
        x = np.abs(x)
    for batch in (1, 97, 3000):
        h = AlignedHistogram(1, 64, include_zero=include_zero)
        _feed(h, x if batch != 1 else x[:300], batch)
        data = x if batch != 1 else x[:300]
        w, first, counts = ref_histogram(data, 64, include_zero)
        row = h.row(0)
        assert row.width == w and row.first == first
        np.testing.assert_array_equal(row.counts, counts)
        assert row.lo == min(float(data.min()), 0.0 if include_zero else np.inf) and row.hi == float(data.max())


def test_constant_and_zero_data() -> None:
    h = AlignedHistogram(1, 16)
    h.update(np.zeros((1, 10)))
    r = h.row(0)
    assert r.total == 10 and r.lo == r.hi == 0.0
    h = AlignedHistogram(1, 16)
    h.update(np.full((1, 5), 3.25))
    r = h.row(0)
    w, first, counts = ref_histogram(np.full(5, 3.25), 16, False)
    assert (r.width, r.first, r.counts.tolist()) == (w, first, counts.tolist())


def test_zeros_then_tiny_values_regression() -> None:
    """An all-zero first batch must not pin the grid (found by hypothesis)."""
    x = np.array([0.0] * 13 + [1.13e-33], dtype=np.float32)
    one = AlignedHistogram(1, 64)
    _feed(one, x, 1)
    whole = AlignedHistogram(1, 64)
    _feed(whole, x, 14)
    w, first, counts = ref_histogram(x, 64, False)
    for h in (one, whole):
        r = h.row(0)
        assert (r.width, r.first) == (w, first)
        np.testing.assert_array_equal(r.counts, counts)


def test_required_exponent_is_minimal() -> None:
    rng = np.random.default_rng(1)
    lo = -rng.random(50) * 10.0 ** rng.integers(-20, 20, 50)
    hi = rng.random(50) * 10.0 ** rng.integers(-20, 20, 50)
    k = required_exponent(lo, hi, 128)
    n = np.floor(np.ldexp(hi, -k)) - np.floor(np.ldexp(lo, -k)) + 1
    n_finer = np.floor(np.ldexp(hi, -(k - 1))) - np.floor(np.ldexp(lo, -(k - 1))) + 1
    assert np.all(n <= 128) and np.all(n_finer > 128)


@settings(max_examples=60, deadline=None)
@given(values=st.one_of(values_st, st.lists(st.sampled_from([0.0, -1.5, 2.25]), min_size=1, max_size=50)),
       cut=st.integers(1, 7), include_zero=st.booleans())
def test_batching_and_merge_invariance(values: list[float], cut: int, include_zero: bool) -> None:
    x = np.array(values, dtype=np.float32)
    if include_zero:
        x = np.abs(x)
    whole = AlignedHistogram(2, 32, include_zero)
    whole.update(np.stack([x, -2 * x]).astype(np.float64))
    batched = AlignedHistogram(2, 32, include_zero)
    for i in range(0, x.size, cut):
        part = x[i : i + cut]
        batched.update(np.stack([part, -2 * part]).astype(np.float64))
    a = AlignedHistogram(2, 32, include_zero)
    b = AlignedHistogram(2, 32, include_zero)
    half = x.size // 2
    if half:
        a.update(np.stack([x[:half], -2 * x[:half]]).astype(np.float64))
    b.update(np.stack([x[half:], -2 * x[half:]]).astype(np.float64))
    a.merge(b)
    assert whole.zeros.tolist() == [int(np.count_nonzero(x == 0))] * 2
    for other in (batched, a):
        np.testing.assert_array_equal(other.zeros, whole.zeros)
        np.testing.assert_array_equal(other.k, whole.k)
        np.testing.assert_array_equal(other.first, whole.first)
        np.testing.assert_array_equal(other.counts, whole.counts)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(-30, 6), st.booleans(), st.sampled_from([1, 3]))
def test_float32_data_bins_exactly_as_float64(seed: int, log_scale: float, include_zero: bool, channels: int) -> None:
    """float32 activations are binned in float32 where that is exact (bins no wider than 1): the same counts,
    grids and zeros as the float64 path on the same values, over several updates that regrid."""
    rng = np.random.default_rng(seed)
    h32, h64 = AlignedHistogram(channels, 256, include_zero), AlignedHistogram(channels, 256, include_zero)
    for _ in range(3):
        x = (rng.standard_normal((channels, int(rng.integers(1, 3000)))) * 10.0 ** log_scale).astype(np.float32)
        x[:, : x.shape[1] // 5] = 0.0
        h32.update(x)
        h64.update(x.astype(np.float64))
        log_scale += float(rng.uniform(-1.0, 1.0))
    assert np.array_equal(h32.counts, h64.counts) and np.array_equal(h32.zeros, h64.zeros)
    assert np.array_equal(h32.k, h64.k) and np.array_equal(h32.first, h64.first)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), zero_share=st.floats(0.0, 1.0), log_scale=st.floats(-20, 6),
       batch=st.sampled_from([1, 7, 64, 500]), include_zero=st.booleans(), signed=st.booleans())
def test_zero_heavy_rows_bin_as_brute_force(seed: int, zero_share: float, log_scale: float, batch: int,
                                            include_zero: bool, signed: bool) -> None:
    """Mostly exact zeros (ReLU outputs, masked tensors; +0.0 and -0.0): the zeros are left out of the binning and
    put in 0's bin afterwards; counts, grid and zero count are those of binning every value."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(500) * 2.0**log_scale).astype(np.float32)
    x = x if signed else np.abs(x)
    x[rng.random(500) < zero_share] = 0.0
    x[rng.random(500) < 0.1 * zero_share] = -0.0
    h = AlignedHistogram(1, 64, include_zero=include_zero)
    for i in range(0, x.size, batch):
        h.update(x[i:i + batch].reshape(1, -1))
    w, first, counts = ref_histogram(x, 64, include_zero)
    row = h.row(0)
    assert row.zeros == int(np.count_nonzero(x == 0))
    assert row.width == w and row.first == first
    np.testing.assert_array_equal(row.counts, counts)


@pytest.mark.parametrize("fast_add_at", [True, False])
def test_both_counting_paths_bin_as_brute_force(fast_add_at: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy >= 1.25 counts with ``np.add.at`` in place, older numpy with ``np.bincount``: the same counts."""
    monkeypatch.setattr(histogram, "_FAST_ADD_AT", fast_add_at)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(4000) * 3.0 + 1.0).astype(np.float32)
    h = AlignedHistogram(1, 64)
    multi = AlignedHistogram(3, 64)
    for i in range(0, x.size, 333):
        h.update(x[i:i + 333].reshape(1, -1))
        multi.update(np.stack([x[i:i + 333]] * 3))
    w, first, counts = ref_histogram(x, 64, False)
    for c, hist in ((0, h), (0, multi), (2, multi)):
        row = hist.row(c)
        assert row.width == w and row.first == first
        np.testing.assert_array_equal(row.counts, counts)
