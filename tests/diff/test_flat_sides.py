"""A Q/DQ pair that clips only where the activation reading it is flat is not charged with that clip
(`qgraph.analysis.diff.flat_sides`): its values there get the same output codes with or without the clip."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qgraph.analysis.diff import attribute
from qgraph.analysis.diff.protos import ModelIndex
from qgraph.analysis.diff.quant_points import PointStats, find_points

C = 4


def _conv_silu_conv(seed: int = 0) -> tuple[list[onnx.TensorProto], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    w = {"w1": rng.normal(0, 1.2, (C, 3, 3, 3)).astype(np.float32), "w2": rng.normal(0, 0.3, (2, C, 1, 1)).astype(
        np.float32)}
    return [numpy_helper.from_array(v, k) for k, v in w.items()], w


def _io() -> tuple[onnx.ValueInfoProto, onnx.ValueInfoProto]:
    return (helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 16, 16]))


def reference() -> onnx.ModelProto:
    """x -> Conv -> SiLU (x * Sigmoid(x), as PyTorch exports it) -> Conv -> y."""
    inits, _ = _conv_silu_conv()
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["g"], name="sig"),
             helper.make_node("Mul", ["c", "g"], ["m"], name="mul"),
             helper.make_node("Conv", ["m", "w2"], ["y"], name="conv2")]
    x, y = _io()
    return helper.make_model(helper.make_graph(nodes, "silu", [x], [y], inits),
                             opset_imports=[helper.make_opsetid("", 17)])


def _qdq(inits: list[onnx.TensorProto], t: str, lo: float, hi: float) -> list[onnx.NodeProto]:
    """u8 QuantizeLinear -> DequantizeLinear of ``t`` over [lo, hi] (scale and zero point added to ``inits``)."""
    s = (hi - lo) / 255.0
    z = int(np.clip(round(-lo / s), 0, 255))
    inits.extend([numpy_helper.from_array(np.array(s, np.float32), f"{t}/s"),
                  numpy_helper.from_array(np.array(z, np.uint8), f"{t}/z")])
    return [helper.make_node("QuantizeLinear", [t, f"{t}/s", f"{t}/z"], [f"{t}/q"], name=f"{t}/q"),
            helper.make_node("DequantizeLinear", [f"{t}/q", f"{t}/s", f"{t}/z"], [f"{t}/dq"], name=f"{t}/dq")]


def quantized(c_low: float, c_high: float = 40.0) -> onnx.ModelProto:
    """The reference with u8 Q/DQ on the conv output (range [c_low, c_high]), the gate ([0, 1]) and the SiLU output
    ([-0.28, c_high]); weights stay float (only activations matter here)."""
    inits, _ = _conv_silu_conv()

    def qdq(t: str, lo: float, hi: float) -> list[onnx.NodeProto]:
        return _qdq(inits, t, lo, hi)

    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv1", pads=[1, 1, 1, 1]), *qdq("c", c_low, c_high),
             helper.make_node("Sigmoid", ["c/dq"], ["g"], name="sig"), *qdq("g", 0.0, 1.0),
             helper.make_node("Mul", ["c/dq", "g/dq"], ["m"], name="mul"), *qdq("m", -0.2785, c_high),
             helper.make_node("Conv", ["m/dq", "w2"], ["y"], name="conv2")]
    x, y = _io()
    return helper.make_model(helper.make_graph(nodes, "silu_qdq", [x], [y], inits),
                             opset_imports=[helper.make_opsetid("", 17)])


def _feeds(n: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(0, 1.0, (1, 3, 16, 16)).astype(np.float32)} for _ in range(n)]


def _conv_out(x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    m = reference()
    m.graph.output.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, None))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(["c"], {"x": x})[0])


@pytest.mark.parametrize(("c_low", "flat"), [(-8.0, True), (-2.0, False)])
def test_a_clip_below_where_silu_is_flat_is_not_counted(c_low: float, flat: bool) -> None:
    points, _ = find_points(ModelIndex.build(reference()), ModelIndex.build(quantized(c_low)))
    p = next(p for p in points if p.tensor == "c")
    assert p.flat == (flat, False)  # the high side carries the signal: never flat for SiLU
    assert next(q for q in points if q.tensor == "m").flat == (False, False)  # read by a Conv
    c = np.concatenate([_conv_out(f["x"]) for f in _feeds()])
    below = float(np.mean(c < c_low))
    assert below > 0.01  # the clip is real on this data
    stats = PointStats(p.channels)
    stats.add(p, c)
    if flat:
        assert stats.clip_fraction() < 0.001 and stats.flat_clipped / c.size == pytest.approx(below, abs=0.002)
    else:
        assert stats.clip_fraction() == pytest.approx(below, abs=0.01) and stats.flat_clipped == 0


def test_what_is_called_flat_changes_no_code_after_the_quantized_silu() -> None:
    """The criterion itself: on the -8 clip, SiLU's output codes (its gate quantized too) are the same with and
    without the clip; on the -2 clip they are not."""
    c = np.concatenate([_conv_out(f["x"]) for f in _feeds()]).astype(np.float64)
    hi = 40.0

    def m_codes(lo: float, clip_low: bool) -> np.ndarray:
        s = (hi - lo) / 255.0
        z = round(-lo / s)
        q = np.rint(c / s) + z
        q = np.clip(q, 0 if clip_low else -np.inf, 255)
        x = (q - z) * s
        gate = np.clip(np.rint(1.0 / (1.0 + np.exp(-x)) * 255.0), 0, 255) / 255.0
        sm = (hi + 0.2785) / 255.0
        return np.asarray(np.clip(np.rint(x * gate / sm) + round(0.2785 / sm), 0, 255))

    assert np.array_equal(m_codes(-8.0, True), m_codes(-8.0, False))
    assert not np.array_equal(m_codes(-2.0, True), m_codes(-2.0, False))


def test_a_flat_clip_is_not_named_as_the_pairs_defect(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the flat side recognised, the pair's local error is its rounding (what ranks it and what its reason
    says); charged with the clip (flat detection off), its Q/DQ SQNR falls by the clipped values' distance and
    its reason blames the range. Measured alone the two agree (the probe does not clip a flat side, and a float
    SiLU moves a value below -8 by under 0.003)."""
    import qgraph.analysis.diff.quant_points as qp

    a, b, feeds = reference(), quantized(-8.0), _feeds()
    flat = next(c for c in attribute(a, b, feeds, exact_top=10, extend_seconds=0).culprits if c.point.tensor == "c")
    monkeypatch.setattr(qp, "flat_sides", lambda *args: (False, False))
    charged = next(c for c in attribute(a, b, feeds, exact_top=10, extend_seconds=0).culprits
                   if c.point.tensor == "c")
    f, ch = flat.to_dict(), charged.to_dict()
    assert f["clip_fraction"] < 0.001 and f["flat_clip_fraction"] > 0.01 and ch["clip_fraction"] > 0.01
    assert "clips" in ch["reason"] and "clips" not in f["reason"], (f["reason"], ch["reason"])
    assert f["rounding_sqnr_db"] > ch["rounding_sqnr_db"] + 10.0
    assert flat.alone_sqnr_db is not None and charged.alone_sqnr_db is not None
    assert abs(flat.alone_sqnr_db - charged.alone_sqnr_db) < 0.5


