"""Weights owned by the graph handle (`qgraph.graph.detach`): exports identical to graphsurgeon's, weightless exports,
split/with_weights round trips, calibration sessions reading weights in place, external-data models end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qgraph import GraphHandle, Pipeline, get_pass, load_model, save_model
from qgraph.calibrate.session import Additions, calibration_session
from qgraph.errors import ModelError, WriteError
from qgraph.graph.detach import PLACEHOLDER, fill_weights, is_placeholder, split_weights, with_weights
from qgraph.testing import conv_bn_net


def _mixed_model() -> onnx.ModelProto:
    """Every kind of constant the detach code distinguishes: large raw float32/float16/int64, a large tensor in
    ``float_data`` form (not raw), a small one, a tensor with a doc_string, a large ``Constant`` node value."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")
    half = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float16), "half")
    idx = numpy_helper.from_array(np.arange(1024, dtype=np.int64) % 64, "idx")
    listed = helper.make_tensor("listed", TensorProto.FLOAT, [64, 64], rng.standard_normal(4096).tolist())
    small = numpy_helper.from_array(np.ones((64,), np.float32), "small")
    documented = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "documented")
    documented.doc_string = "kept as written"
    big_const = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "c")
    nodes = [
        helper.make_node("Constant", [], ["c_out"], name="const", value=big_const),
        helper.make_node("MatMul", ["x", "w"], ["a"], name="mm1"),
        helper.make_node("MatMul", ["a", "listed"], ["b"], name="mm2"),
        helper.make_node("MatMul", ["b", "documented"], ["c1"], name="mm3"),
        helper.make_node("MatMul", ["c1", "c_out"], ["d"], name="mm4"),
        helper.make_node("Cast", ["half"], ["half32"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["d", "half32"], ["e"], name="mm5"),
        helper.make_node("Add", ["e", "small"], ["f"], name="add"),
        helper.make_node("Gather", ["f", "idx"], ["y"], name="gather", axis=1),
    ]
    graph = helper.make_graph(
        nodes, "mixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1024])],
        [w, half, idx, listed, small, documented],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _bytes(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString(deterministic=True)


@pytest.mark.parametrize("read", [False, True])
@pytest.mark.parametrize("build", [_mixed_model, conv_bn_net])
def test_export_is_graphsurgeons_byte_for_byte(build, read: bool) -> None:  # type: ignore[no-untyped-def]
    """Byte for byte what graphsurgeon writes for the same graph, whether or not a pass read the weights."""
    model = build()
    plain = gs.import_onnx(model)
    handle = GraphHandle(model)
    if read:
        for g in (plain, handle.graph):
            for t in g.tensors().values():
                if isinstance(t, gs.Constant):
                    t.values  # noqa: B018
    expected = gs.export_onnx(plain, do_type_check=False)
    got = handle.to_onnx()
    assert [_bytes_t(t) for t in got.graph.initializer] == [_bytes_t(t) for t in expected.graph.initializer]
    assert [n.SerializeToString(deterministic=True) for n in got.graph.node] == [
        n.SerializeToString(deterministic=True) for n in expected.graph.node]


def _bytes_t(t: onnx.TensorProto) -> bytes:
    return t.SerializeToString(deterministic=True)


def test_handle_owns_its_weights() -> None:
    model = _mixed_model()
    handle = GraphHandle(model)
    before = _bytes(handle.to_onnx())
    for t in model.graph.initializer:  # the caller's protobuf can change or go: the handle does not read it
        t.ClearField("raw_data")
        t.ClearField("float_data")
    assert _bytes(handle.to_onnx()) == before
    w = handle.graph.tensors()["w"]
    assert isinstance(w, gs.Constant) and isinstance(w._values, np.ndarray)
    # a view of the bytes protobuf handed out (no second copy): read-only, passes replace weights
    assert not w._values.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        w._values[...] = 0
    listed = handle.graph.tensors()["listed"]  # not in raw_data form: kept as a protobuf of its own
    assert isinstance(listed, gs.Constant) and not isinstance(listed._values, np.ndarray)


def test_weightless_export_then_fill_is_the_full_export() -> None:
    handle = GraphHandle(_mixed_model())
    full = handle.to_onnx()
    light, held = handle.weightless_export()
    names = {t.name for t in light.graph.initializer if is_placeholder(t)}
    assert names == {"w", "half", "idx"} and set(held) == names  # not "documented" (a doc_string) nor "listed"
    assert full.ByteSize() - light.ByteSize() > 0.99 * sum(a.nbytes for a, _ in held.values())
    for t in light.graph.initializer:
        if t.name in names:
            assert not t.HasField("raw_data") and list(t.dims) == list(held[t.name][0].shape)
            assert t.external_data[0].value == PLACEHOLDER
    fill_weights(light, held)
    assert _bytes(light) == _bytes(full)


def test_shapes_use_the_weightless_export() -> None:
    handle = GraphHandle(_mixed_model())
    shapes = handle.shapes()
    assert shapes["y"] == ((2, 1024), TensorProto.FLOAT)
    assert shapes["w"] == ((64, 64), TensorProto.FLOAT)


def test_split_weights_round_trip_and_caller_untouched() -> None:
    model = _mixed_model()
    original = _bytes(model)
    light, weights = split_weights(model)
    assert _bytes(model) == original
    assert set(weights) == {"w", "half", "idx"}
    np.testing.assert_array_equal(weights["w"], numpy_helper.to_array(model.graph.initializer[0]))
    assert _bytes(with_weights(light, weights)) == original


def test_calibration_session_reads_weights_in_place_with_identical_results() -> None:
    model = _mixed_model()
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["y"], {"x": x})[0]
    light, weights = split_weights(model)
    with calibration_session(light, Additions(), weights=weights) as sess:
        np.testing.assert_array_equal(sess.run(["y"], {"x": x})[0], reference)
    with calibration_session(model, Additions()) as sess:  # splits by itself
        np.testing.assert_array_equal(sess.run(["y"], {"x": x})[0], reference)


def test_external_data_round_trip_touches_only_the_output(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    model = conv_bn_net()
    onnx.save(model, str(src / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.onnx.data", size_threshold=0)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()}
    result = Pipeline([get_pass("fuse_batchnorm")(), get_pass("cleanup")()]).run(src / "m.onnx", keep_input=False)
    assert result.input_model is None
    out = save_model(result.model, tmp_path / "out.onnx", external_data=True)
    after = {p for p in tmp_path.rglob("*") if p.is_file()}
    assert after - set(before) == {out, tmp_path / "out.onnx.data"}
    assert all((p.stat().st_mtime_ns, p.read_bytes()) == state for p, state in before.items())
    x = np.random.default_rng(2).standard_normal((1, 3, 32, 32)).astype(np.float32)
    name = model.graph.input[0].name
    ref = ort.InferenceSession(str(src / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {name: x})
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {name: x})
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5 * float(np.abs(ref[0]).max()))
    reloaded = load_model(out)
    assert _bytes(reloaded.graph.node[0]) == _bytes(result.model.graph.node[0])


def _big_model() -> onnx.ModelProto:
    """Large raw tensors (over the 1 MiB streaming threshold) beside small and non-raw ones, plus metadata."""
    model = _mixed_model()
    rng = np.random.default_rng(3)
    model.graph.initializer.append(numpy_helper.from_array(rng.standard_normal((600, 600)).astype(np.float32), "big"))
    model.graph.initializer[-1].doc_string = "after raw_data in field order"
    model.graph.initializer.append(numpy_helper.from_array(np.arange(300_000, dtype=np.int64), "big_i64"))
    model.metadata_props.add(key="k", value="v")
    return model


def test_streamed_write_and_sizes_equal_protobufs() -> None:
    import io

    from qgraph.io.model_io import serialized_size, tensor_size, write_streamed

    model = _big_model()
    buf = io.BytesIO()
    write_streamed(model, buf)
    assert buf.getvalue() == _bytes(model)
    assert serialized_size(model) == model.ByteSize()
    assert [tensor_size(t) for t in model.graph.initializer] == [t.ByteSize() for t in model.graph.initializer]


def test_read_header_skips_the_graph(tmp_path: Path) -> None:
    from qgraph.io.model_io import read_header

    model = _big_model()
    onnx.save(model, str(tmp_path / "m.onnx"))
    header = read_header(tmp_path / "m.onnx")
    model.ClearField("graph")
    assert _bytes(header) == _bytes(model)
    (tmp_path / "bad.onnx").write_bytes(b"\xff\xff\xff")
    with pytest.raises(ModelError):
        read_header(tmp_path / "bad.onnx")


def test_streamed_write_refuses_a_raw_data_that_does_not_match_its_dims(tmp_path: Path) -> None:
    model = _big_model()
    model.graph.initializer[-2].dims[0] = 601  # 601 x 600 floats declared, 600 x 600 stored
    with pytest.raises(WriteError, match="'big'"):
        save_model(model, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_sessions_on_a_weightless_export_fill_the_placeholders_inside_bodies() -> None:
    """onnxruntime's shared initializers reach the top graph only: a placeholder inside an If branch is written
    into a copy (and only that one); a model without one is loaded as is."""
    from qgraph.graph.detach import fill_nested
    from qgraph.runtime.compare import make_session

    rng = np.random.default_rng(0)
    inner, outer = (rng.standard_normal((32, 32)).astype(np.float32) for _ in range(2))
    then = helper.make_graph([helper.make_node("MatMul", ["x", "inner"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 32])],
                             [numpy_helper.from_array(inner, "inner")])
    other = helper.make_graph([helper.make_node("Identity", ["z"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 32])])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "outer"], ["z"]),
         helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])], [numpy_helper.from_array(outer, "outer")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    export, held = GraphHandle(model).weightless_export()
    weights = {name: value for name, (value, _) in held.items()}
    assert set(weights) == {"inner", "outer"}
    filled, left = fill_nested(export, weights)
    assert filled is not export and set(left) == {"outer"}
    assert fill_nested(filled, left) == (filled, left)  # nothing nested left: the model itself
    x = rng.standard_normal((1, 32)).astype(np.float32)
    session = make_session(export, weights=weights)
    for cond, w in ((True, inner), (False, outer)):
        got = session.run(None, {"x": x, "c": np.array(cond)})[0]
        np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
