"""qgraph.remedy.widen: 16-bit activations on chosen nodes of a QDQ model (A16W8): structure, biases, domains,
numbers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph import GraphHandle, Pipeline, get_pass
from qgraph.data import CallableSource
from qgraph.quant.qdq_graph import QParams, dequantize, is_dq, is_q, quantized_nodes
from qgraph.remedy.widen import MS_DOMAIN, wide_params, widen_activations
from qgraph.testing import depthwise_feeds, depthwise_float_and_qdq, depthwise_net, output_sqnr_db
from qgraph.testing.models import run_ort
from qgraph.testing.names import occupied

Feed = dict[str, np.ndarray]
_feeds, _sqnr = depthwise_feeds, output_sqnr_db


@pytest.fixture(scope="module")
def models() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(float, INT8 QDQ) of a depthwise-separable CNN whose channels are 100x apart (opset 13)."""
    return depthwise_float_and_qdq()


def _widened(qdq: onnx.ModelProto, names: tuple[str, ...] | None = None,
             margin: float = 2.0) -> tuple[onnx.ModelProto, object]:
    handle = GraphHandle(qdq)
    chosen = quantized_nodes(handle) if names is None else [n for n in handle.graph.nodes if n.name in names]
    outcome = widen_activations(handle, chosen, margin=margin)
    model = handle.to_onnx()
    onnx.checker.check_model(model)
    return model, outcome


def _zero_point_type(model: onnx.ModelProto, tensor: str) -> int:
    """The element type of the zero point of the QuantizeLinear reading ``tensor``."""
    inits = {t.name: t for t in model.graph.initializer}
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    return int(inits[q.input[2]].data_type)


def test_every_node_widened_recovers_the_activation_error(models: tuple[onnx.ModelProto, onnx.ModelProto]) -> None:
    floats, qdq = models
    held_out = _feeds(8, 2)
    int8 = _sqnr(floats, qdq, held_out)
    wide, outcome = _widened(qdq)
    a16 = _sqnr(floats, wide, held_out)
    assert outcome.widened == [n.name for n in quantized_nodes(GraphHandle(qdq))]  # type: ignore[attr-defined]
    assert not outcome.refused and not outcome.biases_float  # type: ignore[attr-defined]
    # 8-bit activations cost ~6 dB here; what is left is the int8 weights' error (weights stay 8-bit).
    assert a16 > int8 + 4.0, (int8, a16)
    weights = [n for n in wide.graph.node if is_dq_weight(wide, n)]
    assert weights and all(_init(wide, n.input[0]).dtype == np.int8 for n in weights)


def is_dq_weight(model: onnx.ModelProto, node: onnx.NodeProto) -> bool:
    """A DequantizeLinear of an int8 constant (a weight, not a bias)."""
    inits = {t.name for t in model.graph.initializer}
    return node.op_type == "DequantizeLinear" and node.input[0] in inits and _init(model, node.input[0]).ndim > 1


def _init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def test_one_node_structure_bias_and_contrib_domain(models: tuple[onnx.ModelProto, onnx.ModelProto]) -> None:
    _, qdq = models
    wide, outcome = _widened(qdq, ("b0/dw",))
    assert outcome.widened == ["b0/dw"]  # type: ignore[attr-defined]
    # b0/dw reads stem/act_out through a pair: 16-bit now. Its own output goes through a float Relu to the pair
    # b0/pw reads (that one is b0/pw's input pair) and the network input's pair is the stem's: both stay 8-bit.
    assert outcome.tensors == ["stem/act_out"]  # type: ignore[attr-defined]
    assert _zero_point_type(wide, "stem/act_out") == onnx.TensorProto.UINT16
    assert _zero_point_type(wide, "b0/dw_act_out") == onnx.TensorProto.UINT8
    assert _zero_point_type(wide, "input") == onnx.TensorProto.UINT8
    # Opset 13 has no 16-bit Q/DQ: the widened pairs are com.microsoft nodes, and the model imports the domain.
    widened = [n for n in wide.graph.node if n.domain == MS_DOMAIN]
    assert sorted(n.op_type for n in widened) == ["DequantizeLinear", "QuantizeLinear"]
    assert any(o.domain == MS_DOMAIN for o in wide.opset_import)
    # The int32 bias of b0/dw (scale = input scale x weight scale) follows the 16-bit input scale: same values.
    assert "b0/dw" in outcome.biases_requantized  # type: ignore[attr-defined]
    old, new = _bias(qdq, "b0/dw"), _bias(wide, "b0/dw")
    assert np.all(np.abs(new[0] - old[0]) <= new[1] / 2 + 1e-12)
    assert np.allclose(new[1], new[2] * new[3], rtol=1e-6)


