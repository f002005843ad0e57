"""``quantize_lstm``: LSTM -> com.microsoft.DynamicQuantizeLSTM with int8 weights, in every scope."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from qgraph import Pipeline
from qgraph.pipeline.pass_api import get_pass
from qgraph.pipeline.target import TargetSpec

H, IN, T = 16, 8, 5


def _lstm(x: str, out: str, name: str, w: str = "W", **attrs: int) -> onnx.NodeProto:
    return helper.make_node("LSTM", [x, w, "R", "B", "", "h0", "c0"], [out, f"{out}_h", f"{out}_c"], name=name,
                            hidden_size=H, **attrs)


def lstm_net(in_branch: bool = False, weights_as_input: bool = False) -> onnx.ModelProto:
    """``y = LSTM(x)`` [T, 1, IN] -> [T, 1, 1, H] (with ``in_branch``: inside ``If(c)``, else ``x`` itself)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, s).astype(np.float32), n)
             for n, s in (("R", (1, 4 * H, H)), ("B", (1, 8 * H)), ("h0", (1, 1, H)), ("c0", (1, 1, H)))]
    inputs = [helper.make_tensor_value_info("x", 1, [T, 1, IN])]
    if weights_as_input:
        inputs.append(helper.make_tensor_value_info("W", 1, [1, 4 * H, IN]))
    else:
        inits.append(numpy_helper.from_array(rng.normal(0, 0.3, (1, 4 * H, IN)).astype(np.float32), "W"))
    if in_branch:
        then = helper.make_graph([_lstm("x", "t", "then/lstm")], "then", [],
                                 [helper.make_tensor_value_info("t", 1, None)])
        other = helper.make_graph([helper.make_node("Identity", ["zeros"], ["e"], name="else/zeros")], "else",
                                  [], [helper.make_tensor_value_info("e", 1, None)])
        nodes = [helper.make_node("If", ["c"], ["y"], name="switch", then_branch=then, else_branch=other)]
        inputs.append(helper.make_tensor_value_info("c", 9, []))
        inits.append(numpy_helper.from_array(np.zeros((T, 1, 1, H), np.float32), "zeros"))
    else:
        nodes = [_lstm("x", "y", "lstm")]
    graph = helper.make_graph(nodes, "lstm", inputs, [helper.make_tensor_value_info("y", 1, [T, 1, 1, H])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(s.run(None, feed)[0])


def _x(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T, 1, IN)).astype(np.float32)


def test_structure_int8_transposed_weights_and_the_contrib_domain() -> None:
    res = Pipeline([get_pass("quantize_lstm")(saturation="off")]).run(lstm_net())
    node = res.model.graph.node[0]
    assert (node.op_type, node.domain, len(node.input)) == ("DynamicQuantizeLSTM", "com.microsoft", 12)
    inits = {t.name: numpy_helper.to_array(t) for t in res.model.graph.initializer}
    w_q, w_s, w_z = (inits[node.input[i]] for i in (1, 8, 9))
    assert w_q.dtype == np.int8 and w_q.shape == (1, IN, 4 * H) and w_s.shape == w_z.shape == (1, 4 * H)
    assert not w_z.any() and np.abs(w_q).max(axis=1).min() == 127  # symmetric, every gate row uses its range
    w = numpy_helper.to_array(next(t for t in lstm_net().graph.initializer if t.name == "W"))
    np.testing.assert_allclose(w_q.transpose(0, 2, 1) * w_s[:, :, None], w, atol=w_s.max() / 2 + 1e-7)
    assert ("com.microsoft", 1) in {(o.domain, o.version) for o in res.model.opset_import}
    assert res.records[0].result.rewritten == 1


def test_gate_rows_that_could_saturate_avx2_get_a_raised_scale_unless_the_cpu_is_exact() -> None:
    """The op's GEMMs multiply u8 activations by these weights: on x86 without VNNI a pair of same-sign codes
    summing past 128 overflows int16. Made for no CPU in particular (or for AVX2), only those rows lose resolution;
    made for a VNNI CPU, every row keeps its full range."""
    from qgraph.runtime.kernels.pairs import kernel_rows, risky_pairs

    def weights(res: Any) -> np.ndarray:
        node = res.model.graph.node[0]
        return numpy_helper.to_array(next(t for t in res.model.graph.initializer if t.name == node.input[1]))

    safe = Pipeline([get_pass("quantize_lstm")()]).run(lstm_net())
    w_q = weights(safe)[0]  # [I, 4H]: K x output channels
    rows = kernel_rows(w_q, "MatMul")
    assert rows is not None and risky_pairs(rows.astype(np.int32)).count == 0
    assert 0 < int((np.abs(w_q).max(axis=0) < 127).sum()) < w_q.shape[1]  # only some rows were raised
    assert any(d.startswith("saturation: avoid (the recipe declares no CPU") for d in safe.records[0].result.decisions)
    vnni = Pipeline([get_pass("quantize_lstm")()], target=TargetSpec(cpu="x86-vnni")).run(lstm_net())
    assert np.abs(weights(vnni)[0]).max(axis=0).min() == 127
    assert any(d.startswith("saturation: off (the target CPU is x86-vnni)") for d in vnni.records[0].result.decisions)


def test_numbers_close_to_float_and_per_channel_helps() -> None:
    x = _x()
    ref = _run(lstm_net(), {"x": x}).astype(np.float64)

    def sqnr(per_channel: bool) -> float:
        got = _run(Pipeline([get_pass("quantize_lstm")(per_channel=per_channel)]).run(lstm_net()).model, {"x": x})
        return float(10 * np.log10((ref**2).sum() / ((ref - got) ** 2).sum()))

    assert sqnr(True) > 30 and sqnr(True) >= sqnr(False)


def test_an_lstm_inside_an_if_branch_is_quantized() -> None:
    model = lstm_net(in_branch=True)
    res = Pipeline([get_pass("quantize_lstm")()]).run(model)
    branch = next(a.g for a in res.model.graph.node[0].attribute if a.name == "then_branch")
    assert [n.op_type for n in branch.node] == ["DynamicQuantizeLSTM"]
    feed = {"x": _x(), "c": np.array(True)}
    ref = _run(model, feed)
    assert np.abs(_run(res.model, feed) - ref).max() < 0.05 * np.abs(ref).max()


def test_skips_with_reasons_and_is_idempotent() -> None:
    res = Pipeline([get_pass("quantize_lstm")()]).run(lstm_net(weights_as_input=True)).records[0].result
    assert res.rewritten == 0 and "not constant" in res.skipped[0].reason
    once = Pipeline([get_pass("quantize_lstm")()]).run(lstm_net()).model
    again = Pipeline([get_pass("quantize_lstm")()]).run(once).records[0]
    assert again.result.matched == 0 and not again.changed
