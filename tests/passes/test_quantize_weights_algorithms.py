"""Each quantize_weights algorithm lowers the error it targets, on a weight or model built to need it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from qgraph.passes.quantize_weights import QuantizeWeights
from qgraph.passes.quantize_weights.gptq import inverse_hessian_factor, quantize_gptq
from qgraph.passes.quantize_weights.hqq import quantize_hqq
from qgraph.passes.quantize_weights.mixed import promote

from qgraph import Pipeline
from qgraph.quant.blockwise import DEFAULT_RATIOS, BlockFormat, block_error, quantize_weight, to_blocks

FMT = BlockFormat(4, 32, False)


def _heavy_tailed(seed: int, k: int = 256, n: int = 64) -> np.ndarray:
    """Student-t weights: a few large values per block, as trained transformer weights have."""
    return (np.random.default_rng(seed).standard_t(3, (k, n)) * 0.02).astype(np.float32)


def _mse(w: np.ndarray, w2: np.ndarray) -> float:
    return float(np.mean((w.astype(np.float64) - w2) ** 2))


def test_clip_search_lowers_the_weight_error_of_round_to_nearest() -> None:
    w = _heavy_tailed(0)
    plain, searched = quantize_weight(w, FMT, (1.0,)), quantize_weight(w, FMT, DEFAULT_RATIOS)
    blocks = to_blocks(w, 32)
    per_block = block_error(blocks, searched.scale, searched.zero_point, 15)
    assert np.all(per_block <= block_error(blocks, plain.scale, plain.zero_point, 15) * (1 + 1e-6))  # never worse
    assert _mse(w, searched.dequantize()) < 0.97 * _mse(w, plain.dequantize())
    sym = BlockFormat(4, 32, True)
    assert _mse(w, quantize_weight(w, sym, DEFAULT_RATIOS).dequantize()) < _mse(w, quantize_weight(w, sym).dequantize())


def test_hqq_is_never_worse_than_the_clip_search_and_beats_plain_rtn() -> None:
    for seed, fmt in ((1, FMT), (2, BlockFormat(4, 64, True)), (3, BlockFormat(8, 32, False))):
        w = _heavy_tailed(seed)
        rtn = quantize_weight(w, fmt, DEFAULT_RATIOS).dequantize()
        hqq = quantize_hqq(w, fmt, DEFAULT_RATIOS, iterations=20, p=0.7, float_zero=not fmt.symmetric).dequantize()
        assert _mse(w, hqq) <= _mse(w, rtn) * (1 + 1e-6)
        assert _mse(w, hqq) < _mse(w, quantize_weight(w, fmt).dequantize())


def _correlated_inputs(seed: int, rows: int, k: int) -> np.ndarray:
    """Inputs living near a low-dimensional subspace with a few strong channels: rounding errors along the weak
    directions cost nothing, which GPTQ exploits."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 16)) @ rng.standard_normal((16, k)) + 0.1 * rng.standard_normal((rows, k))
    return (x * rng.uniform(0.2, 3.0, k)).astype(np.float32)


def test_gptq_lowers_the_layer_output_error() -> None:
    x = _correlated_inputs(4, 2048, 128)
    h = x.T.astype(np.float64) @ x / len(x)
    w = _heavy_tailed(5, 128, 48)

    def out_err(w2: np.ndarray) -> float:
        return float(np.sum((x @ (w.astype(np.float64) - w2)) ** 2))

    rtn = out_err(quantize_weight(w, FMT, DEFAULT_RATIOS, np.diag(h)).dequantize())
    for act_order in (False, True):
        factor = inverse_hessian_factor(h, 0.01, act_order)
        gptq = out_err(quantize_gptq(w, FMT, factor, np.diag(h), DEFAULT_RATIOS, 32).dequantize())
        assert gptq < 0.7 * rtn, (act_order, gptq / rtn)


def _ln_matmul(seed: int) -> onnx.ModelProto:
    """LayerNormalization whose γ has 4 channels 25x the rest (activation outliers) -> MatMul 64 -> 64."""
    gamma = np.ones(64, np.float32)
    gamma[[3, 17, 40, 55]] = 25.0
    inits = [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(np.zeros(64, np.float32), "beta"),
             numpy_helper.from_array(_heavy_tailed(seed, 64, 64), "w")]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="ln", axis=-1),
             helper.make_node("MatMul", ["n", "w"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "ln_mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _output_error(model: onnx.ModelProto, quantized: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> float:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    a = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(quantized.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ref = np.concatenate([a.run(None, f)[0] for f in feeds])
    got = np.concatenate([b.run(None, f)[0] for f in feeds])
    return float(np.sum((ref - got) ** 2) / np.sum(ref**2))


def test_awq_scales_fold_into_the_layernorm_and_lower_the_output_error() -> None:
    model = _ln_matmul(6)
    rng = np.random.default_rng(7)
    cal = [{"x": rng.standard_normal((8, 64)).astype(np.float32)} for _ in range(8)]
    held = [{"x": rng.standard_normal((8, 64)).astype(np.float32)} for _ in range(8)]
    rtn = Pipeline([QuantizeWeights(accuracy_level=0)]).run(model)
    awq = Pipeline([QuantizeWeights(algorithm="awq", accuracy_level=0)]).run(model, calibration_data=lambda: cal)
    assert any(d.startswith("awq: 1 of 1 input group(s) scaled") for d in awq.records[0].result.decisions)
    gamma = numpy_helper.to_array(next(t for t in awq.model.graph.initializer if t.name == "gamma"))
    assert not np.allclose(gamma, numpy_helper.to_array(model.graph.initializer[0]))  # 1/s went into γ
    assert _output_error(model, awq.model, held) < 0.8 * _output_error(model, rtn.model, held)


def test_gptq_pass_lowers_the_model_output_error() -> None:
    x = _correlated_inputs(8, 512, 64)
    cal = [{"x": x[i:i + 8, None, :].reshape(8, 64)} for i in range(0, 256, 8)]
    held = [{"x": x[i:i + 8].reshape(8, 64)} for i in range(256, 512, 8)]
    model = _ln_matmul(9)
    model.graph.node[0].op_type = "Identity"  # the layer reads x as it comes: correlated channels
    del model.graph.node[0].input[1:]
    model.graph.node[0].ClearField("attribute")
    rtn = Pipeline([QuantizeWeights(accuracy_level=0)]).run(model)
    gptq = Pipeline([QuantizeWeights(algorithm="gptq", accuracy_level=0)]).run(model, calibration_data=lambda: cal)
    assert _output_error(model, gptq.model, held) < 0.8 * _output_error(model, rtn.model, held)


def test_budget_promotion_takes_the_worst_layers_that_fit() -> None:
    assert promote([0.1, 0.5, 0.3], [10, 10, 10], 0.7) == [1, 2]
    assert promote([0.1, 0.9, 0.3], [5, 30, 5], 0.3) == [0, 2]  # the worst does not fit: the next ones do
    assert promote([0.2], [10], 0.0) == []