def _bias(model: onnx.ModelProto, node_name: str) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """(float bias, bias scale, input scale, weight scale) of ``node_name`` in ``model``."""
    producer = {o: n for n in model.graph.node for o in n.output}
    node = next(n for n in model.graph.node if n.name == node_name)
    bias_dq, in_dq, w_dq = (producer[node.input[i]] for i in (2, 0, 1))
    codes, scale = _init(model, bias_dq.input[0]).astype(np.float64), _init(model, bias_dq.input[1]).astype(np.float64)
    return codes * scale, scale, float(_init(model, in_dq.input[1])), _init(model, w_dq.input[1]).astype(np.float64)


def test_opset21_keeps_the_onnx_domain(models: tuple[onnx.ModelProto, onnx.ModelProto]) -> None:
    _, qdq = models
    newer = onnx.ModelProto()
    newer.CopyFrom(qdq)
    newer.opset_import[0].version = 21  # Conv/Relu/GAP/Gemm/Q/DQ read the same at 21
    newer.ir_version = 10
    wide, outcome = _widened(newer)
    assert not outcome.contrib_domain  # type: ignore[attr-defined]
    assert all(n.domain in ("", "ai.onnx") for n in wide.graph.node)
    assert not any(o.domain == MS_DOMAIN for o in wide.opset_import)
    contrib, _ = _widened(qdq)
    for feed in _feeds(4, 3):  # the same model either way
        np.testing.assert_allclose(run_ort(wide, feed)[0], run_ort(contrib, feed)[0], rtol=1e-5, atol=1e-6)


def test_int32_overflow_keeps_the_bias_float() -> None:
    # x -> Q/DQ (u8) -> Conv 1x1 with an int32 bias of 1e9 codes: on the 16-bit input scale it needs 2.6e11.
    text = """
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[1,1,2,2] x) => (float[1,1,2,2] y)
    <float sx = {0.02}, uint8 zx = {128}, float sw = {0.01}, int8 zw = {0}, int8[1,1,1,1] w = {50},
     float sb = {0.0002}, int32[1] b = {1000000000}>
    {
      [x_q] xq = QuantizeLinear(x, sx, zx)
      [x_dq] xd = DequantizeLinear(xq, sx, zx)
      [w_dq] wd = DequantizeLinear(w, sw, zw)
      [b_dq] bd = DequantizeLinear(b, sb)
      [conv] y = Conv(xd, wd, bd)
    }
    """
    model = onnx.parser.parse_model(text)
    x = {"x": np.array([[[[0.5, -1.0], [1.5, 2.0]]]], np.float32)}
    wide, outcome = _widened(model, ("conv",))
    assert outcome.biases_float == ["conv"] and not outcome.biases_requantized  # type: ignore[attr-defined]
    (before,), (after,) = run_ort(model, x), run_ort(wide, x)
    assert np.allclose(after, before, rtol=1e-5)  # 2e5 + x/2: the bias is exact in float, the input finer


def test_a_node_without_activation_pairs_is_refused() -> None:
    text = """
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2,2] x) => (float[2,2] y)
    <float sw = {0.01}, int8 zw = {0}, int8[2,2] w = {1, 2, 3, 4}>
    {
      [w_dq] wd = DequantizeLinear(w, sw, zw)
      [mm] y = MatMul(x, wd)
    }
    """
    _, outcome = _widened(onnx.parser.parse_model(text), ("mm",))
    assert outcome.widened == [] and outcome.refused[0][0] == "mm"  # type: ignore[attr-defined]
    assert "no activation Q/DQ pair" in outcome.refused[0][1]  # type: ignore[attr-defined]


@settings(max_examples=200, deadline=None)
@given(
    signed=st.booleans(),
    zero=st.integers(-128, 255),
    scale=st.floats(1e-6, 10.0, allow_nan=False),
    margin=st.sampled_from([1.0, 2.0, 4.0]),
)
def test_wide_params_cover_the_range_keep_zero_and_refine(signed: bool, zero: int, scale: float,
                                                          margin: float) -> None:
    qmin, qmax, dtype = (-128, 127, np.int8) if signed else (0, 255, np.uint8)
    zero = int(np.clip(zero, qmin, qmax))
    params = QParams(np.asarray(scale, np.float32), np.asarray(zero, dtype), 1, 0, qmin, qmax)
    s16, z16 = wide_params(params, margin)
    info = np.iinfo(np.int16 if signed else np.uint16)
    assert z16.dtype == np.dtype(np.int16 if signed else np.uint16)
    wide = QParams(s16, z16, 1, 0, int(info.min), int(info.max))
    lo8, hi8 = params.representable
    lo16, hi16 = wide.representable
    tol = 1e-6 * max(abs(lo8), abs(hi8), 1e-30) * margin
    assert lo16 <= min(lo8, 0.0) * margin + tol and hi16 >= max(hi8, 0.0) * margin - tol
    assert float(dequantize(np.asarray(z16), wide)) == 0.0  # zero exactly representable
    assert float(s16) <= float(params.scale) * margin * 256 / 32767 * (1 + 1e-5)  # ~256/margin x finer


