"""float_fallback on dynamically quantized models: named MatMuls back to float (float numerics in onnxruntime),
auto mode's ranked subset meeting a target, models from onnxruntime's quantize_dynamic, the com.microsoft fused
forms, and what the summary says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper
from qgraph.passes.float_fallback import FloatFallback

from qgraph import GraphHandle, NodeSelector, PassError, Pipeline, Recipe
from qgraph.quant.dynamic_graph import dynamic_units
from qgraph.runtime.compare import make_session
from qgraph.testing import transformer_encoder, transformer_encoder_inputs

ROOT = Path(__file__).resolve().parents[2]
VNNI = yaml.safe_load((ROOT / "recipes" / "transformer-ort-x86-vnni.yaml").read_text())
#: The ready recipe without smooth_quant: the float model's weights are then exactly the ones quantized.
PLAIN = [{"pass": "fold_constants"}, {"pass": "cleanup"}, {"pass": "insert_qdq", "preset": "transformer-ort-x86-vnni"}]
UNITS = 12  # 2 layers x (Q, K, V, out, up, down)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("dyn_ff")
    model = transformer_encoder(17, layers=2, d_model=64, heads=4, seq=32)
    feeds = transformer_encoder_inputs(8, seq=32, d_model=64, seed=3)
    data = folder / "cal.npz"
    np.savez(data, **{k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]})
    onnx.save(model, folder / "float.onnx")
    return {"model": model, "feeds": feeds, "data": data, "folder": folder}


def _run(encoder: dict[str, Any], passes: list[dict[str, Any]]) -> tuple[onnx.ModelProto, Any]:
    recipe = Recipe.from_dict({"name": "t", "passes": passes})
    result = Pipeline(recipe.passes).run(encoder["model"], calibration_data=str(encoder["data"]))
    records = [r.result for r in result.records if r.name == "float_fallback"]
    return result.model, records[0] if records else None


def _outputs(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], names: list[str]) -> list[np.ndarray]:
    """``names`` (graph outputs or inner tensors) over every feed, concatenated."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(helper.make_value_info(n, onnx.TypeProto()) for n in names if n not in have)
    sess = make_session(m)
    got = [sess.run(names, f) for f in feeds]
    return [np.concatenate([g[i].reshape(-1) for g in got]).astype(np.float64) for i in range(len(names))]


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / np.sum((ref - got) ** 2)))


def _weight(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))


def _linear_error(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], x: str, y: str,
                  w: np.ndarray) -> float:
    """Relative RMS error of tensor ``y`` against ``x @ w`` (the float layer fed the model's own input)."""
    xs, ys = _outputs(model, feeds, [x, y])
    want = xs.reshape(-1, w.shape[0]) @ w.astype(np.float64)
    return float(np.sqrt(np.mean((ys - want.reshape(-1)) ** 2) / np.mean(want**2)))


def test_named_matmuls_go_back_to_float_with_the_float_weights(encoder: dict[str, Any]) -> None:
    # one by the float model's MatMul name, one by the integer node's name the quantized graph shows
    names = ["layer0/attn/q/matmul", "layer1/ffn/down/matmul/matmul_int"]
    quantized, _ = _run(encoder, PLAIN)
    out, res = _run(encoder, [*PLAIN, {"pass": "float_fallback", "nodes": {"names": names}}])
    nodes = {n.name: n for n in out.graph.node}
    assert sum(n.op_type == "MatMulInteger" for n in out.graph.node) == UNITS - 2
    for name, w_name, x in [("layer0/attn/q/matmul", "layer0/attn/q.weight", "embeddings"),
                            ("layer1/ffn/down/matmul", "layer1/ffn/down.weight", "layer1/ffn/gelu/mul_half_out")]:
        node = nodes[name]
        assert node.op_type == "MatMul" and node.input[0] == x
        assert np.array_equal(_weight(out, node.input[1]), _weight(encoder["model"], w_name))
        y = node.output[0]
        after = _linear_error(out, encoder["feeds"], x, y, _weight(encoder["model"], w_name))
        before = _linear_error(quantized, encoder["feeds"], x, y, _weight(encoder["model"], w_name))
        assert after < 1e-5 < 1e-3 < before, (name, after, before)
    assert res.rewritten == 2
    assert res.details["dynamic_fallen_back"] == {"layer0/attn/q/matmul": "layer0/attn/q/matmul/matmul_int",
                                                  "layer1/ffn/down/matmul": "layer1/ffn/down/matmul/matmul_int"}
    line = next(d for d in res.decisions if "dynamically quantized" in d)
    assert line.startswith("2 dynamically quantized MatMul(s) returned to float")
    assert "2 with the float model's weight" in line and "dequantized" not in line


