"""Control-flow bodies as standalone models (qgraph.runtime.bodies) and static quantization inside them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from qgraph import Pipeline
from qgraph.data import CallableSource
from qgraph.pipeline.pass_api import get_pass
from qgraph.runtime.bodies import BodyError, bodies, body_feeds, graft_body, outer_names, standalone_body
from qgraph.testing.control_flow import LOOP_TRIPS as TRIPS
from qgraph.testing.control_flow import loop_net
from qgraph.testing.names import occupied


def _feeds(n: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(n)]


def _run(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run(None, f)[0] for f in feeds])


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10((ref**2).sum() / ((ref - got) ** 2).sum()))


def test_loop_body_feeds_are_the_iterations() -> None:
    model = loop_net()
    (node, attr), = list(bodies(model))
    body = standalone_body(model, node, attr)
    assert outer_names(node.attribute[0].g) == ["w", "b"] and body.outer_inputs == []
    (feeds,) = body_feeds(model, [body], _feeds(4), limit=100)
    assert len(feeds) == 4 * TRIPS
    assert [int(f["i"]) for f in feeds[:TRIPS]] == list(range(TRIPS))
    # Iteration 0 starts from x; iteration k+1 from what the body computed at iteration k.
    x = _feeds(4)[0]["x"]
    np.testing.assert_array_equal(feeds[0]["h_in"], x)
    sess = ort.InferenceSession(body.model.SerializeToString(), providers=["CPUExecutionProvider"])
    _, h1 = sess.run(None, feeds[0])
    np.testing.assert_allclose(feeds[1]["h_in"], h1, rtol=1e-6)
    assert [len(f) for f in body_feeds(model, [body], _feeds(4), limit=5)] == [5]


def test_loop_body_is_quantized_statically() -> None:
    model = loop_net()
    data = CallableSource(lambda: _feeds(64), "loop samples")
    res = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(model, calibration_data=data)
    result = res.records[0].result
    assert result.details["subgraph_nodes_quantized_static"] == 1
    assert any(f"calibrated on {64 * TRIPS} execution(s)" in d for d in result.decisions)
    loop = next(n for n in res.model.graph.node if n.op_type == "Loop")
    inner = loop.attribute[0].g
    producers = {o: n.op_type for n in inner.node for o in n.output}
    matmul = next(n for n in inner.node if n.op_type == "MatMul")
    assert [producers.get(i) for i in matmul.input] == ["DequantizeLinear", "DequantizeLinear"]
    assert not {"w", "b"} & {i.name for i in inner.initializer}  # outer tensors stay outer
    onnx.checker.check_model(res.model, full_check=True)
    # subgraphs: dynamic keeps the previous behaviour (the body's MatMul quantized at run time, per batch).
    dyn = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni", subgraphs="dynamic")]).run(
        model, calibration_data=data)
    assert dyn.records[0].result.details["subgraph_nodes_quantized"] == 1
    # One static scale serves every iteration: as accurate as per-batch dynamic ranges on this loop, and integer
    # kernels throughout (measured 30.6 dB static vs 30.9 dB dynamic).
    held_out, ref = _feeds(32, seed=7), _run(model, _feeds(32, seed=7))
    static_db, dynamic_db = _sqnr(ref, _run(res.model, held_out)), _sqnr(ref, _run(dyn.model, held_out))
    assert static_db > 28 and static_db > dynamic_db - 1.5, (static_db, dynamic_db)


def test_a_branch_no_sample_takes_is_reported() -> None:
    from tests.passes.test_specialize_inputs import _feeds as mode_feeds
    from tests.passes.test_specialize_inputs import mode_switched_net

    model = mode_switched_net()
    data = CallableSource(lambda: mode_feeds(8, mode=1), "mode-1 samples")
    result = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(
        model, calibration_data=data).records[0].result
    assert any(d.startswith("switch.then_branch: calibrated on 8 execution(s)") for d in result.decisions)
    assert any(d.startswith("switch.else_branch: never ran on the calibration data") for d in result.decisions)
    # flagged for attention (the run summary never cuts it); the calibrated branch is routine
    assert [d.split(":")[0] for d in result.attention] == ["switch.else_branch"]
    assert any(s.node == "else/conv" for s in result.skipped)


def test_graft_refuses_a_body_whose_outputs_were_renamed() -> None:
    model = loop_net()
    (node, attr), = list(bodies(model))
    body = standalone_body(model, node, attr)
    renamed = onnx.ModelProto()
    renamed.CopyFrom(body.model)
    renamed.graph.output[1].name = "other"
    with pytest.raises(BodyError, match="renamed its outputs"):
        graft_body(model, body, renamed)


def test_large_weights_inside_a_branch_calibrate() -> None:
    """A branch holding its own large initializer (as folding inside a body leaves them): the calibration session
    gets its values (onnxruntime takes shared external initializers for the top graph only)."""
    from qgraph.graph.detach import DETACH_BYTES

    rng = np.random.default_rng(3)
    n = int(np.ceil(np.sqrt(DETACH_BYTES))) + 8  # still over the threshold once quantized to int8
    w = numpy_helper.from_array((rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32), "inner_w")

    def branch(name: str, scale: float) -> onnx.GraphProto:
        k = numpy_helper.from_array(np.array(scale, np.float32), f"{name}_k")
        nodes = [helper.make_node("MatMul", ["x", "inner_w" if name == "then" else "outer_w"], [f"{name}_m"],
                                  name=f"{name}/matmul"),
                 helper.make_node("Mul", [f"{name}_m", f"{name}_k"], [f"{name}_y"], name=f"{name}/mul")]
        inits = [w, k] if name == "then" else [k]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_y", 1, [1, n])], inits)

    outer = numpy_helper.from_array((rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32), "outer_w")
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["h"], then_branch=branch("then", 1.0), else_branch=branch("else", 2.0),
                          name="switch"),
         helper.make_node("MatMul", ["h", "outer_w"], ["y"], name="head")],  # calibrated with the If inside
        "big_branch", [helper.make_tensor_value_info("x", 1, [1, n]), helper.make_tensor_value_info("c", 9, [])],
        [helper.make_tensor_value_info("y", 1, [1, n])], [outer])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = [{"x": rng.standard_normal((1, n)).astype(np.float32), "c": np.array(i % 2 == 0)} for i in range(8)]
    res = Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(
        model, calibration_data=CallableSource(lambda: feeds, "both branches"))
    result = res.records[0].result
    assert result.details["subgraph_nodes_quantized_static"] == 2, result.decisions
    assert "head" in {u["node"] for u in result.details["quantized"]}
    for f in feeds[:2]:
        ref, got = _run(model, [f]), _run(res.model, [f])
        assert _sqnr(ref, got) > 25


def test_every_body_is_fed_from_one_session_and_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both branches of an If: one probe session, the data read once (not once per body)."""
    import qgraph.runtime.bodies as subgraphs
    from tests.passes.test_specialize_inputs import _feeds as mode_feeds
    from tests.passes.test_specialize_inputs import mode_switched_net

    sessions: list[object] = []
    real = subgraphs.make_session
    monkeypatch.setattr(subgraphs, "make_session", lambda m: sessions.append(m) or real(m))
    reads = {"n": 0}

    def data() -> list[dict[str, np.ndarray]]:
        reads["n"] += 1
        return mode_feeds(6, mode=1) + mode_feeds(4, mode=0)

    model = mode_switched_net()
    found = [standalone_body(model, n, a) for n, a in bodies(model)]
    per_body = body_feeds(model, found, data(), limit=100)
    assert len(sessions) == 1 and reads["n"] == 1
    assert {b.attr: len(f) for b, f in zip(found, per_body, strict=True)} == {"then_branch": 6, "else_branch": 4}


def test_loop_inputs_are_recorded_under_fresh_names() -> None:
    """Recording a Loop body's inputs lifts them out as extra Loop outputs (``<loop>__qgraph_input_<k>``, from
    ``<input>__qgraph_iter`` inside the body). A model already using those names gets the same recordings: the
    lifted tensors take fresh names (`qgraph.graph.ProtoNames`) instead of a second producer of the same tensor."""
    model = loop_net()
    (node, attr), = list(bodies(model))
    formal = [i.name for i in node.attribute[0].g.input]
    taken = [f"{name}__qgraph_iter" for name in formal] + [f"{node.name}__qgraph_input_{k}" for k in range(3)]
    squatted = occupied(model, taken)
    (plain,) = body_feeds(model, [standalone_body(model, node, attr)], _feeds(2), limit=100)
    (node_s, _), = list(bodies(squatted))
    (got,) = body_feeds(squatted, [standalone_body(squatted, node_s, attr)], _feeds(2), limit=100)
    assert len(plain) == 2 * TRIPS and [sorted(f) for f in got] == [sorted(f) for f in plain]
    for a, b in zip(plain, got, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
