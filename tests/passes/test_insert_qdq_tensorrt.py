"""insert_qdq for TensorRT: input-only placement (``placement: tensorrt``) and unclipped inputs
(``activations.unclipped``): structure on tiny models, the error each removes on a model built to need it, and the
no-op cases (a MatMul chain, where no op needs an output Q; minmax ranges, which clip nothing)."""

from __future__ import annotations

import numpy as np
import onnx
from insert_qdq_helpers import quantize, with_weights
from qgraph.passes.insert_qdq.presets import TENSORRT_OPS

from qgraph.testing.runtime import make_session

HSWISH_TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
hs (float[1,4,8,8] x) => (float[1,4,8,8] y) {
  c1 = Conv<pads=[1,1,1,1]>(x, w1, b1)
  h = HardSwish(c1)
  c2 = Conv<pads=[1,1,1,1]>(h, w2, b2)
  y = Add(c2, h)
}
"""


def _hswish_net(seed: int = 0) -> onnx.ModelProto:
    """Conv -> HardSwish -> Conv + residual; conv1 has one output channel 12x the others (a BN-folded outlier)."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(0, 0.3, (4, 4, 3, 3))
    w1[2] *= 12.0
    w = {"w1": w1, "b1": rng.normal(0, 0.1, (4,)), "w2": rng.normal(0, 0.2, (4, 4, 3, 3)),
         "b2": rng.normal(0, 0.1, (4,))}
    return with_weights(HSWISH_TEXT, {k: v.astype(np.float32) for k, v in w.items()})