def test_every_matmul_back_to_float_gives_the_float_model(encoder: dict[str, Any]) -> None:
    """The ready recipe (SmoothQuant's float Muls included) with every MatMul back: float outputs again."""
    ready = VNNI["passes"]
    quantized, _ = _run(encoder, ready)
    out, res = _run(encoder, [*ready, {"pass": "float_fallback", "nodes": {"op_types": ["MatMul"]}}])
    assert not {"MatMulInteger", "DynamicQuantizeLinear"} & {n.op_type for n in out.graph.node}
    assert res.rewritten == UNITS
    # the attention MatMuls (two activations) were float already, and say so
    assert {s.node for s in res.skipped if s.reason.startswith("already float")} == {
        f"layer{i}/attn/{n}" for i in range(2) for n in ("qk", "pv")}
    name = encoder["model"].graph.output[0].name
    (ref,), (got,), (q,) = (_outputs(m, encoder["feeds"], [name]) for m in (encoder["model"], out, quantized))
    assert _sqnr(ref, got) > 100 > 60 > _sqnr(ref, q)


def test_auto_meets_a_sqnr_target_with_a_ranked_subset(encoder: dict[str, Any]) -> None:
    ready = VNNI["passes"]
    quantized, _ = _run(encoder, ready)
    name = encoder["model"].graph.output[0].name
    (ref,), (q,) = (_outputs(m, encoder["feeds"], [name]) for m in (encoder["model"], quantized))
    goal = round(_sqnr(ref, q) + 4.0, 1)  # 4 dB above INT8: some MatMuls must go, not all
    out, res = _run(encoder, [*ready, {"pass": "float_fallback",
                                       "auto": {"target": f"sqnr:{goal}", "latency_rounds": 0}}])
    auto = res.details["auto"]
    assert auto["target_met"] and res.unmet is None
    chosen = auto["nodes"]
    assert 1 <= len(chosen) < UNITS and set(chosen) == set(res.details["fallen_back"])
    assert sum(n.op_type == "MatMulInteger" for n in out.graph.node) == UNITS - len(chosen)
    (got,) = _outputs(out, encoder["feeds"], [name])
    assert _sqnr(ref, got) >= goal - 0.05  # measured again here, on the data the search used
    assert any("ranked by output error alone" in d for d in res.decisions)
    assert not any("no local measure" in n for n in res.notes)  # every unit was ranked from the one run


def test_without_a_float_reference_the_codes_are_dequantized_and_it_says_so(encoder: dict[str, Any]) -> None:
    quantized, _ = _run(encoder, PLAIN)
    result = Pipeline([FloatFallback(nodes=NodeSelector(names=("layer0/ffn/up/matmul",)))]).run(quantized)
    out, res = result.model, result.records[0].result
    node = next(n for n in out.graph.node if n.name == "layer0/ffn/up/matmul")
    unit = next(u for u in dynamic_units(GraphHandle(quantized)) if u.name == "layer0/ffn/up/matmul")
    w = unit.dequantized()
    assert np.array_equal(_weight(out, node.input[1]), w)
    assert _linear_error(out, encoder["feeds"], node.input[0], node.output[0], w) < 1e-6
    line = next(d for d in res.decisions if "dynamically quantized" in d)
    assert "1 with the weight dequantized from its int8 codes" in line
    assert res.details["dequantized_weights"] == ["layer0/ffn/up/matmul/float_weight"]


def test_second_run_changes_nothing(encoder: dict[str, Any]) -> None:
    quantized, _ = _run(encoder, PLAIN)
    step = [FloatFallback(nodes=NodeSelector(names=("layer0/attn/k/matmul",)))]
    once = Pipeline(step).run(quantized).model
    again = Pipeline(step).run(once).records[0].result
    assert again.rewritten == 0 and [s.node for s in again.skipped] == ["layer0/attn/k/matmul"]


def test_a_name_matching_nothing_is_still_an_error(encoder: dict[str, Any]) -> None:
    quantized, _ = _run(encoder, PLAIN)
    with pytest.raises(PassError, match=r"names: 'layer0/attn/nope' matched no node"):
        Pipeline([FloatFallback(nodes=NodeSelector(names=("layer0/attn/nope",)))]).run(quantized)


def test_sixteen_bit_remedies_refuse_dynamic_matmuls(encoder: dict[str, Any]) -> None:
    quantized, _ = _run(encoder, PLAIN)
    res = Pipeline([FloatFallback(nodes=NodeSelector(names=("layer0/attn/q/matmul",)), to="a16w8")]).run(
        quantized).records[0].result
    assert res.rewritten == 0
    assert [(s.node, "no 16-bit form" in s.reason) for s in res.skipped] == [("layer0/attn/q/matmul", True)]


