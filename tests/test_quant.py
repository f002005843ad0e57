"""Tests of qgraph.quant.math against hand-computed values, brute-force loops and onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from qgraph.quant.math import (
    MIN_SCALE,
    ActivationRange,
    QuantDtype,
    QuantSpec,
    compute_scale_zero_point,
    dequantize,
    dtype_range,
    fake_quantize,
    matches_codes,
    quantize,
    quantize_bias,
    symmetric_zero_point,
)

SMALL_TYPES = [
    QuantDtype.INT8,
    QuantDtype.UINT8,
    QuantDtype.INT16,
    QuantDtype.UINT16,
    QuantDtype.INT4,
    QuantDtype.UINT4,
]


@pytest.mark.parametrize(
    ("dtype", "narrow", "reduce", "expected"),
    [
        ("int8", False, False, (-128, 127)),
        ("int8", True, False, (-127, 127)),
        ("int8", False, True, (-64, 63)),
        ("uint8", False, False, (0, 255)),
        ("uint8", True, False, (0, 254)),
        ("uint8", False, True, (0, 127)),
        ("int16", False, False, (-32768, 32767)),
        ("uint16", False, False, (0, 65535)),
        ("int4", False, False, (-8, 7)),
        ("int4", True, False, (-7, 7)),
        ("uint4", False, False, (0, 15)),
        ("int32", False, False, (-(2**31), 2**31 - 1)),
    ],
)
def test_dtype_range(dtype: str, narrow: bool, reduce: bool, expected: tuple[int, int]) -> None:
    assert dtype_range(dtype, narrow, reduce) == expected


def test_dtype_mappings() -> None:
    assert QuantDtype.INT8.onnx_type == TensorProto.INT8
    assert QuantDtype.UINT4.onnx_type == TensorProto.UINT4
    assert QuantDtype.INT4.numpy_dtype == np.int8
    assert QuantDtype.UINT16.numpy_dtype == np.uint16
    assert symmetric_zero_point("uint8") == 128
    assert symmetric_zero_point("uint16") == 32768
    assert symmetric_zero_point("int8") == 0
    assert symmetric_zero_point("uint8", narrow=True) == 127


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        QuantSpec(per_channel=True)
    with pytest.raises(ValueError):
        QuantSpec(axis=0)
    spec = QuantSpec(dtype="int8", symmetric=True, per_channel=True, axis=0, narrow_range=True)
    assert spec.qrange == (-127, 127)


def test_scale_zero_point_known_values() -> None:
    s, z = compute_scale_zero_point(-1.0, 3.0, QuantSpec(dtype="uint8"))
    assert s == np.float32(4.0 / 255.0)
    assert int(z) == 64  # round(0 + 1 / (4/255)) = round(63.75)
    assert z.dtype == np.uint8
    s, z = compute_scale_zero_point(-2.0, 5.0, QuantSpec(dtype="int8", symmetric=True))
    assert s == np.float32(5.0 / 127.0) and int(z) == 0
    s, z = compute_scale_zero_point(-2.0, 5.0, QuantSpec(dtype="uint8", symmetric=True))
    assert s == np.float32(5.0 / 127.0) and int(z) == 128
    # range not containing zero is extended to include it
    s, z = compute_scale_zero_point(2.0, 4.0, QuantSpec(dtype="uint8"))
    assert s == np.float32(4.0 / 255.0) and int(z) == 0
    s, z = compute_scale_zero_point(-4.0, -2.0, QuantSpec(dtype="int8"))
    assert s == np.float32(4.0 / 255.0) and int(z) == 127
    # zero range: scale 1, zp = qmin (0 maps to zp exactly)
    s, z = compute_scale_zero_point(0.0, 0.0, QuantSpec(dtype="int8"))
    assert s == 1.0 and int(z) == -128
    # tiny range: floored scale
    s, _ = compute_scale_zero_point(0.0, 1e-20, QuantSpec(dtype="int8"))
    assert s == np.float32(MIN_SCALE)
    with pytest.raises(ValueError):
        compute_scale_zero_point(1.0, 0.0, QuantSpec())
    with pytest.raises(ValueError):
        compute_scale_zero_point(0.0, np.inf, QuantSpec())


def test_per_channel_is_elementwise() -> None:
    rng = np.random.default_rng(0)
    lo = -rng.random(6) * 5
    hi = rng.random(6) * 3
    lo[2] = hi[2] = 0.0
    for sym in (False, True):
        spec = QuantSpec(dtype="uint8", symmetric=sym, per_channel=True, axis=1)
        s, z = compute_scale_zero_point(lo, hi, spec)
        assert s.shape == (6,) and z.shape == (6,)
        for c in range(6):
            sc, zc = compute_scale_zero_point(lo[c], hi[c], QuantSpec(dtype="uint8", symmetric=sym))
            assert s[c] == sc and z[c] == zc
    r = ActivationRange(lo, hi)
    assert r.per_channel and not ActivationRange(0.0, 1.0).per_channel


def _ref_quantize(x: np.ndarray, scale: float, zp: int, qmin: int, qmax: int) -> np.ndarray:
    out = [min(max(round(float(np.float32(v) / np.float32(scale))) + zp, qmin), qmax) for v in x.ravel()]
    return np.array(out).reshape(x.shape)


def test_quantize_brute_force_and_ties() -> None:
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 1000.0, -1000.0, 0.0, 0.49], dtype=np.float32)
    q = quantize(x, 1.0, 0, "int8")
    assert q.tolist() == [0, 2, 2, 0, -2, -2, 127, -128, 0, 0]
    rng = np.random.default_rng(1)
    x = rng.normal(0, 3, size=500).astype(np.float32)
    for dt in SMALL_TYPES:
        qmin, qmax = dtype_range(dt)
        zp = (qmin + qmax) // 2
        np.testing.assert_array_equal(quantize(x, 0.037, zp, dt), _ref_quantize(x, 0.037, zp, qmin, qmax))
    assert dequantize(np.array([3, -2], dtype=np.int8), 0.5, 1).tolist() == [1.0, -1.5]


specs = st.builds(
    QuantSpec,
    dtype=st.sampled_from(SMALL_TYPES),
    symmetric=st.booleans(),
    narrow_range=st.booleans(),
    reduce_range=st.booleans(),
)
finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs, a=finite, b=finite, fracs=st.lists(st.floats(0, 1), min_size=1, max_size=20))
def test_roundtrip_properties(spec: QuantSpec, a: float, b: float, fracs: list[float]) -> None:
    rmin, rmax = min(a, b), max(a, b)
    scale, zp = compute_scale_zero_point(rmin, rmax, spec)
    qmin, qmax = spec.qrange
    assert scale > 0 and np.isfinite(scale)
    assert qmin <= int(zp) <= qmax  # zero point inside the (narrow/reduced) range
    assert int(quantize(np.float32(0.0), scale, zp, spec.dtype)) == int(zp)  # 0 exactly representable
    assert float(fake_quantize(np.float32(0.0), scale, zp, spec.dtype)) == 0.0
    lo, hi = min(rmin, 0.0), max(rmax, 0.0)
    x = np.array([lo + f * (hi - lo) for f in fracs] + [lo, hi], dtype=np.float32)
    err = np.abs(fake_quantize(x, scale, zp, spec.dtype).astype(np.float64) - x)
    tol = float(scale) / 2 * (1 + 1e-5) + 1e-6 * np.abs(x) + 1e-30
    assert np.all(err <= tol), (err.max(), float(scale))


def _ort_qdq(x: np.ndarray, scale: np.ndarray, zp: np.ndarray, dt: QuantDtype, axis: int | None):
    xi = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))
    qo = helper.make_tensor_value_info("q", TensorProto.INT32, list(x.shape))
    do = helper.make_tensor_value_info("d", TensorProto.FLOAT, list(x.shape))
    dims = list(scale.shape)
    inits = [
        numpy_helper.from_array(scale.astype(np.float32), "s"),
        helper.make_tensor("z", dt.onnx_type, dims, zp.astype(np.int64).ravel().tolist()),
    ]
    kw = {} if axis is None else {"axis": axis}
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["qq"], **kw),
        helper.make_node("Cast", ["qq"], ["q"], to=TensorProto.INT32),
        helper.make_node("DequantizeLinear", ["qq", "s", "z"], ["d"], **kw),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "qdq", [xi], [qo, do], inits), opset_imports=[helper.make_opsetid("", 21)]
    )
    model.ir_version = 10
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    q, d = sess.run(None, {"x": x})
    return q, d


@pytest.mark.parametrize("dt", SMALL_TYPES)
@pytest.mark.parametrize("axis", [None, 1])
def test_matches_onnxruntime(dt: QuantDtype, axis: int | None) -> None:
    rng = np.random.default_rng(7)
    x = (rng.normal(0, 2, size=(5, 4, 6)) * rng.choice([1, 10, 100], size=(5, 4, 6))).astype(np.float32)
    x[0, 0, :4] = [0.0, 0.5, 1.5, -2.5]  # ties at scale 1
    for sym in (False, True):
        if axis is None:
            spec = QuantSpec(dtype=dt, symmetric=sym)
            scale, zp = compute_scale_zero_point(float(x.min()) / 2, float(x.max()) / 2, spec)
        else:
            spec = QuantSpec(dtype=dt, symmetric=sym, per_channel=True, axis=axis)
            xa = np.moveaxis(x, axis, 0).reshape(4, -1)
            scale, zp = compute_scale_zero_point(xa.min(1) / 2, xa.max(1) / 2, spec)
        q_ref, d_ref = _ort_qdq(x, scale, zp, dt, axis)
        q = quantize(x, scale, zp, dt, axis=axis)
        np.testing.assert_array_equal(q.astype(np.int32), q_ref)
        np.testing.assert_array_equal(dequantize(q, scale, zp, axis=axis), d_ref)
    # exact ties: scale 1 -> round half to even, same as ORT
    one = np.ones(4, np.float32) if axis else np.array(1.0, np.float32)
    z0 = np.zeros(one.shape, dtype=dt.numpy_dtype)
    q_ref, _ = _ort_qdq(x, one, z0, dt, axis)
    np.testing.assert_array_equal(quantize(x, one, z0, dt, axis=axis).astype(np.int32), q_ref)


def test_quantize_bias_regular() -> None:
    rng = np.random.default_rng(3)
    bias = rng.normal(0, 1, 8).astype(np.float32)
    w_scale = (rng.random(8) * 0.01 + 1e-3).astype(np.float32)
    res = quantize_bias(bias, np.float32(0.02), w_scale)
    scale_ref = (np.float32(0.02) * w_scale).astype(np.float32)
    assert res.values.dtype == np.int32
    np.testing.assert_array_equal(res.scale, scale_ref)
    np.testing.assert_array_equal(
        res.values,
        np.array([round(b / s) for b, s in zip(bias.astype(float), scale_ref.astype(float), strict=True)]),
    )
    assert not res.adjusted.any()
    np.testing.assert_array_equal(res.weight_scale, w_scale)


def test_quantize_bias_tiny_scale_raises_weight_scale() -> None:
    bias = np.array([100.0, 0.5, -3.0e3, 0.0], dtype=np.float32)
    w_scale = np.array([1e-12, 1e-3, 1e-12, 1e-30], dtype=np.float32)
    res = quantize_bias(bias, 1e-3, w_scale)
    assert res.adjusted.tolist() == [True, False, True, True]
    assert np.all(np.abs(res.values.astype(np.int64)) <= 2**31 - 1)
    assert res.weight_scale[1] == w_scale[1]
    np.testing.assert_array_equal(res.scale, (np.float32(1e-3) * res.weight_scale).astype(np.float32))
    # raised to (about) the smallest scale that fits: the bias uses almost the full int32 range
    assert abs(int(res.values[0])) > 2**31 * 0.999 and abs(int(res.values[2])) > 2**31 * 0.999
    assert np.all(res.scale >= MIN_SCALE**2)
    # dequantized bias is still accurate to a relative 1e-9
    np.testing.assert_allclose(res.values[:3] * res.scale[:3].astype(np.float64), bias[:3], rtol=1e-6)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(SMALL_TYPES),
    rows=st.integers(1, 9),
    cols=st.integers(1, 7),
    axis=st.sampled_from([None, 0, 1]),
    magnitude=st.floats(1e-3, 1e6),
    seed=st.integers(0, 2**16),
)
def test_quantize_slabs_equal_the_float64_formula(
    dtype: QuantDtype, rows: int, cols: int, axis: int | None, magnitude: float, seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The in-place float32 slab path gives exactly ``clip(rint(float32(x / s)) + zp)`` computed in float64, for
    slabs smaller than the tensor (several chunks) and values far outside the integer range."""
    import qgraph.quant.math as quant

    monkeypatch.setattr(quant, "QUANTIZE_CHUNK", 2 * cols)  # two rows per slab: exercises chunk boundaries
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * magnitude).astype(np.float32)
    qmin, qmax = dtype_range(dtype)
    channels = x.shape[axis] if axis is not None else 1
    scale = (rng.random(channels) * 0.5 + 1e-3).astype(np.float32)
    zp = rng.integers(qmin, qmax + 1, channels)
    if axis is None:
        scale, zp = scale[0], zp[0]
    shape = [1, 1]
    if axis is not None:
        shape[axis] = channels
    s = np.reshape(scale, shape) if axis is not None else scale
    z = np.reshape(zp, shape) if axis is not None else zp
    expected = np.clip(np.rint(x / s).astype(np.float64) + z, qmin, qmax)
    got = quantize(x, scale, zp, dtype, axis)
    assert got.dtype == dtype.numpy_dtype and got.shape == x.shape
    np.testing.assert_array_equal(got.astype(np.float64), expected)


