"""``method: auto``: the expected-error model against fake quantization, the choice, and its invariances."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph.calibrate import AutoObserver, TensorCalibration, make_observer, read_ranges, write_ranges
from qgraph.calibrate.auto import fold_abs
from qgraph.calibrate.histogram import AlignedHistogram, HistogramRow
from qgraph.calibrate.search import _error_antiderivative, expected_error
from qgraph.quant.math import QuantSpec, compute_scale_zero_point, fake_quantize

SPECS = [QuantSpec(dtype="uint8"), QuantSpec(dtype="int8"), QuantSpec(dtype="int8", symmetric=True),
         QuantSpec(dtype="uint8", symmetric=True)]


def _fed(obs: AutoObserver, x: np.ndarray, batch: int | None = None) -> AutoObserver:
    flat = np.asarray(x, np.float32).ravel()
    step = batch or max(flat.size, 1)
    for i in range(0, flat.size, step):
        obs.update(flat[i:i + step])
    return obs


def _true_error(x: np.ndarray, lo: float, hi: float, spec: QuantSpec) -> float:
    s, z = compute_scale_zero_point(lo, hi, spec)
    return float(np.mean((x.astype(np.float64) - fake_quantize(x, s, z, spec.dtype)) ** 2))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.dtype.value}-{'sym' if s.symmetric else 'asym'}")
def test_expected_error_matches_fake_quantization(spec: QuantSpec) -> None:
    """The histogram's E[(x - Q(x))^2] equals numpy fake quantization to within 1% for clipping and rounding."""
    rng = np.random.default_rng(0)
    x = rng.standard_t(3, 400_000).astype(np.float32)
    x[:5000] = 0.0
    h = AlignedHistogram(1, 2048)
    h.update(x.reshape(1, -1))
    lo = np.array([x.min(), -6.0, -2.0, -0.3])
    hi = np.array([x.max(), 6.0, 3.0, 0.5])
    est = expected_error(h.row(0), lo, hi, spec)
    true = np.array([_true_error(x, a, b, spec) for a, b in zip(lo, hi, strict=True)])
    np.testing.assert_allclose(est, true, rtol=0.01)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(SPECS), st.sampled_from([0.01, 0.1, 0.45]))
def test_expected_error_of_a_sparse_row_is_the_dense_sum(seed: int, spec: QuantSpec, density: float) -> None:
    """Rows with most bins empty (small tensors) evaluate the antiderivative only at occupied bins' edges: the
    result is bit for bit the dense sum over every bin."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(64, 2048))
    counts = ((rng.random(n) < density) * rng.integers(1, 30, n)).astype(np.int64)
    counts[[0, -1]] += 1
    first, width = int(rng.integers(-n, 1)), float(2.0 ** rng.integers(-10, 2))
    row = HistogramRow(counts, first, width, (first + 0.25) * width, (first + n - 0.25) * width)
    assert 2 * np.count_nonzero(counts) < n or density == 0.45
    lo = np.minimum(row.lo * rng.uniform(0.3, 1.0, 5), 0.0)
    hi = np.maximum(row.hi * rng.uniform(0.3, 1.0, 5), 1e-3)
    got = expected_error(row, lo, hi, spec)
    s32, zp = compute_scale_zero_point(lo, hi, spec)
    s = s32.astype(np.float64)[:, None]
    low, up = (spec.qrange[0] - zp.astype(np.float64))[:, None], (spec.qrange[1] - zp.astype(np.float64))[:, None]
    edges = np.clip(row.edges(), row.lo, row.hi)[None, :]
    phi = _error_antiderivative(edges, s, low, up)
    per_bin = (phi[:, 1:] - phi[:, :-1]) / (edges[:, 1:] - edges[:, :-1])
    dense = np.sum(counts[None, :] * np.maximum(per_bin, 0.0), axis=1) / row.total
    assert np.array_equal(got, dense)


def test_uniform_data_keeps_minmax_and_outliers_do_not() -> None:
    rng = np.random.default_rng(1)
    uniform = _fed(AutoObserver(), rng.uniform(-1.0, 3.0, 200_000))
    assert uniform.choice().winner == "minmax"  # type: ignore[union-attr]
    heavy = np.concatenate([rng.standard_normal(200_000), [60.0, -45.0, 80.0]])
    obs = _fed(AutoObserver(), heavy)
    c = obs.choice()
    assert c is not None and c.winner.split(":")[0] in ("percentile", "mse")
    # E[err^2] weighs the 3 clipped outliers' squared distance against the rounding of 200k values: both count
    assert c.errors[c.winner] < 0.75 * c.errors["minmax"] and c.gain_db > 1.2
    r = obs.compute()
    assert r.rmax < 70 and obs.clip_fraction() > 0  # the outliers are clipped


def test_half_normal_entropy_candidate_reaches_its_tail() -> None:
    """ReLU(N(0, 1)): half exact zeros; the entropy candidate sits near the data's max, not at ~2."""
    x = np.maximum(np.random.default_rng(2).standard_normal(1_000_000), 0).astype(np.float32)
    c = _fed(AutoObserver(), x, 100_000).choice()
    assert c is not None
    assert c.ranges["entropy"][1] > 0.75 * float(x.max()) and c.ranges["entropy"][1] > 3.5
    assert c.ranges["entropy"][0] == 0.0


_values = st.lists(st.floats(-50, 50, allow_nan=False, width=32).filter(lambda v: v != 0), min_size=30, max_size=300)


