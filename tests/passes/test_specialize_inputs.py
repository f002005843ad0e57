"""``specialize_inputs``: fix a control input, inline the ``If`` it decides, then quantize the flat graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qgraph import DataError, GraphHandle, PassContext, PassError, Pipeline, RecipeError
from qgraph.data import CallableSource
from qgraph.pipeline.pass_api import get_pass
from qgraph.testing import mode_switched_net, target_session


def _feeds(n: int, mode: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32), "mode": np.array(mode, np.int64)}
            for _ in range(n)]


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    sess = target_session(model)
    names = {i.name for i in sess.get_inputs()}
    return np.asarray(sess.run(None, {k: v for k, v in feed.items() if k in names})[0])


@pytest.mark.parametrize("mode", [1, 0])
def test_the_selected_branch_is_inlined_and_results_are_identical(mode: int) -> None:
    model = mode_switched_net()
    res = Pipeline([get_pass("specialize_inputs")(inputs={"mode": mode})]).run(model)
    ops = [n.op_type for n in res.model.graph.node]
    assert "If" not in ops and "Equal" not in ops and ops.count("Conv") == 2
    assert [i.name for i in res.model.graph.input] == ["x"]
    onnx.checker.check_model(res.model, full_check=True)
    decisions = res.records[0].result.decisions
    assert decisions[0] == f"input mode fixed to {mode} (int64); the model no longer takes it"
    assert decisions[1].startswith(f"switch: condition is {bool(mode)}; inlined its {'then' if mode else 'else'}")
    for feed in _feeds(3, mode):  # same float results (onnxruntime may pick other kernels in a branch: 1e-5)
        ref = _run(model, feed)
        assert np.abs(ref - _run(res.model, feed)).max() <= 1e-5 * np.abs(ref).max()


def test_quantizing_after_specialization_reaches_the_branch_compute() -> None:
    model = mode_switched_net()
    data = CallableSource(lambda: _feeds(16), "mode-1 samples")
    flat = Pipeline([get_pass("specialize_inputs")(inputs={"mode": 1}),
                     get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(model, calibration_data=data)
    quantized_convs = {n.name for n in flat.model.graph.node if n.op_type == "Conv"
                       and any(i.endswith("/dq") for i in n.input)}
    assert quantized_convs == {"then/conv", "head"}
    # Unspecialized, the branch Conv cannot be calibrated and stays float.
    plain = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(model, calibration_data=data)
    branch = next(n for n in plain.model.graph.node if n.op_type == "If").attribute[0].g
    assert not any(n.op_type == "DequantizeLinear" for n in branch.node)
    ref = np.concatenate([_run(model, f) for f in _feeds(8)])
    got = np.concatenate([_run(flat.model, f) for f in _feeds(8)])
    assert 10 * np.log10((ref**2).sum() / ((ref - got) ** 2).sum()) > 30


def test_data_for_another_value_is_an_error() -> None:
    model = mode_switched_net()
    data = CallableSource(lambda: _feeds(4, mode=0), "mode-0 samples")
    with pytest.raises(DataError, match="input mode is 0 but the recipe fixed it to 1"):
        Pipeline([get_pass("specialize_inputs")(inputs={"mode": 1}),
                  get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(model, calibration_data=data)


def test_unknown_input_and_wrong_shape_are_refused() -> None:
    model = mode_switched_net()
    # in a pipeline, before any pass runs (`qgraph.pipeline.preflight`); the pass's own check for a caller running it
    # alone
    with pytest.raises(RecipeError, match=r"`inputs` names graph input 'rate'.* Its inputs: x, mode"):
        Pipeline([get_pass("specialize_inputs")(inputs={"rate": 1})]).run(model)
    with pytest.raises(PassError, match="has no input 'rate'"):
        get_pass("specialize_inputs")(inputs={"rate": 1}).requires(GraphHandle(model), PassContext())
    with pytest.raises(PassError, match="has shape"):
        Pipeline([get_pass("specialize_inputs")(inputs={"mode": [1, 2]})]).run(model)


def test_fallback_search_after_specialization_reads_the_same_data(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Later passes that validate the data against the specialized model (float_fallback's evaluation) get the
    samples without the fixed input, from an .npz that still holds it."""
    model = mode_switched_net()
    feeds = _feeds(8)
    npz = tmp_path / "cal.npz"
    np.savez(npz, x=np.concatenate([f["x"] for f in feeds]), mode=np.ones(8, np.int64))
    res = Pipeline([get_pass("specialize_inputs")(inputs={"mode": 1}),
                    get_pass("insert_qdq")(preset="ort-x86-vnni"),
                    get_pass("float_fallback")(auto={"target": "sqnr:20", "max_time": 60})]
                   ).run(model, calibration_data=str(npz))
    record = res.records[-1].result
    assert record.unmet is None and any("target met" in d for d in record.decisions), record.decisions


