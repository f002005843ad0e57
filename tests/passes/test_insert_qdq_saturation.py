"""u8 x s8 int16 pair saturation (AVX2 VPMADDUBSW): numpy kernel simulation and the pass's analysis."""

from __future__ import annotations

import numpy as np
import onnx
from insert_qdq_helpers import initializer, quantize, with_weights

from qgraph.quant.math import QuantSpec, compute_scale_zero_point
from qgraph.quant.math import quantize as q_array
from qgraph.runtime.kernels.pairs import INT16_MAX, exact_u8s8_matmul, pair_bounds, simulate_u8s8_matmul, vpmaddubsw


def overflow_layer() -> tuple[np.ndarray, np.ndarray]:
    """A linear layer built to overflow: adjacent weights share a sign and sit near the channel max,
    activations are non-negative (after a ReLU) and often near their max."""
    rng = np.random.default_rng(0)
    k, n = 64, 8
    w = rng.uniform(0.6, 1.0, (k, n)).astype(np.float32)
    w *= np.repeat(rng.choice([-1.0, 1.0], (k // 2, n)), 2, axis=0).astype(np.float32)  # pairs share a sign
    x = rng.uniform(0.0, 1.0, (32, k)).astype(np.float32)
    x[:, :8] = 1.0  # some activations at the top of the range
    return w, x


def codes(w: np.ndarray, x: np.ndarray, reduce_range: bool) -> tuple[np.ndarray, np.ndarray]:
    ws = QuantSpec(dtype="int8", symmetric=True, per_channel=True, axis=1, reduce_range=reduce_range)
    s, z = compute_scale_zero_point(w.min(axis=0), w.max(axis=0), ws)
    wq = q_array(w, s, z, "int8", axis=1)
    xs, xz = compute_scale_zero_point(0.0, 1.0, QuantSpec(dtype="uint8"))
    return q_array(x, xs, xz, "uint8"), wq


def test_vpmaddubsw_saturates_pairs() -> None:
    a = np.array([[255, 255, 1, 2]], np.uint8)
    w = np.array([[127, 127, -3, 4]], np.int8)
    assert vpmaddubsw(a, w).tolist() == [[INT16_MAX, 5]]
    assert exact_u8s8_matmul(a, w.T).tolist() == [[64770 + 5]]


def test_8_bit_weights_overflow_and_reduce_range_removes_it() -> None:
    w, x = overflow_layer()
    a8, w8 = codes(w, x, reduce_range=False)
    assert not np.array_equal(simulate_u8s8_matmul(a8, w8), exact_u8s8_matmul(a8, w8))
    top, _ = pair_bounds(w8.T.astype(np.int32), 0, 255)
    assert int(top.max()) > INT16_MAX
    a7, w7 = codes(w, x, reduce_range=True)
    assert int(np.abs(w7).max()) <= 64
    assert np.array_equal(simulate_u8s8_matmul(a7, w7), exact_u8s8_matmul(a7, w7))
    top, bottom = pair_bounds(w7.T.astype(np.int32), 0, 255)
    assert int(top.max()) <= INT16_MAX and int(bottom.min()) >= -INT16_MAX - 1


def _model() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    w, x = overflow_layer()
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    lin (float[1,64] x) => (float[1,8] y) { r = Relu(x)  y = MatMul(r, w) }
    """
    return with_weights(text, {"w": w}), [{"x": row[None]} for row in x]


def test_pass_reports_the_layer_and_avoid_clears_it_per_channel() -> None:
    m, feeds = _model()
    risky = quantize(m, feeds, preset="ort-x86-avx2", saturation="report").records[0].result
    sat = risky.details["saturation"]
    assert sat["layers_analyzed"] == 1 and len(sat["layers_at_risk"]) == 1
    layer = sat["layers_at_risk"][0]
    assert layer["op"] == "MatMul" and layer["weight"] == "w" and layer["worst_pair_sum"] > INT16_MAX
    assert layer["channels_at_risk"] == 8 and "saturation: avoid" in sat["advice"]
    res = quantize(m, feeds, preset="ort-x86-avx2")  # the preset avoids it: the 8 channels' scales raised
    result = res.records[0].result
    assert result.details["saturation"]["layers_at_risk"] == []
    (safe,) = result.details["pair_safe"]
    assert safe["channels"] == 8 and safe["of"] == 8 and 1.0 < safe["max_factor"] <= 2.0
    assert safe["weight_sqnr_db"] - 6.1 < safe["weight_sqnr_pair_safe_db"] < safe["weight_sqnr_db"]
    assert any(d.startswith("saturation: avoid: 1 layer(s)") for d in result.decisions)
    assert int(np.abs(initializer(res.model, "w/q")).max()) > 64  # still 8-bit codes, unlike reduce_range
    # the simulated kernel on the pass's own weights and the real activation codes agrees with exact math
    wq = initializer(res.model, "w/q")
    xs, xz = float(initializer(res.model, "r/scale")), int(initializer(res.model, "r/zero_point"))
    a = np.concatenate([q_array(np.maximum(f["x"], 0), xs, xz, "uint8") for f in feeds])
    assert np.array_equal(simulate_u8s8_matmul(a, wq), exact_u8s8_matmul(a, wq))
    wq8 = initializer(quantize(m, feeds, preset="ort-x86-vnni").model, "w/q")
    assert not np.array_equal(simulate_u8s8_matmul(a, wq8), exact_u8s8_matmul(a, wq8))


def test_vnni_preset_does_not_analyze_by_default() -> None:
    m, feeds = _model()
    assert "saturation" not in quantize(m, feeds, preset="ort-x86-vnni").records[0].result.details
