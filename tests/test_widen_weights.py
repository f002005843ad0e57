"""16-bit weights on chosen nodes (`qgraph.remedy.widen_weights`; float_fallback ``to: a16w16``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from ruamel.yaml import YAML

from qgraph import GraphHandle, Pipeline, Recipe, RecipeError, get_pass
from qgraph.cli import main
from qgraph.data import CallableSource
from qgraph.quant.qdq_graph import quantized_nodes
from qgraph.quant.reference_weights import ReferenceWeights
from qgraph.remedy.apply import apply_remedy
from qgraph.remedy.widen import WidenOutcome
from qgraph.remedy.widen_weights import MS_DOMAIN, WeightWidenOutcome, widen_weights
from qgraph.testing import depthwise_feeds, depthwise_float_and_qdq, depthwise_net, output_sqnr_db
from qgraph.testing.models import run_ort

Feed = dict[str, np.ndarray]
_feeds, _sqnr = depthwise_feeds, output_sqnr_db


@pytest.fixture(scope="module")
def models() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(float, INT8 QDQ) of a depthwise-separable CNN whose channels are 100x apart (opset 13)."""
    return depthwise_float_and_qdq()


def _remedied(qdq: onnx.ModelProto, to: str, reference: ReferenceWeights | None,
              names: tuple[str, ...] | None = None) -> tuple[onnx.ModelProto, WidenOutcome]:
    handle = GraphHandle(qdq)
    chosen = quantized_nodes(handle) if names is None else [n for n in handle.graph.nodes if n.name in names]
    outcome = apply_remedy(handle, chosen, to, reference)
    model = handle.to_onnx()
    onnx.checker.check_model(model)
    assert isinstance(outcome, WidenOutcome)
    return model, outcome


def _init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def _weight_and_bias(model: onnx.ModelProto, node_name: str) -> tuple[onnx.NodeProto, onnx.NodeProto, float]:
    """(weight DQ, bias DQ, input scale) of ``node_name``."""
    producer = {o: n for n in model.graph.node for o in n.output}
    node = next(n for n in model.graph.node if n.name == node_name)
    return producer[node.input[1]], producer[node.input[2]], float(_init(model, producer[node.input[0]].input[1]))


def test_16bit_weights_remove_the_weight_error_a16w8_leaves(models: tuple[onnx.ModelProto, onnx.ModelProto]) -> None:
    floats, qdq = models
    held_out = _feeds(8, 2)
    reference = ReferenceWeights(floats)
    a16w8, _ = _remedied(qdq, "a16w8", reference)
    a16w16, outcome = _remedied(qdq, "a16w16", reference)
    weights = outcome.weights
    assert isinstance(weights, WeightWidenOutcome)
    convs = sorted(n.name for n in quantized_nodes(GraphHandle(qdq)) if n.op in ("Conv", "Gemm"))
    assert sorted(weights.widened) == convs and not weights.from_codes and not weights.refused
    int8, w8, w16 = (_sqnr(floats, m, held_out) for m in (qdq, a16w8, a16w16))
    # A16W8 stops at the int8 weights' error; with int16 weights the model is within 16-bit rounding of float.
    assert w8 > int8 + 4.0 and w16 > w8 + 15.0 and w16 > 50.0, (int8, w8, w16)


def test_structure_int16_per_channel_weights_and_int32_bias(models: tuple[onnx.ModelProto,
                                                                          onnx.ModelProto]) -> None:
    floats, qdq = models
    wide, outcome = _remedied(qdq, "a16w16", ReferenceWeights(floats), ("b1/pw",))
    assert outcome.weights is not None and outcome.weights.widened == ["b1/pw"]
    w_dq, b_dq, in_scale = _weight_and_bias(wide, "b1/pw")
    codes, scale, zero = (_init(wide, w_dq.input[i]) for i in range(3))
    assert codes.dtype == np.int16 and zero.dtype == np.int16 and not zero.any()
    assert w_dq.domain == MS_DOMAIN  # opset 13: int16 DequantizeLinear is onnxruntime's
    assert scale.shape == (codes.shape[0],) and next(a.i for a in w_dq.attribute if a.name == "axis") == 0
    # Symmetric per output channel: the largest |w| of each channel sits on the code 32767 (to within rounding).
    assert np.all(np.abs(codes).reshape(codes.shape[0], -1).max(1) >= 32766)
    float_w = next(onnx.numpy_helper.to_array(t) for t in floats.graph.initializer
                   if t.name == next(n for n in floats.graph.node if n.name == "b1/pw").input[1])
    restored = codes.astype(np.float64) * scale.reshape(-1, 1, 1, 1)
    assert np.all(np.abs(restored - float_w) <= scale.reshape(-1, 1, 1, 1) * 0.501)  # half a step (float32)
    # The bias: int32 on input scale x weight scale, its values the float model's bias.
    b_codes, b_scale = _init(wide, b_dq.input[0]), _init(wide, b_dq.input[1])
    assert b_codes.dtype == np.int32
    np.testing.assert_allclose(b_scale, in_scale * scale, rtol=1e-6)
    float_b = next(onnx.numpy_helper.to_array(t) for t in floats.graph.initializer
                   if t.name == next(n for n in floats.graph.node if n.name == "b1/pw").input[2])
    assert np.all(np.abs(b_codes * b_scale.astype(np.float64) - float_b) <= b_scale / 2 + 1e-12)