def test_onnxruntime_quantize_dynamic_model_with_its_float_model(encoder: dict[str, Any]) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    folder = encoder["folder"]
    quantize_dynamic(folder / "float.onnx", folder / "ort_dyn.onnx", weight_type=QuantType.QInt8)
    ort_model = onnx.load(folder / "ort_dyn.onnx")
    assert len(dynamic_units(GraphHandle(ort_model))) == UNITS
    step = FloatFallback(nodes=NodeSelector(regex=("^layer1/ffn/.*/matmul",)), float_weights=str(folder / "float.onnx"))
    result = Pipeline([step]).run(ort_model)
    res = result.records[0].result
    assert sorted(res.details["dynamic_fallen_back"]) == ["layer1/ffn/down/matmul", "layer1/ffn/up/matmul"]
    assert any("2 with the float model's weight" in d for d in res.decisions)
    node = next(n for n in result.model.graph.node if n.name == "layer1/ffn/up/matmul")
    w = _weight(encoder["model"], "layer1/ffn/up.weight")
    assert _linear_error(result.model, encoder["feeds"], node.input[0], node.output[0], w) < 1e-5


def _fused(op: str) -> onnx.ModelProto:
    """x[4,8] -> one com.microsoft dynamic MatMul with per-column s8 weights and a bias -> y[4,5]."""
    rng = np.random.default_rng(0)
    codes = rng.integers(-127, 128, (8, 5)).astype(np.int8)
    scale = np.linspace(0.01, 0.02, 5, dtype=np.float32)
    inits = [numpy_helper.from_array(codes, "w_q"), numpy_helper.from_array(scale, "w_scale"),
             numpy_helper.from_array(rng.integers(-5, 5, 5).astype(np.int8), "w_zp"),
             numpy_helper.from_array(rng.normal(size=5).astype(np.float32), "bias")]
    if op == "DynamicQuantizeMatMul":
        nodes = [helper.make_node(op, ["x", "w_q", "w_scale", "w_zp", "bias"], ["y"], name="fc_quant",
                                  domain="com.microsoft")]
    else:
        nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="x_dq"),
                 helper.make_node(op, ["xq", "w_q", "xs", "w_scale", "xz", "w_zp", "bias"], ["y"], name="fc_quant",
                                  domain="com.microsoft")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 5])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


@pytest.mark.parametrize("op", ["DynamicQuantizeMatMul", "MatMulIntegerToFloat"])
def test_fused_contrib_forms_become_matmul_and_add(op: str) -> None:
    model = _fused(op)
    result = Pipeline([FloatFallback(nodes=NodeSelector(names=("fc",)))]).run(model)
    assert [n.op_type for n in result.model.graph.node] == ["MatMul", "Add"]
    x = np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    w = (inits["w_q"].astype(np.float64) - inits["w_zp"]) * inits["w_scale"]
    want = x.astype(np.float64) @ w + inits["bias"]
    got = make_session(result.model).run(None, {"x": x})[0]
    before = make_session(model).run(None, {"x": x})[0]
    assert np.abs(got - want).max() < 1e-5 < 1e-3 < np.abs(before - want).max()


def test_sensitivity_command_on_a_dynamic_model(encoder: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from qgraph.analysis.sensitivity.stats import matmul_flops
    from qgraph.cli import main

    folder = encoder["folder"]
    quantized, _ = _run(encoder, PLAIN)
    onnx.save(quantized, folder / "dyn.onnx")
    rows = matmul_flops(quantized, {"embeddings": (1, 32, 64), "attention_mask": (1, 32)})
    assert sum(r["int8"] for r in rows) == UNITS and all(r["flops"] > 0 for r in rows)  # the dynamic MatMuls count
    capsys.readouterr()
    assert main(["sensitivity", str(folder / "float.onnx"), str(folder / "dyn.onnx"), "--data", str(encoder["data"]),
                 "--target", "sqnr:200", "-o", str(folder / "sens.onnx")]) in (0, 1)  # 200 dB: every unit needed
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    written = onnx.load(folder / "sens.onnx")
    assert not any(n.op_type == "MatMulInteger" for n in written.graph.node)
    int8, total = (int(v) for v in text.split("MatMul/Gemm FLOPs in INT8: ")[1].split(" ")[0].split("/"))
    assert int8 == 0 and total == sum(r["flops"] for r in rows)  # every dynamic MatMul went back to float
    names = text.split("names: - ")[1].split(" float_weights")[0].split(" - ")
    assert len(names) == UNITS and {n.name for n in written.graph.node if n.op_type == "MatMul"} >= set(names)


def test_auto_with_a_sixteen_bit_remedy_leaves_dynamic_matmuls_out(encoder: dict[str, Any]) -> None:
    quantized, _ = _run(encoder, PLAIN)
    res = Pipeline([FloatFallback(to="a16w8", auto={"target": "sqnr:200", "latency_rounds": 0})]).run(
        quantized, calibration_data=str(encoder["data"])).records[0].result
    assert res.rewritten == 0 and res.details["auto"]["candidates"] == 0
    assert f"auto: {UNITS} dynamically quantized MatMul(s) are not candidates: they have no 16-bit form " \
           "(to: float returns them to float)" in res.notes
