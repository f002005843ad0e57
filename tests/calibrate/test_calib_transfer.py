"""Ranges of tensors read only by an activation (qgraph.calibrate.transfer): where each activation is flat."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph.calibrate.transfer import KINDS, SILU_ARGMIN, Transfer, clip_flat, tolerance
from qgraph.quant.math import QuantDtype, QuantSpec, compute_scale_zero_point

U8 = QuantSpec(dtype=QuantDtype.UINT8, symmetric=False)


def _codes(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    s, z = compute_scale_zero_point(lo, hi, U8)
    s, z = float(np.asarray(s).ravel()[0]), int(np.asarray(z).ravel()[0])
    return np.clip(np.rint(x / s) + z, 0, 255)


def _fake_quant(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    s, z = compute_scale_zero_point(lo, hi, U8)
    return (_codes(x, lo, hi) - int(np.asarray(z).ravel()[0])) * float(np.asarray(s).ravel()[0])


@pytest.mark.parametrize("kind", KINDS)
def test_slope_is_the_derivative(kind: str) -> None:
    f = Transfer(kind, alpha=0.2, beta=0.5, low=0.0, high=6.0)
    x = np.linspace(-9.7, 9.3, 977)  # avoids the kinks of the piecewise ones
    numeric = (f.value(x + 1e-6) - f.value(x - 1e-6)) / 2e-6
    assert np.allclose(f.slope(x), numeric, atol=1e-4)


def _grid(lo: float, hi: float) -> tuple[float, float]:
    s, z = compute_scale_zero_point(lo, hi, U8)
    return float(np.asarray(s).ravel()[0]), float(np.asarray(z).ravel()[0])


def test_tolerance_is_what_still_rounds_to_the_limits_code() -> None:
    assert tolerance(0.0, (0.05, 17.0)) == pytest.approx(0.25 * 0.05)  # 0 is on every grid: a quarter code
    assert tolerance(1.0, _grid(0.0, 1.0)) == pytest.approx(0.25 / 255, rel=1e-4)  # [0, 1]: 1 is code 255
    assert tolerance(1.0, (0.1, 0.0)) == pytest.approx(0.25 * 0.1)
    assert tolerance(1.0, (0.4, 0.0)) == 0.0 and tolerance(-1.0, (0.4, 0.0)) == 0.0  # code 2.5: halfway
    assert tolerance(0.9, (0.4, 0.0)) == pytest.approx(0.5 * (0.5 - 0.25) * 0.4)  # 2.25: a quarter from code 2
    assert tolerance(None, (0.1, 0.0)) == 0.0


def test_flat_bounds_for_given_tolerances() -> None:
    lo, hi = Transfer("SiLU").flat_bounds(0.025, 0.0, 0.25 / 255)
    assert hi == math.inf and lo == pytest.approx(-np.log(1019), abs=1e-9)  # the u8 [0, 1] gate decides: -6.93
    lo_y, _ = Transfer("SiLU").flat_bounds(0.025, 0.0)  # without a quantized gate, SiLU's own output decides
    assert abs(Transfer("SiLU").value(np.array([lo_y]))[0]) == pytest.approx(0.025, rel=1e-6) and lo_y < SILU_ARGMIN
    assert Transfer("SiLU").flat_bounds(0.5, 0.0)[0] == SILU_ARGMIN  # a coarse grid: clip at SiLU's minimum
    slo, shi = Transfer("Sigmoid").flat_bounds(1e-3, 0.0)
    assert Transfer("Sigmoid").value(np.array([slo]))[0] == pytest.approx(1e-3) and shi == math.inf
    tlo, thi = Transfer("Tanh").flat_bounds(0.0, 1e-3)
    assert tlo == -math.inf and 1 - np.tanh(thi) == pytest.approx(1e-3)
    assert Transfer("HardSwish").flat_bounds(0.0, 0.0) == (-3.0, math.inf)  # exactly flat: no tolerance needed
    assert Transfer("HardSigmoid", alpha=0.2, beta=0.5).flat_bounds(0.0, 0.0) == (-2.5, 2.5)
    assert Transfer("Relu").flat_bounds(0.0, 0.0) == (0.0, math.inf)
    assert Transfer("Clip", low=0.0, high=6.0).flat_bounds(0.0, 0.0) == (0.0, 6.0)
    assert Transfer("LeakyRelu", alpha=0.1).flat_bounds(0.1, 0.1) == (-math.inf, math.inf)
    assert Transfer("Clip", low=0.0).limits() == (0.0, None) and Transfer("Tanh").limits() == (-1.0, 1.0)
    with pytest.raises(ValueError, match="unknown activation"):
        Transfer("Gelu")


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["Sigmoid", "Tanh", "HardSwish", "Relu", "SiLU"]),
       st.floats(0.2, 1.0))
def test_the_clip_changes_no_output_code(seed: int, kind: str, out_top: float) -> None:
    """Quantize x on the clipped grid, apply f, quantize f's output on its grid: every value the clip moves (beyond
    the grid's ends) gets the code its exact f(x) gets (the clip costs nothing a quantized reader sees)."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(-15, 8, 4000), rng.normal(0, 2, 4000), rng.normal(9, 4, 2000)])
    f = Transfer(kind)
    y = f.value(x)
    out_lo, out_hi = float(y.min()), float(y.max()) * out_top  # the output grid (possibly clipping its top)
    grid = _grid(out_lo, out_hi)
    c = clip_flat((float(x.min()), float(x.max())), f, U8, grid, _grid(0.0, 1.0) if kind == "SiLU" else None)
    sc, zp = (float(np.asarray(v).ravel()[0]) for v in compute_scale_zero_point(*c.range, U8))
    cut_lo, cut_hi = c.range[0] > x.min(), c.range[1] < x.max()  # the sides the clip moved
    outside = (cut_lo & (x < -zp * sc)) | (cut_hi & (x > (255 - zp) * sc))
    assert c.changed and outside.sum() > 100
    gate = Transfer("Sigmoid").value(_fake_quant(x, *c.range))
    if kind == "SiLU":  # the gate of an integer SiLU is quantized on [0, 1] too: it gets the exact gate's codes
        exact = Transfer("Sigmoid").value(x)
        assert np.array_equal(_codes(gate, 0.0, 1.0)[outside], _codes(exact, 0.0, 1.0)[outside])
    clipped = f.value(_fake_quant(x, *c.range))
    assert np.array_equal(_codes(clipped, out_lo, out_hi)[outside], _codes(y, out_lo, out_hi)[outside])