@settings(max_examples=25, deadline=None)
@given(values=_values, symmetric=st.booleans(), dtype=st.sampled_from(["uint8", "int8"]))
def test_choice_has_the_smallest_error(values: list[float], symmetric: bool, dtype: str) -> None:
    """With min_gain 0 the chosen range's error is the minimum over candidates; with min_gain g it is at most
    min / (1 - g), and minmax is only displaced by a gain above g."""
    x = np.array(values, np.float32)
    exact = _fed(AutoObserver(dtype=dtype, symmetric=symmetric, min_gain=0.0, num_bins=256, num_levels=32), x)
    c = exact.choice()
    assert c is not None and c.errors[c.winner] == min(c.errors.values())
    r = exact.compute()
    assert (r.rmin, r.rmax) == c.ranges[c.winner]
    lazy = _fed(AutoObserver(dtype=dtype, symmetric=symmetric, min_gain=0.05, num_bins=256, num_levels=32), x)
    d = lazy.choice()
    assert d is not None and d.errors[d.winner] <= min(d.errors.values()) / 0.95 * (1 + 1e-12)
    if d.winner != "minmax":
        assert d.errors[d.winner] < 0.95 * d.errors["minmax"]


@settings(max_examples=20, deadline=None)
@given(values=_values, batch=st.integers(1, 40), symmetric=st.booleans())
def test_choice_is_independent_of_batching_and_merging(values: list[float], batch: int, symmetric: bool) -> None:
    x = np.array(values, np.float32)
    opts = {"symmetric": symmetric, "num_bins": 256, "num_levels": 32}
    whole = _fed(AutoObserver(**opts), x)
    parts = _fed(AutoObserver(**opts), x, batch)
    a, b = AutoObserver(**opts), _fed(AutoObserver(**opts), x[len(x) // 2:])
    _fed(a, x[: len(x) // 2])
    a.merge(b)
    for other in (parts, a):
        assert (other.compute().rmin, other.compute().rmax) == (whole.compute().rmin, whole.compute().rmax)
        assert other.choice() == whole.choice()


@settings(max_examples=20, deadline=None)
@given(values=_values, zeros=st.integers(1, 3000), symmetric=st.booleans())
def test_exact_zeros_never_change_the_choice(values: list[float], zeros: int, symmetric: bool) -> None:
    """0 is on every grid: a spike of exact zeros (a ReLU's) moves no candidate and no decision."""
    x = np.array(values, np.float32)
    if not symmetric and not x.min() < 0 < x.max():
        x = np.concatenate([x, -x[:1]])  # asymmetric grids depend on [min, max]: keep 0 inside it
    opts = {"symmetric": symmetric, "num_bins": 256, "num_levels": 32}
    a = _fed(AutoObserver(**opts), x)
    b = _fed(AutoObserver(**opts), np.concatenate([x, np.zeros(zeros, np.float32)]), 97)
    ca, cb = a.choice(), b.choice()
    assert ca is not None and cb is not None
    assert ca.winner == cb.winner and ca.ranges == cb.ranges
    assert (a.compute().rmin, a.compute().rmax) == (b.compute().rmin, b.compute().rmax)


def test_fold_abs_is_the_abs_histogram_on_the_same_grid() -> None:
    x = np.random.default_rng(3).normal(0.5, 2.0, 50_000)
    signed = AlignedHistogram(1, 512)
    signed.update(x.reshape(1, -1))
    folded = fold_abs(signed.row(0))
    width = folded.width
    direct = np.bincount(np.floor(np.abs(x) / width).astype(np.int64), minlength=folded.counts.size)
    np.testing.assert_array_equal(folded.counts, direct[: folded.counts.size])
    assert folded.first == 0 and folded.hi == float(np.abs(x).max())


@pytest.mark.parametrize("value", [0.74203104, -3.5e4, 1e-30])
def test_a_constant_far_from_zero_is_calibrated_in_its_own_bins(value: float) -> None:
    """A tensor holding one value (a transformer's attention mask) has a grid so fine that its bin index is near
    1e9: folding to |x| must count from the occupied bin, not allocate every empty bin down to 0 (it raised
    "array is too big" in every static CNN recipe run on a transformer)."""
    x = np.float32(value)
    r = _fed(AutoObserver(), np.full(64, x)).compute()
    assert r.rmin == r.rmax == pytest.approx(float(x), rel=1e-6)
    hist = AlignedHistogram(1, 512)
    hist.update(np.full((1, 64), x))
    folded = fold_abs(hist.row(0))
    assert folded.counts.size <= 2 and int(folded.counts.sum()) == 64 and folded.hi == abs(float(x))
    assert folded.first > 1000  # counted from its own bin, far from bin 0


def test_auto_is_per_tensor_and_checks_its_options() -> None:
    with pytest.raises(ValueError, match="per tensor"):
        make_observer("auto", "t", 1)
    with pytest.raises(ValueError, match="percentiles"):
        make_observer("auto", "t", percentiles=[100.0])
    with pytest.raises(ValueError, match="invalid options"):
        make_observer("auto", "t", percentile=99.9)


def test_ranges_file_records_the_chosen_method(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    obs = _fed(make_observer("auto", "act"), np.concatenate([rng.standard_normal(20_000), [50.0]]))  # type: ignore[arg-type]
    cal = TensorCalibration.from_observer(obs)
    assert cal.choice is not None and cal.chosen_method == cal.choice.winner != "minmax"
    path = write_ranges(tmp_path / "r.json", {"act": cal}, model_fingerprint="f" * 64)
    back = read_ranges(path).tensors["act"]
    assert back.method == "auto" and back.choice == cal.choice and back.chosen_method == cal.chosen_method
