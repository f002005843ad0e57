"""fold_constants: structure, batched evaluation, Q/DQ protection, size cap, subgraphs, real graphs, linearity.

Numeric tolerance: folding must not change results: ``max|new - old| <= 1e-5 * max|old|`` in onnxruntime.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from qgraph.passes.fold_constants import FoldConstants

from qgraph import GraphHandle, PassContext, Pipeline, get_pass
from qgraph.testing.models import light_model_path, random_feeds, run_ort

TOL = 1e-5


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_constant_subgraph_becomes_initializers(prep: Any) -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3] x) => (float[2,3] y, int64[2] s) {
      a = Constant<value = float[3] {1.0, 2.0, 3.0}>()
      two = Constant<value_float = 2.0>()
      b = Mul(a, two)
      c = Sqrt(b)
      shape = Constant<value = int64[2] {2, 3}>()
      fill = ConstantOfShape<value = float[1] {0.5}>(shape)
      d = Add(c, fill)
      s = Shape(x)
      e = Add(x, d)
      y = Relu(e)
    }""")
    out, (res,), _ = prep.apply(model, FoldConstants())
    assert [n.op_type for n in out.graph.node] == ["Constant", "Add", "Relu"]
    assert out.graph.node[0].output[0] == "s" and out.graph.node[0].name == "s/folded"
    assert out.graph.node[0].doc_string == "qgraph:fold_constants"
    inits = _inits(out)
    assert set(inits) == {"d"}  # intermediate results are not kept, the name of the result is
    np.testing.assert_allclose(inits["d"], np.sqrt([2.0, 4.0, 6.0]) + np.full((2, 3), 0.5), rtol=1e-7)
    d = res.details
    assert (d["constant_nodes"], d["shape_nodes"], d["evaluated_nodes"], d["sessions"]) == (3, 1, 4, 1)
    assert res.rewritten == 8 and res.nodes_removed == 7 and res.nodes_added == 1
    feed = random_feeds(model, 1)[0]
    assert prep.relative_error(model, out, feed) <= TOL


def test_qdq_on_weights_and_random_ops_are_never_folded(prep: Any) -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,4,4] x) => (float[1,3,2,2] y, float[2,2] r) {
      wq = QuantizeLinear(w, ws, wz)
      wd = DequantizeLinear(wq, ws, wz)
      y = Conv(x, wd)
      r = RandomNormal<shape = [2, 2], seed = 1.0>()
    }""")
    w = np.linspace(-1, 1, 3 * 2 * 3 * 3, dtype=np.float32).reshape(3, 2, 3, 3)
    for name, value in {"w": w, "ws": np.array(0.01, np.float32), "wz": np.array(0, np.int8)}.items():
        model.graph.initializer.append(numpy_helper.from_array(value, name))
    out, (res,), _ = prep.apply(model, FoldConstants())
    assert [n.op_type for n in out.graph.node] == ["QuantizeLinear", "DequantizeLinear", "Conv", "RandomNormal"]
    assert res.rewritten == 0
    assert [s.reason for s in res.skipped] == ["Q/DQ on a constant weight is kept: never folded"]


def test_batched_single_session_and_linear_walks() -> None:
    lines = [
        '<ir_version: 8, opset_import: ["" : 17]>',
        "g (float[4] x) => (float[4] y) {",
        "  c0 = Constant<value = float[4] {1.0, 2.0, 3.0, 4.0}>()",
    ]
    n = 1500
    for i in range(n):
        lines.append(f"  c{i + 1} = {'Sub' if i % 2 else 'Add'}(c{i}, c0)")  # 2*c0, c0, 2*c0, ...
    lines += [f"  y = Div(x, c{n})", "}"]
    model = onnx.parser.parse_model("\n".join(lines))
    handle = GraphHandle(model)
    res = FoldConstants().run(handle, PassContext())
    assert res.details["evaluated_nodes"] == n and res.details["sessions"] == 1
    assert len(handle.graph.nodes) == 1 and dict(handle.walks) == {}  # no whole-graph walk at all
    out = handle.to_onnx()
    assert _inits(out)[f"c{n}"].tolist() == [1.0, 2.0, 3.0, 4.0]
    feed = random_feeds(model, 1)[0]
    np.testing.assert_array_equal(run_ort(model, feed)[0], run_ort(out, feed)[0])


def test_size_cap(prep: Any) -> None:
    model = onnx.parser.parse_model(
        """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[64,64] x) => (float[64,64] y) {
      shape = Constant<value = int64[2] {64, 64}>()
      big = ConstantOfShape<value = float[1] {1.0}>(shape)
      col = Constant<value = float[64,1] {"""
        + ", ".join(["1.0"] * 64)
        + """}>()
      row = Constant<value = float[1,64] {"""
        + ", ".join(["2.0"] * 64)
        + """}>()
      outer = MatMul(col, row)
      z = Add(x, big)
      y = Mul(z, outer)
    }"""
    )
    out, (res,), _ = prep.apply(model, FoldConstants(max_output_bytes=1024))
    ops = [n.op_type for n in out.graph.node]
    assert ops == ["ConstantOfShape", "MatMul", "Add", "Mul"]
    reasons = sorted(s.reason for s in res.skipped)
    assert reasons == [
        "ConstantOfShape output size 16384 bytes (cap 1024)",
        "not folded: result 'outer' is 16384 bytes (cap 1024)",
    ]
    assert prep.relative_error(model, out, random_feeds(model, 1)[0]) <= TOL
    out_big, (res_big,), _ = prep.apply(model, FoldConstants())
    assert [n.op_type for n in out_big.graph.node] == ["Add", "Mul"] and res_big.skipped == []


def test_shape_of_static_tensor_needs_inference(prep: Any) -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3,4] x) => (float[2,12] y) {
      t = Relu(x)
      s = Shape<start = 0, end = 1>(t)
      minus = Constant<value = int64[1] {-1}>()
      target = Concat<axis = 0>(s, minus)
      y = Reshape(t, target)
    }""")
    out, (res,), handle = prep.apply(model, FoldConstants())
    assert [n.op_type for n in out.graph.node] == ["Relu", "Reshape"]
    assert _inits(out)["target"].tolist() == [2, -1]
    assert res.details["shape_nodes"] == 1 and handle.walks["export"] == 2  # one inference export + final export
    assert prep.relative_error(model, out, random_feeds(model, 1)[0]) <= TOL