def test_without_a_reference_the_int8_values_are_kept_and_said(models: tuple[onnx.ModelProto,
                                                                             onnx.ModelProto]) -> None:
    _, qdq = models
    wide, outcome = _remedied(qdq, "a16w16", None, ("b1/pw",))
    assert outcome.weights is not None and outcome.weights.from_codes == ["b1/pw"]
    old_dq, _, _ = _weight_and_bias(qdq, "b1/pw")
    new_dq, _, _ = _weight_and_bias(wide, "b1/pw")
    old = _init(qdq, old_dq.input[0]).astype(np.float64) * _init(qdq, old_dq.input[1]).reshape(-1, 1, 1, 1)
    new_scale = _init(wide, new_dq.input[1]).reshape(-1, 1, 1, 1)
    new = _init(wide, new_dq.input[0]).astype(np.float64) * new_scale
    assert np.all(np.abs(new - old) <= new_scale / 2 + 1e-12)  # the int8 grid, re-stored on the int16 one


def test_a_bias_too_large_for_int32_raises_the_weight_scale() -> None:
    """Tiny weights and a huge bias: ``bias / (s_in x s_w16)`` leaves int32, so that channel's weight scale grows."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2])
    w = np.array([[1e-4, 2e-4, -1e-4, 3e-4], [0.5, -0.2, 0.1, 0.3]], np.float32).T.copy()
    b = np.array([5e3, 0.1], np.float32)
    graph = onnx.helper.make_graph([onnx.helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc")], "g", [x], [y],
                                   [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    model.ir_version = 10
    cal = [{"x": np.random.default_rng(i).uniform(-1, 1, (1, 4)).astype(np.float32)} for i in range(8)]
    qdq = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni", latency={"mode": "off"})]).run(
        model, calibration_data=CallableSource(lambda: cal, "calibration")).model
    wide, outcome = _remedied(qdq, "a16w16", ReferenceWeights(model))
    assert outcome.weights is not None and outcome.weights.weight_scales_raised >= 1
    assert all(n.domain in ("", "ai.onnx") for n in wide.graph.node)  # opset 21: int16 Q/DQ are ONNX ops
    for feed in cal:
        got, want = run_ort(wide, feed)[0], run_ort(model, feed)[0]
        assert np.max(np.abs(got - want)) <= 1e-3 * np.max(np.abs(want))


def test_widening_twice_refuses_and_changes_nothing(models: tuple[onnx.ModelProto, onnx.ModelProto]) -> None:
    floats, qdq = models
    once, _ = _remedied(qdq, "a16w16", ReferenceWeights(floats))
    handle = GraphHandle(once)
    again = widen_weights(handle, quantized_nodes(handle), ReferenceWeights(floats))
    assert not again.widened and again.refused
    assert all("already 16-bit" in why for _, why in again.refused)
    twice = handle.to_onnx()
    for feed in _feeds(2, 4):
        np.testing.assert_array_equal(run_ort(once, feed)[0], run_ort(twice, feed)[0])


def test_tensorrt_form_weights_become_int16_constants() -> None:
    """TensorRT's QDQ keeps float weights behind Q -> DQ: the DQ reads int16 codes after, the Q is gone."""
    model = depthwise_net(seed=0, spread=100.0)
    cal = _feeds(8, 1)
    trt = Pipeline([get_pass("insert_qdq")(preset="tensorrt")]).run(
        model, calibration_data=CallableSource(lambda: cal, "calibration")).model
    wide, outcome = _remedied(trt, "a16w16", ReferenceWeights(model), ("b1/pw",))
    assert outcome.weights is not None and outcome.weights.widened == ["b1/pw"]
    producer = {o: n for n in wide.graph.node for o in n.output}
    node = next(n for n in wide.graph.node if n.name == "b1/pw")
    w_dq = producer[node.input[1]]
    assert _init(wide, w_dq.input[0]).dtype == np.int16
    assert len(wide.graph.node) == len(trt.graph.node) - 1 + outcome.converted * 2  # the weight's Q went away
    assert _sqnr(model, wide, _feeds(4, 2)) > _sqnr(model, trt, _feeds(4, 2))