def test_q_and_dq_of_a_pair_change_together(models: tuple[onnx.ModelProto, onnx.ModelProto]) -> None:
    _, qdq = models
    handle = GraphHandle(qdq)
    widen_activations(handle, [n for n in handle.graph.nodes if n.name == "b1/dw"])
    for q in (n for n in handle.graph.nodes if is_q(n)):
        for dq in (c for c in handle.consumers(q.outputs[0]) if is_dq(c)):
            assert dq.inputs[1] is q.inputs[1] and dq.inputs[2] is q.inputs[2]
            assert dq.domain == q.domain


SHARED = """
<ir_version: 8, opset_import: ["" : 17]>
shared (float[2,4] x) => (float[2,4] y, float[2,4] z)
<float sx = {0.02}, uint8 zx = {128}, float sw = {0.01}, int8 zw = {0},
 int8[4,4] wa = {10, -20, 30, -40, 50, -60, 70, -80, 90, -100, 110, -120, 5, 15, -25, 35},
 int8[4,4] wb = {-7, 14, -21, 28, -35, 42, -49, 56, -63, 70, -77, 84, -91, 98, -105, 112}>
{
  [x_q] xq = QuantizeLinear(x, sx, zx)
  [x_dq] xd = DequantizeLinear(xq, sx, zx)
  [wa_dq] wad = DequantizeLinear(wa, sw, zw)
  [wb_dq] wbd = DequantizeLinear(wb, sw, zw)
  [mm_a] y = MatMul(xd, wad)
  [mm_b] z = MatMul(xd, wbd)
}
"""


def test_a_pair_shared_with_an_8bit_reader_is_converted_back_for_it() -> None:
    model = onnx.parser.parse_model(SHARED)
    wide, outcome = _widened(model, ("mm_a",))
    assert outcome.widened == ["mm_a"] and outcome.converted == 1  # type: ignore[attr-defined]
    producer = {o: n for n in wide.graph.node for o in n.output}
    inits = {t.name: t for t in wide.graph.initializer}
    mm = {n.name: n for n in wide.graph.node}
    # mm_a reads the 16-bit DQ; mm_b reads DQ8(Q8(DQ16(...))) with the old uint8 parameters.
    dq_a, dq_b = producer[mm["mm_a"].input[0]], producer[mm["mm_b"].input[0]]
    assert inits[dq_a.input[2]].data_type == onnx.TensorProto.UINT16
    assert inits[dq_b.input[2]].data_type == onnx.TensorProto.UINT8
    q_b = producer[dq_b.input[0]]
    assert producer[q_b.input[0]] is dq_a
    x = np.random.default_rng(0).uniform(-2.5, 2.5, (2, 4)).astype(np.float32)
    (y0, z0), (y1, z1) = run_ort(model, {"x": x}), run_ort(wide, {"x": x})
    fx = x.astype(np.float64) @ (onnx.numpy_helper.to_array(inits["wa"]).astype(np.float64) * 0.01)
    # mm_a: 16-bit input rounding (step 0.02 * 2 * 255 / 65535), far below the 8-bit one (0.02).
    assert np.abs(y1 - fx).max() < 0.2 * np.abs(y0 - fx).max()
    # mm_b: the same 8-bit values, up to a tie flipped by the double rounding (one step x the weights).
    assert np.abs(z1 - z0).max() <= 0.02 * 1.12 + 1e-6


def test_diff_coverage_counts_16bit_nodes_as_integer_and_names_them(models: tuple[onnx.ModelProto,
                                                                                onnx.ModelProto]) -> None:
    from qgraph.analysis.diff import qdq_coverage

    _, qdq = models
    wide, _ = _widened(qdq, ("b1/dw", "head/fc"))
    before, after = qdq_coverage(qdq), qdq_coverage(wide)
    assert after.counts()["int8"] == before.counts()["int8"] and not before.wide
    assert sorted(n.node for n in after.wide) == ["b1/dw", "head/fc"]
    assert {n.dtypes for n in after.wide} == {"uint16×int8"}
    assert after.to_dict()["sixteen_bit_activations"] == 2