@given(seed=st.integers(0, 2**16), channels=st.integers(1, 8), factor=st.floats(1.05, 3.0))
@settings(max_examples=40, deadline=None)
def test_matches_codes_accepts_the_quantized_weight_and_refuses_a_rescaled_one(seed: int, channels: int,
                                                                               factor: float) -> None:
    """The weight that was quantized matches its codes (nearest and floor/ceil rounding); the same weight with
    every channel scaled by ``factor`` >= 1.05 (a BatchNorm fused or an equalization after it) does not."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((channels, 4, 3, 3)).astype(np.float32)
    spec = QuantSpec(dtype=QuantDtype.INT8, symmetric=True, per_channel=True, axis=0)
    absmax = np.abs(w).reshape(channels, -1).max(axis=1)
    scale, zp = compute_scale_zero_point(-absmax, absmax, spec)
    codes = quantize(w, scale, zp, QuantDtype.INT8, 0)
    assert matches_codes(w, codes, scale, zp, 0, steps=0.51)
    floor = np.clip(np.floor(w / scale.reshape(-1, 1, 1, 1)), -127, 127).astype(np.int8)
    assert matches_codes(w, floor, scale, zp, 0)  # floor/ceil rounding (AdaRound) is within one step
    assert not matches_codes(w * np.float32(factor), codes, scale, zp, 0)
    assert not matches_codes(w[:, :2], codes, scale, zp, 0)  # another shape