def gated_switched_net() -> onnx.ModelProto:
    """`mode_switched_net` at 16x16, then ``If(gate) {y * gain} else {y}`` whose ``gain`` (4 KB, a weightless
    placeholder in exports) stays inside a branch after ``mode`` is specialized."""
    model = mode_switched_net()
    g = model.graph
    for v in (*g.input[:1], *g.output):
        v.type.tensor_type.shape.dim[2].dim_value = v.type.tensor_type.shape.dim[3].dim_value = 16
    g.output[0].name = "y_pre"
    g.node[-1].output[0] = "y_pre"
    gain = numpy_helper.from_array(np.random.default_rng(5).uniform(0.5, 2, (1, 4, 16, 16)).astype(np.float32),
                                   "gain")
    then = helper.make_graph([helper.make_node("Mul", ["y_pre", "gain"], ["y_then"], name="gated/mul")], "then",
                             [], [helper.make_tensor_value_info("y_then", 1, None)], [gain])
    other = helper.make_graph([helper.make_node("Identity", ["y_pre"], ["y_else"], name="gated/id")], "else", [],
                              [helper.make_tensor_value_info("y_else", 1, None)])
    g.node.append(helper.make_node("If", ["gate"], ["y"], name="gated", then_branch=then, else_branch=other))
    g.input.append(helper.make_tensor_value_info("gate", 9, []))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("y", 1, [1, 4, 16, 16]))
    onnx.checker.check_model(model, full_check=True)
    return model


def _gated_feeds(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32), "mode": np.array(1, np.int64),
             "gate": np.array(i % 2 == 0)} for i in range(n)]


def _sqnr(model: onnx.ModelProto, got: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> float:
    ref = np.concatenate([_run(model, f) for f in feeds])
    out = np.concatenate([_run(got, f) for f in feeds])
    return float(10 * np.log10((ref**2).sum() / ((ref - out) ** 2).sum()))


@pytest.mark.parametrize("correction", ["optimize_rounding", "correct_bias"])
def test_weight_correction_after_specialization(correction: str) -> None:
    """The float reference of a weight-correcting pass is the specialized model (same names, same inputs), and a
    large weight left inside a branch reaches its sessions: the correction runs and lowers the output error."""
    model = gated_switched_net()
    data = CallableSource(lambda: _gated_feeds(16, 1), "mode-1 samples, both gates")
    qdq = get_pass("insert_qdq")(preset="ort-x86-vnni", weights={"per_channel": False})
    spec = get_pass("specialize_inputs")(inputs={"mode": 1})
    plain = Pipeline([spec, qdq]).run(model, calibration_data=data)
    fixed = Pipeline([spec, qdq, get_pass(correction)()]).run(model, calibration_data=data)
    details = fixed.records[-1].result.details
    assert set(details["layers"]) == {"then/conv", "head"}, details
    held_out = _gated_feeds(16, 2)
    assert _sqnr(model, fixed.model, held_out) > _sqnr(model, plain.model, held_out) + 0.3