def test_ir3_initializers_leave_graph_inputs() -> None:
    w = numpy_helper.from_array(np.full((2, 2), 0.5, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [2, 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])
    model.ir_version = 3
    result = Pipeline([get_pass("fold_constants")()]).run(model)
    assert [i.name for i in result.model.graph.input] == ["x"]
    assert [t.name for t in result.model.graph.initializer] == ["w"] and result.model.ir_version >= 4


def test_folds_inside_loop_and_if(prep: Any) -> None:
    f = TensorProto.FLOAT
    n = helper.make_node
    body = helper.make_graph(
        [
            n("Constant", [], ["k"], value=numpy_helper.from_array(np.array([2.0, 3.0], np.float32))),
            n("Mul", ["k", "outer_c"], ["k2"]),  # constant inside the body, from an outer-scope constant
            n("Add", ["acc", "k2"], ["acc_out"]),
            n("Identity", ["cond"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", 9, []),
            helper.make_tensor_value_info("acc", f, [2]),
        ],
        [helper.make_tensor_value_info("cond_out", 9, []), helper.make_tensor_value_info("acc_out", f, [2])],
    )
    then_g = helper.make_graph([n("Neg", ["outer_c"], ["t"])], "then", [], [helper.make_tensor_value_info("t", f, [2])])
    else_g = helper.make_graph([n("Abs", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", f, [2])])
    graph = helper.make_graph(
        [
            n("Loop", ["trip", "", "x"], ["looped"], body=body),
            n("If", ["flag"], ["branch"], then_branch=then_g, else_branch=else_g),
            n("Add", ["looped", "branch"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", f, [2]), helper.make_tensor_value_info("flag", 9, [])],
        [helper.make_tensor_value_info("y", f, [2])],
        [
            numpy_helper.from_array(np.array(3, np.int64), "trip"),
            numpy_helper.from_array(np.array([0.5, -1.0], np.float32), "outer_c"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    out, (res,), _ = prep.apply(model, FoldConstants())
    loop = next(x for x in out.graph.node if x.op_type == "Loop")
    body_out = loop.attribute[0].g
    assert [x.op_type for x in body_out.node] == ["Add", "Identity"]
    assert {t.name for t in body_out.initializer} >= {"k2"}
    if_node = next(x for x in out.graph.node if x.op_type == "If")
    then_out = next(a.g for a in if_node.attribute if a.name == "then_branch")
    assert [x.op_type for x in then_out.node] == ["Constant"]  # a folded subgraph output stays produced
    assert res.details["scopes"] == 4 and res.details["sessions"] == 2
    for flag in (True, False):
        feed = {"x": np.array([1.0, -2.0], np.float32), "flag": np.array(flag)}
        assert prep.relative_error(model, out, feed) <= TOL


def test_second_run_changes_nothing(prep: Any) -> None:
    model = onnx.load(light_model_path("shufflenet"))
    once, _, _ = prep.apply(model, FoldConstants())
    twice, (res,), _ = prep.apply(once, FoldConstants())
    assert (res.rewritten, res.nodes_added, res.nodes_removed) == (0, 0, 0)
    assert prep.graph_bytes(once) == prep.graph_bytes(twice)


@pytest.mark.parametrize("name", ["shufflenet", "resnet50"])
def test_raw_light_models_fold_their_weight_fills(name: str, prep: Any) -> None:
    """The onnx wheel's light models build every weight with ConstantOfShape (+ Unsqueeze): all of it folds."""
    model = onnx.load(light_model_path(name))
    before = prep.ops(model)
    assert before["ConstantOfShape"] > 0
    out, (res,), handle = prep.apply(model, FoldConstants())
    after = prep.ops(out)
    assert after["ConstantOfShape"] == 0 and after["Unsqueeze"] == 0
    assert res.details["sessions"] == 1 and sum(handle.walks.values()) == 1  # the final export only
    assert sum(after.values()) == sum(before.values()) - res.details["evaluated_nodes"]
    feed = random_feeds(model, 1)[0]
    assert prep.relative_error(model, out, feed) <= TOL


def test_pipeline_verify(prep: Any) -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[1,4] x) => (float[1,4] y) {
      a = Constant<value = float[4] {1.0, 2.0, 3.0, 4.0}>()
      b = Exp(a)
      y = Mul(x, b)
    }""")
    result = Pipeline([get_pass("fold_constants")()]).run(model, verify=True)
    assert [n.op_type for n in result.model.graph.node] == ["Mul"]
    assert result.records[0].verify is not None