def test_recipe_a16w16_after_insert_qdq_uses_the_float_weights(models: tuple[onnx.ModelProto,
                                                                             onnx.ModelProto]) -> None:
    floats, qdq = models
    model = depthwise_net(seed=0, spread=100.0)
    cal = _feeds(8, 1)
    recipe = Recipe.from_dict({"name": "a16w16", "passes": [
        {"pass": "fuse_batchnorm"}, {"pass": "insert_qdq", "preset": "ort-x86-vnni"},
        {"pass": "float_fallback", "to": "a16w16", "nodes": {"names": ["b1/pw", "b1/dw"]}}]})
    result = recipe.pipeline().run(model, calibration_data=CallableSource(lambda: cal, "calibration"))
    step = next(r for r in result.records if r.name == "float_fallback")
    decisions = " | ".join(step.result.decisions)
    assert "int16 weights" in decisions and "no float weights" not in decisions
    assert sorted(step.result.details["weights_widened"]) == ["b1/dw", "b1/pw"]
    # With the recipe's float weights, 16-bit weights and activations give what float gives these two nodes.
    handle = GraphHandle(qdq)
    apply_remedy(handle, [n for n in handle.graph.nodes if n.name in ("b1/pw", "b1/dw")], "float",
                 ReferenceWeights(floats))
    held_out = _feeds(8, 2)
    assert abs(_sqnr(floats, result.model, held_out) - _sqnr(floats, handle.to_onnx(), held_out)) < 0.05


@pytest.mark.parametrize("extra", [{"cost": "latency"}, {"max_latency": 1.0}])
def test_a16w16_with_latency_costs_is_refused_at_load(extra: dict[str, object]) -> None:
    with pytest.raises(RecipeError, match="a16w16"):
        Recipe.from_dict({"name": "r", "passes": [
            {"pass": "float_fallback", "to": "a16w16", "auto": {"target": "sqnr:30", **extra}}]})


def test_sensitivity_cli_a16w16_patch_names_the_float_model_and_rebuilds(models: tuple[onnx.ModelProto,
                                                                                    onnx.ModelProto],
                                                                         tmp_path: Path) -> None:
    """``qgraph sensitivity --to a16w16`` with a target only 16-bit weights reach: the chosen convolutions get int16
    weights from MODEL_FLOAT; the patch names that model (``float_weights``), so it rebuilds the same model from the
    QDQ model alone."""
    floats, qdq = models
    onnx.save(floats, tmp_path / "float.onnx")
    onnx.save(qdq, tmp_path / "qdq.onnx")
    feeds = _feeds(8, 2)
    np.savez(tmp_path / "eval.npz", input=np.concatenate([f["input"] for f in feeds]))
    a16w8, _ = _remedied(qdq, "a16w8", None)
    goal = _sqnr(floats, a16w8, feeds) + 6.0  # beyond what 16-bit activations alone give
    best, patch = tmp_path / "w16.onnx", tmp_path / "w16.yaml"
    args = ["sensitivity", str(tmp_path / "float.onnx"), str(tmp_path / "qdq.onnx"), "--data",
            str(tmp_path / "eval.npz"), "--target", f"sqnr:{goal:.2f}", "--to", "a16w16", "-o", str(best), "--patch",
            str(patch), "-q"]
    assert main(args) == 0
    model = onnx.load(best)
    assert _sqnr(floats, model, feeds) >= goal - 0.01
    assert any(t.data_type == onnx.TensorProto.INT16 and t.dims and len(t.dims) == 4 for t in model.graph.initializer)
    step = YAML(typ="safe").load(patch.read_text())["passes"][0]
    assert step["to"] == "a16w16" and step["float_weights"] == str((tmp_path / "float.onnx").resolve())
    rerun = tmp_path / "rerun.onnx"
    assert main(["run", str(patch), str(tmp_path / "qdq.onnx"), "-o", str(rerun), "-q", "--no-check"]) == 0
    assert onnx.load(rerun).graph.SerializeToString(deterministic=True) == model.graph.SerializeToString(
        deterministic=True)
