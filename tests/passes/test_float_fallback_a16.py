"""float_fallback `to: a16w8`: chosen nodes get 16-bit activations instead of float (NPU mixed precision)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest

from qgraph import NodeSelector, Pipeline, Recipe, RecipeError, get_pass
from qgraph.data import CallableSource
from qgraph.graph import GraphHandle
from qgraph.quant.qdq_graph import quantized_nodes
from qgraph.testing.depthwise import depthwise_net
from qgraph.testing.models import run_target

Feed = dict[str, np.ndarray]


def _feeds(n: int, seed: int) -> list[Feed]:
    rng = np.random.default_rng(seed)
    return [{"input": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(n)]


def _sqnr(reference: onnx.ModelProto, candidate: onnx.ModelProto, feeds: list[Feed]) -> float:
    ref = np.concatenate([run_target(reference, f)[0] for f in feeds]).astype(np.float64)
    out = np.concatenate([run_target(candidate, f)[0] for f in feeds]).astype(np.float64)
    return float(10 * np.log10(np.sum(ref**2) / np.sum((ref - out) ** 2)))


def _run(fallback: dict[str, Any], cal: list[Feed]) -> tuple[onnx.ModelProto, onnx.ModelProto, Any]:
    """(float, result model, float_fallback's PassResult) of fuse_batchnorm, insert_qdq, float_fallback."""
    model = depthwise_net(seed=0, spread=100.0)
    fuse = get_pass("fuse_batchnorm")
    passes = [fuse(), get_pass("insert_qdq")(preset="ort-x86-vnni"), get_pass("float_fallback")(**fallback)]
    result = Pipeline(passes).run(model, calibration_data=CallableSource(lambda: cal, "calibration"))
    return Pipeline([fuse()]).run(model).model, result.model, result.records[-1].result


def test_manual_selection_widens_and_says_so() -> None:
    _, model, res = _run({"nodes": NodeSelector(names=("b1/dw", "head/fc")), "to": "a16w8"}, _feeds(8, 1))
    assert res.details["widened"] == ["b1/dw", "head/fc"] and res.rewritten == 2
    assert "fallen_back" not in res.details and not res.kept_float
    assert any("2 node(s) given 16-bit activations" in d for d in res.decisions), res.decisions
    assert any("b1/dw (selected: name in nodes.names" in d for d in res.decisions), res.decisions
    assert res.details["widened_why"]["head/fc"].startswith("selected: name in nodes.names")
    # Still quantized: the two nodes keep their int8 weights and read 16-bit activations.
    handle = GraphHandle(model)
    assert {"b1/dw", "head/fc"} <= {n.name for n in quantized_nodes(handle)}
    zero_points = {onnx.numpy_helper.to_array(t).dtype for t in model.graph.initializer if "zero_point16" in t.name}
    assert zero_points == {np.dtype(np.uint16)}


def test_auto_reaches_a_target_int8_misses_with_16bit_nodes() -> None:
    cal = _feeds(8, 1)
    model = depthwise_net(seed=0, spread=100.0)
    fuse = get_pass("fuse_batchnorm")
    data = CallableSource(lambda: cal, "calibration")
    floats = Pipeline([fuse()]).run(model).model
    int8 = Pipeline([fuse(), get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(model, calibration_data=data).model
    base = _sqnr(floats, int8, cal)
    goal = round(base + 2.0, 1)  # all nodes 16-bit gives ~ +6 dB here (the rest is the int8 weights' error)
    _, out, res = _run({"auto": {"target": f"sqnr:{goal}", "latency_rounds": 0}, "to": "a16w8"}, cal)
    auto = res.details["auto"]
    assert auto["remedy"] == "a16w8" and auto["target_met"] is True, res.decisions
    assert 0 < len(auto["nodes"]) < len(quantized_nodes(GraphHandle(int8)))
    assert sorted(res.details["widened"]) == sorted(auto["nodes"]) and not res.kept_float
    assert any(d.startswith("auto: to a16w8: nodes ranked by output error") for d in res.decisions)
    assert any("node(s) with 16-bit activations (a16w8)" in d for d in res.decisions)
    assert _sqnr(floats, out, cal) >= goal - 1e-3  # the score the search reported, measured again


def test_a_model_without_qdq_is_refused() -> None:
    from qgraph import PassError

    with pytest.raises(PassError, match="no QuantizeLinear/DequantizeLinear"):
        Pipeline([get_pass("float_fallback")(nodes=NodeSelector(op_types=("Conv",)), to="a16w8")]).run(
            depthwise_net(seed=0))


def test_tensorrt_target_is_refused() -> None:
    from qgraph import PassError

    recipe = Recipe.from_text("name: r\ntarget: {runtime: tensorrt}\npasses:\n  - pass: insert_qdq\n"
                              "    preset: tensorrt\n  - pass: float_fallback\n    to: a16w8\n"
                              "    nodes: {op_types: [Conv]}\n")
    cal = _feeds(4, 1)
    with pytest.raises(PassError, match="TensorRT does not read"):
        recipe.pipeline().run(depthwise_net(seed=0), calibration_data=CallableSource(lambda: cal, "calibration"))


def test_to_is_validated_and_max_latency_refused() -> None:
    with pytest.raises(RecipeError, match="to"):
        Recipe.from_text("name: r\npasses:\n  - pass: float_fallback\n    nodes: {names: [a]}\n    to: int16\n")
    with pytest.raises(RecipeError, match="max_latency") as err:
        Recipe.from_text("name: r\npasses:\n  - pass: float_fallback\n    to: a16w8\n"
                         "    auto: {target: 'sqnr:30', max_latency: 1.0}\n")
    assert "Value error" not in str(err.value) and "(got dict)" not in str(err.value)
    with pytest.raises(RecipeError, match="use cost: error"):
        Recipe.from_text("name: r\npasses:\n  - pass: float_fallback\n    to: a16w8\n"
                         "    auto: {target: 'sqnr:30', cost: latency}\n")