def _feeds(n: int, seed: int, shape: tuple[int, ...] = (1, 4, 8, 8), name: str = "x") -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{name: rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


def _sqnr(ref: onnx.ModelProto, test: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> float:
    sa, sb = make_session(ref), make_session(test)
    a = np.concatenate([sa.run(None, f)[0].ravel() for f in feeds]).astype(np.float64)
    b = np.concatenate([sb.run(None, f)[0].ravel() for f in feeds]).astype(np.float64)
    return float(10 * np.log10(np.sum(a * a) / np.sum((a - b) ** 2)))


def _quantized(model: onnx.ModelProto) -> set[str]:
    """Tensors read by an activation QuantizeLinear (not a weight)."""
    inits = {t.name for t in model.graph.initializer}
    return {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in inits}


def test_tensorrt_placement_quantizes_only_the_inputs_of_weighted_ops() -> None:
    model = _hswish_net()
    trt = quantize(model, _feeds(8, 0), preset="tensorrt").model
    assert _quantized(trt) == {"x", "h"}  # conv inputs; conv1's output (HardSwish input) and the Add stay float
    add = next(n for n in trt.graph.node if n.op_type == "Add")
    assert list(add.input) == ["c2", "h"]  # the residual reads the exact float tensor, not h's DQ
    dq = {n.output[0]: n for n in trt.graph.node if n.op_type == "DequantizeLinear"}
    zero_points = [t for t in trt.graph.initializer if t.name.endswith("zero_point")]
    assert zero_points and all(not onnx.numpy_helper.to_array(z).any() for z in zero_points)  # symmetric, zp 0
    assert all(onnx.numpy_helper.to_array(z).dtype == np.int8 for z in zero_points)
    assert {"h/dq", "x/dq"} <= set(dq)
    # onnxruntime placement with the same op types adds the Q/DQ its QLinearConv needs on conv1's output.
    ort_like = quantize(model, _feeds(8, 0), preset="tensorrt", placement="onnxruntime").model
    assert _quantized(ort_like) == {"x", "c1", "h", "c2"}


def test_tensorrt_placement_removes_the_double_rounding_before_hardswish() -> None:
    model, cal, ev = _hswish_net(), _feeds(16, 0), _feeds(8, 1)
    before = _sqnr(model, quantize(model, cal, preset="tensorrt", placement="onnxruntime").model, ev)
    after = _sqnr(model, quantize(model, cal, preset="tensorrt").model, ev)
    # Measured: 31.0 -> 34.1 dB (conv1's output with its 12x channel is no longer rounded before HardSwish).
    assert after > before + 2.0, (before, after)


MATMUL_TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
mm (float[16,32] x) => (float[16,8] y) {
  a = MatMul(x, w1)
  b = Add(a, b1)
  r = Relu(b)
  t = Transpose<perm=[1,0]>(r)
  u = Transpose<perm=[1,0]>(t)
  y = MatMul(u, w2)
}
"""


def test_tensorrt_placement_is_a_no_op_where_no_op_needs_an_output_q() -> None:
    """MatMul fuses with a float output in onnxruntime too: both placements write the same graph."""
    rng = np.random.default_rng(0)
    model = with_weights(MATMUL_TEXT, {"w1": rng.normal(0, 0.3, (32, 16)).astype(np.float32),
                                       "b1": rng.normal(0, 0.1, (16,)).astype(np.float32),
                                       "w2": rng.normal(0, 0.3, (16, 8)).astype(np.float32)})
    cal = _feeds(8, 0, (16, 32))
    a = quantize(model, cal, preset="tensorrt").model
    b = quantize(model, cal, preset="tensorrt", placement="onnxruntime").model
    assert _quantized(a) == {"x", "r", "t", "u"}
    assert a.graph.SerializeToString() == b.graph.SerializeToString()


SPIKES_TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
sp (float[64,32] x) => (float[64,8] y) {
  y = MatMul(x, w)
}
"""


def _spiky_feeds(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """N(0, 1) on every channel but channel 0, which is 0 except spikes of 10 on 5% of the rows: the values the
    MatMul reads (its weight row 0 dominates) are the 0.16% of the tensor a 99th-percentile range clips."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal((64, 32))
        x[:, 0] = np.where(rng.random(64) < 0.05, 10.0, 0.0)
        out.append({"x": x.astype(np.float32)})
    return out


def _spiky_net() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, (32, 8))
    w[0] = 1.0
    return with_weights(SPIKES_TEXT, {"w": w.astype(np.float32)})


def test_unclipped_inputs_keep_the_tails_the_next_layer_reads() -> None:
    model, cal, ev = _spiky_net(), _spiky_feeds(16, 0), _spiky_feeds(8, 1)
    clipped = {"method": "percentile", "method_options": {"percentile": 99.0}}
    before = quantize(model, cal, preset="tensorrt", activations=clipped)
    res = quantize(model, cal, preset="tensorrt", activations={**clipped, "unclipped": {"op_types": ["MatMul"]}})
    rec = res.records[0].result
    assert rec.details["calibration"]["unclipped"]["x"]["range"][1] == 10.0
    assert any(d.startswith("unclipped: 1 input(s)") for d in rec.decisions)
    # Measured: 2.8 -> 44.8 dB: the spikes are the signal, the clipped range cut them to ~2.6.
    assert _sqnr(model, res.model, ev) > _sqnr(model, before.model, ev) + 20.0


def test_unclipped_is_a_no_op_on_minmax_ranges_and_reports_unmatched_selectors() -> None:
    model, cal = _spiky_net(), _spiky_feeds(8, 0)
    plain = quantize(model, cal, preset="tensorrt", activations={"method": "minmax"}).model
    res = quantize(model, cal, preset="tensorrt",
                   activations={"method": "minmax", "unclipped": {"op_types": ["MatMul", "Conv"]}})
    assert res.model.graph.SerializeToString() == plain.graph.SerializeToString()
    rec = res.records[0].result
    assert "unclipped" not in rec.details["calibration"]
    assert any("Conv" in u for u in rec.unmatched)


def test_tensorrt_preset_op_types_are_the_weighted_and_movement_ops() -> None:
    assert {"Conv", "ConvTranspose", "Gemm", "MatMul", "Reshape", "Transpose", "MaxPool"} <= set(TENSORRT_OPS)
    assert not {"Add", "Mul", "Concat", "Sigmoid", "AveragePool", "GlobalAveragePool"} & set(TENSORRT_OPS)


def _dw_run(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], **options: object) -> onnx.ModelProto:
    from qgraph.passes.fuse_batchnorm import FuseBatchNorm
    from qgraph.passes.insert_qdq import InsertQDQ

    from qgraph import Pipeline
    from qgraph.data import CallableSource

    data = CallableSource(lambda: feeds, "test feeds")
    return Pipeline([FuseBatchNorm(), InsertQDQ(preset="tensorrt", **options)]).run(model, calibration_data=data).model


def test_depthwise_float_keeps_the_depthwise_convs_and_their_inputs_float() -> None:
    from qgraph.testing.depthwise import depthwise_net

    model = depthwise_net(spread=100.0, activation="HardSwish", size=16)
    cal, ev = _feeds(8, 0, (1, 3, 16, 16), "input"), _feeds(8, 1, (1, 3, 16, 16), "input")
    q = _dw_run(model, cal, depthwise="float")
    convs = [n for n in q.graph.node if n.op_type == "Conv"]
    dw = [n for n in convs if any(a.name == "group" and a.i > 1 for a in n.attribute)]
    assert len(dw) == 2 and len(convs) == 5
    producers = {o: n.op_type for n in q.graph.node for o in n.output}
    assert all(producers.get(n.input[0]) != "DequantizeLinear" for n in dw)  # float input, float weight
    assert all(producers.get(n.input[0]) == "DequantizeLinear" for n in convs if n not in dw)
    # Measured: logits 26.4 -> 32.0 dB with BN-folded channel ranges ~100x apart.
    before, after = _sqnr(model, _dw_run(model, cal), ev), _sqnr(model, q, ev)
    assert after > before + 3.0, (before, after)


def test_depthwise_float_is_a_no_op_without_depthwise_convs() -> None:
    model = _hswish_net()
    a = quantize(model, _feeds(8, 0), preset="tensorrt").model
    b = quantize(model, _feeds(8, 0), preset="tensorrt", depthwise="float").model
    assert a.graph.SerializeToString() == b.graph.SerializeToString()