def test_clip_flat_clips_only_the_flat_side() -> None:
    c = clip_flat((-136.0, 127.0), Transfer("SiLU"), U8, (0.5, 1.0), _grid(0.0, 1.0))
    assert c.range[1] == 127.0 and -6.9266 - 134 / 255 <= c.range[0] <= -6.9266 and c.changed
    assert c.finer == pytest.approx(263 / (127 - c.range[0]), rel=1e-9) and c.finer > 1.9  # ~2x finer step
    s, z = (float(np.asarray(v).ravel()[0]) for v in compute_scale_zero_point(*c.range, U8))
    assert -z * s <= -6.9266  # the grid's end lies on the flat side, its integer zero point included
    assert clip_flat((-2.0, 9.0), Transfer("SiLU"), U8, (0.05, 6.0), _grid(0.0, 1.0)).changed is False  # inside
    lo, hi = clip_flat((-20.0, 30.0), Transfer("Sigmoid"), U8, _grid(0.0, 1.0)).range
    assert -7.0 < lo <= -6.9266 and 6.9266 <= hi < 7.0
    # data entirely on a flat side: the range collapses onto the bound (0 then extends it)
    assert clip_flat((-30.0, -10.0), Transfer("HardSwish"), U8, (0.1, 3.0)).range == (-3.0, -3.0)