def test_tensorrt_form_weights_stay_and_activations_widen() -> None:
    """TensorRT's QDQ keeps float weights behind Q -> DQ: that Q is a weight's, not an activation's."""
    model = depthwise_net(seed=0, spread=100.0)
    cal = _feeds(8, 1)
    trt = Pipeline([get_pass("insert_qdq")(preset="tensorrt")]).run(
        model, calibration_data=CallableSource(lambda: cal, "calibration")).model
    wide, outcome = _widened(trt, ("b1/pw",))
    assert outcome.widened == ["b1/pw"] and not outcome.refused  # type: ignore[attr-defined]
    assert outcome.tensors == ["b1/dw_act_out"]  # type: ignore[attr-defined]
    inits = {t.name: t for t in wide.graph.initializer}
    weight_q = next(n for n in wide.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in inits
                    and inits[n.input[0]].data_type == onnx.TensorProto.FLOAT and "b1/pw" in n.input[0])
    assert inits[weight_q.input[2]].data_type == onnx.TensorProto.INT8  # the weight's pair is untouched
    assert _sqnr(trt, wide, _feeds(4, 2)) > 35  # one activation finer: close to the TensorRT model


def test_com_microsoft_pairs_are_counted_by_inspect(models: tuple[onnx.ModelProto, onnx.ModelProto]) -> None:
    from qgraph.analysis.diff import qdq_coverage

    _, qdq = models
    wide, _ = _widened(qdq, ("b1/dw",))
    before, after = qdq_coverage(qdq), qdq_coverage(wide)
    contrib = sum(n.domain == MS_DOMAIN for n in wide.graph.node)
    assert contrib == 2 and (after.quantize_nodes, after.dequantize_nodes) == (before.quantize_nodes,
                                                                             before.dequantize_nodes)
    from qgraph.analysis.diff import structural_diff

    changed = {c.node: c.changes for c in structural_diff(qdq, wide).changed}
    q = next(n.name for n in wide.graph.node if n.domain == MS_DOMAIN and n.op_type == "QuantizeLinear")
    assert "op: QuantizeLinear → com.microsoft.QuantizeLinear" in changed[q]  # the domain change is shown


def test_widening_twice_changes_nothing_and_says_already(models: tuple[onnx.ModelProto, onnx.ModelProto]) -> None:
    _, qdq = models
    once, _ = _widened(qdq, ("b1/dw",))
    twice, outcome = _widened(once, ("b1/dw",))
    assert outcome.widened == [] and outcome.refused == [("b1/dw", "already 16-bit: every activation pair it "  # type: ignore[attr-defined]
                                                          "reads is 16-bit")]
    assert twice.graph.SerializeToString(deterministic=True) == once.graph.SerializeToString(deterministic=True)


def test_a_pair_without_zero_point_converts_back_with_an_explicit_one() -> None:
    text = SHARED.replace("QuantizeLinear(x, sx, zx)", "QuantizeLinear(x, sx)").replace(
        "DequantizeLinear(xq, sx, zx)", "DequantizeLinear(xq, sx)")
    model = onnx.parser.parse_model(text)
    wide, outcome = _widened(model, ("mm_a",))
    assert outcome.converted == 1  # type: ignore[attr-defined]
    inits = {t.name: t for t in wide.graph.initializer}
    producer = {o: n for n in wide.graph.node for o in n.output}
    dq_b = producer[next(n for n in wide.graph.node if n.name == "mm_b").input[0]]
    assert len(dq_b.input) == 3 and inits[dq_b.input[2]].data_type == onnx.TensorProto.UINT8  # uint8, zero 0
    x = np.random.default_rng(1).uniform(0, 2.5, (2, 4)).astype(np.float32)  # uint8 with zero point 0: x >= 0
    (_, z0), (_, z1) = run_ort(model, {"x": x}), run_ort(wide, {"x": x})
    assert np.abs(z1 - z0).max() <= 0.02 * 1.12 + 1e-6


def test_the_converted_back_pair_takes_fresh_names() -> None:
    """The pair put back for an 8-bit reader is named after the widened tensor (``xd/to8/q``, ``xd/to8/dq``); a
    model already holding those names gets a valid model with the same numbers (names free in every namespace)."""
    model = onnx.parser.parse_model(SHARED)
    squatted = occupied(model, ["xd/to8/q", "xd/to8/dq"], as_outputs=True)
    wide, outcome = _widened(squatted, ("mm_a",))  # checks the model: one producer per tensor
    assert outcome.converted == 1  # type: ignore[attr-defined]
    assert sorted(o for n in wide.graph.node for o in n.output if o.startswith("xd/to8")) == \
        ["xd/to8/dq", "xd/to8/dq_1", "xd/to8/q", "xd/to8/q_1"]
    x = np.random.default_rng(2).uniform(-2.5, 2.5, (2, 4)).astype(np.float32)
    plain, _ = _widened(model, ("mm_a",))
    got, ref = run_ort(wide, {"x": x}), run_ort(plain, {"x": x})
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])