def _single(op: str, attrs: dict[str, float], c_low: float, c_high: float, out: tuple[float, float]
            ) -> onnx.ModelProto:
    """Conv -> Q/DQ [c_low, c_high] -> ``op`` -> Q/DQ ``out`` -> Conv (weights float)."""
    inits, _ = _conv_silu_conv()

    def qdq(t: str, lo: float, hi: float) -> list[onnx.NodeProto]:
        return _qdq(inits, t, lo, hi)

    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv1", pads=[1, 1, 1, 1]), *qdq("c", c_low, c_high),
             helper.make_node(op, ["c/dq"], ["m"], name="act", **attrs), *qdq("m", *out),
             helper.make_node("Conv", ["m/dq", "w2"], ["y"], name="conv2")]
    x, y = _io()
    return helper.make_model(helper.make_graph(nodes, "act_qdq", [x], [y], inits),
                             opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("op", "attrs", "c_range", "out", "flat"), [
    ("Relu", {}, (0.0, 20.0), (0.0, 20.0), (True, False)),             # negatives clipped to 0: Relu gives 0
    ("Relu", {}, (-1.0, 20.0), (0.0, 20.0), (True, False)),            # Relu(-1) is already 0
    ("HardSwish", {}, (-3.0, 20.0), (-0.375, 20.0), (True, False)),    # HardSwish is exactly 0 below -3
    ("HardSwish", {}, (-2.0, 20.0), (-0.375, 20.0), (False, False)),   # HardSwish(-2) = -0.33: a visible clip
    ("Sigmoid", {}, (-8.0, 8.0), (0.0, 1.0), (True, True)),            # within half a 1/255 code of 0 and of 1
    ("Sigmoid", {}, (-4.0, 4.0), (0.0, 1.0), (False, False)),          # sigmoid(-4) = 0.018: 4.6 codes
    ("Tanh", {}, (-5.0, 5.0), (-1.0, 1.0), (False, False)),            # -1 falls between two codes (zp 128)
    ("Tanh", {}, (-5.0, 5.0), (-1.0, 127 / 128), (True, True)),        # -1 on the grid: 1 - tanh(5) = 9e-5
    ("HardSigmoid", {"alpha": 0.2, "beta": 0.5}, (-2.5, 2.5), (0.0, 1.0), (True, True)),  # exactly flat outside
])
def test_single_activations_have_their_flat_sides(op: str, attrs: dict[str, float], c_range: tuple[float, float],
                                                  out: tuple[float, float], flat: tuple[bool, bool]) -> None:
    model = _single(op, attrs, *c_range, out)
    points, _ = find_points(ModelIndex.build(reference()), ModelIndex.build(model))
    assert next(p for p in points if p.dq_node == "c/dq").flat == flat
