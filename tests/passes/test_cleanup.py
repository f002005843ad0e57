"""cleanup: Identity/Dropout bypass, dead code, duplicate initializers, names, toposort, subgraphs, scale.

Numeric tolerance: cleanup must not change results: ``max|new - old| <= 1e-5 * max|old|`` in onnxruntime (in
practice the outputs are bit-identical).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from qgraph.passes.cleanup import Cleanup, CleanupDetails
from qgraph.passes.fold_constants import FoldConstants

from qgraph import GraphHandle, PassContext, Pipeline, get_pass
from qgraph.graph import proto_node_names
from qgraph.testing.models import light_model_path, random_feeds

TOL = 1e-5

MODEL = """
<ir_version: 8, opset_import: ["" : 13]>
g (float[2,4] x) => (float[2,4] y, float[2,4] z, float[2,4] passthrough) {
  a = Identity(x)
  b = Identity(a)
  m1 = Mul(b, w1)
  d = Dropout(m1)
  m2 = Mul(d, w2)
  dead = Neg(m2)
  dead2 = Exp(dead)
  y = Identity(m2)
  r = Relu(m1)
  z = Add(r, y)
  passthrough = Identity(x)
}
"""


def _model() -> onnx.ModelProto:
    model = onnx.parser.parse_model(MODEL)
    w = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    for name in ("w1", "w2"):  # same bytes: duplicates
        model.graph.initializer.append(numpy_helper.from_array(w, name))
    model.graph.initializer.append(numpy_helper.from_array(w * 7, "unused"))
    return model


def test_structure_and_counts(prep: Any) -> None:
    model = _model()
    out, (res,), _ = prep.apply(model, Cleanup())
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in out.graph.node]
    assert nodes == [
        ("Mul", ["x", "w1"], ["m1"]),
        ("Mul", ["m1", "w1"], ["y"]),  # y's Identity removed: the Mul now writes the graph output y
        ("Relu", ["m1"], ["r"]),
        ("Add", ["r", "y"], ["z"]),
        ("Identity", ["x"], ["passthrough"]),  # graph input -> graph output needs its Identity
    ]
    assert [t.name for t in out.graph.initializer] == ["w1"]
    # named on load (qgraph.graph.naming), by the outputs they had then: the second Mul keeps Mul(m2)
    assert [n.name for n in out.graph.node] == ["Mul(m1)", "Mul(m2)", "Relu(r)", "Add(z)", "Identity(passthrough)"]
    assert res.details == CleanupDetails(
        identity=3,
        dropout=1,
        dead_nodes=2,
        unused_initializers=0,
        unused_graph_inputs=0,
        duplicate_initializers=1,
        renamed_nodes=0,  # the model's nodes were named on load
        reordered_graphs=0,
        scopes=1,
    )
    assert res.nodes_removed == 6
    assert prep.relative_error(model, out, random_feeds(model, 1)[0]) == 0.0


def test_second_run_changes_nothing(prep: Any) -> None:
    once, _, _ = prep.apply(_model(), Cleanup())
    twice, (res,), _ = prep.apply(once, Cleanup())
    assert (res.matched, res.rewritten, res.nodes_removed) == (0, 0, 0)
    assert prep.graph_bytes(once) == prep.graph_bytes(twice)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("d = Dropout(x, ratio, train)", "training_mode is true"),
        ("d, mask = Dropout(x)\n  y2 = Cast<to = 1>(mask)", "its mask output is used"),
        ("d = Dropout(x, ratio, flag)", "training_mode is not a constant"),
    ],
)
def test_training_dropout_is_kept(text: str, reason: str, prep: Any) -> None:
    extra_out = ", float[2,4] y2" if "y2" in text else ""
    model = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2,4] x, bool flag) => (float[2,4] y{extra_out}) {{
      ratio = Constant<value = float {{0.5}}>()
      train = Constant<value = bool {{1}}>()
      {text}
      y = Relu(d)
    }}""")
    out, (res,), _ = prep.apply(model, Cleanup())
    assert prep.ops(out)["Dropout"] == 1 and res.details["dropout"] == 0
    assert any(s.reason == f"Dropout kept: {reason}" for s in res.skipped)


def test_inference_dropout_with_constant_false_flag_is_removed(prep: Any) -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2,4] x) => (float[2,4] y) {
      ratio = Constant<value = float {0.5}>()
      off = Constant<value = bool {0}>()
      d = Dropout(x, ratio, off)
      y = Relu(d)
    }""")
    out, (res,), _ = prep.apply(model, Cleanup())
    assert [n.op_type for n in out.graph.node] == ["Relu"] and res.details["dropout"] == 1


def test_unnamed_and_duplicate_names(prep: Any) -> None:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2] x) => (float[2] y) {
      a = Relu(x)
      b = Neg(a)
      y = Abs(b)
    }""")
    model.graph.node[0].name = "same"
    model.graph.node[0].doc_string = "qgraph:some_pass"
    model.graph.node[1].name = "same"
    out, (res,), _handle = prep.apply(model, Cleanup())
    assert [n.name for n in out.graph.node] == ["same", "same#2", "Abs(y)"]  # named on load
    assert res.details["renamed_nodes"] == 0
    assert [n.doc_string for n in out.graph.node] == ["qgraph:some_pass", "", ""]
    # nodes a pass left unnamed or named alike get the same rule from cleanup
    handle = GraphHandle(model)
    for node, name in zip(handle.graph.nodes, ["", "again", "again"], strict=True):
        node.name = name
    res = Cleanup().run(handle, PassContext())
    assert [n.name for n in handle.graph.nodes] == ["Relu(a)", "again", "again#2"]
    assert res.details["renamed_nodes"] == 2


def test_toposort_only_when_out_of_order_and_without_recursion(prep: Any) -> None:
    n = 5_000  # deeper than the recursion limit
    graph = onnx.GraphProto(name="chain")
    graph.input.append(helper.make_tensor_value_info("t0", TensorProto.FLOAT, [2]))
    graph.output.append(helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [2]))
    for i in reversed(range(n)):
        graph.node.append(helper.make_node("Neg", [f"t{i}"], [f"t{i + 1}"], name=f"neg{i}"))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    assert sys.getrecursionlimit() < n
    handle = GraphHandle(model)
    res = Cleanup().run(handle, PassContext())
    assert res.details["reordered_graphs"] == 1 and res.rewritten == 1
    assert [node.name for node in handle.graph.nodes[:3]] == ["neg0", "neg1", "neg2"]
    handle.changed()
    again = Cleanup().run(handle, PassContext())
    assert again.rewritten == 0 and again.details["reordered_graphs"] == 0


def test_large_fan_out_is_rewired_in_bulk() -> None:
    fan = 20_000
    graph = onnx.GraphProto(name="fan")
    graph.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]))
    graph.node.append(helper.make_node("Identity", ["x"], ["x_id"], name="id"))
    for i in range(fan):
        graph.node.append(helper.make_node("Neg", ["x_id"], [f"n{i}"], name=f"neg{i}"))
    graph.node.append(helper.make_node("Sum", [f"n{i}" for i in range(fan)], ["y"], name="sum"))
    graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1]))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    handle = GraphHandle(model)
    start = time.perf_counter()
    res = Cleanup().run(handle, PassContext())
    seconds = time.perf_counter() - start
    assert res.details["identity"] == 1 and len(handle.graph.nodes) == fan + 1
    assert all(node.inputs[0].name == "x" for node in handle.graph.nodes[:fan])
    assert seconds < 10.0, seconds  # O(fan-out): graphsurgeon's per-edge bookkeeping would be O(fan-out^2)
    assert dict(handle.walks) == {"cleanup": 1}


def test_subgraphs(prep: Any) -> None:
    f = TensorProto.FLOAT
    n = helper.make_node
    body = helper.make_graph(
        [
            n("Identity", ["acc"], ["a1"]),
            n("Mul", ["a1", "w"], ["acc_out"]),
            n("Identity", ["cond"], ["cond_out"]),
            n("Neg", ["acc"], ["unused"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", 9, []),
            helper.make_tensor_value_info("acc", f, [2]),
        ],
        [helper.make_tensor_value_info("cond_out", 9, []), helper.make_tensor_value_info("acc_out", f, [2])],
    )
    then_g = helper.make_graph([n("Identity", ["x"], ["t"])], "then", [], [helper.make_tensor_value_info("t", f, [2])])
    else_g = helper.make_graph(
        [n("Abs", ["x"], ["e0"]), n("Identity", ["e0"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", f, [2])],
    )
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
            numpy_helper.from_array(np.array([0.5, -1.0], np.float32), "w"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    out, (res,), _ = prep.apply(model, Cleanup())
    loop = next(x for x in out.graph.node if x.op_type == "Loop")
    assert [x.op_type for x in loop.attribute[0].g.node] == ["Mul", "Identity"]  # cond passthrough stays
    if_node = next(x for x in out.graph.node if x.op_type == "If")
    branches = {a.name: [x.op_type for x in a.g.node] for a in if_node.attribute}
    assert branches == {"then_branch": ["Identity"], "else_branch": ["Abs"]}  # outer x -> output keeps Identity
    assert res.details["identity"] == 2 and res.details["dead_nodes"] == 1 and res.details["scopes"] == 4
    names = [x.name for x in out.graph.node] + [x.name for x in loop.attribute[0].g.node]
    assert all(names) and len(set(names)) == len(names)
    for flag in (True, False):
        feed = {"x": np.array([1.0, -2.0], np.float32), "flag": np.array(flag)}
        assert prep.relative_error(model, out, feed) == 0.0


@pytest.mark.parametrize("name", ["densenet121", "inception_v2"])
def test_real_topology(name: str, light_model: Any, prep: Any) -> None:
    model = light_model(name)
    for node in model.graph.node[::2]:
        node.name = ""  # half the nodes unnamed
    out, (res,), handle = prep.apply(model, Cleanup())
    names = [n.name for n in out.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert res.details["renamed_nodes"] == 0  # named on load, by the one rule
    assert set(names) <= set(proto_node_names(model.graph)[1].names)  # the names diff/inspect give the input
    assert sum(handle.walks.values()) <= 2  # gs cleanup + final export
    assert prep.relative_error(model, out, random_feeds(model, 1)[0]) <= TOL


def test_pipeline_on_raw_light_model(prep: Any) -> None:
    """fold_constants → fuse_batchnorm → cleanup on the wheel's raw shufflenet (weights are constant fills)."""
    model = onnx.load(light_model_path("shufflenet"))
    passes = [get_pass(n)() for n in ("fold_constants", "fuse_batchnorm", "cleanup")]
    result = Pipeline(passes).run(model, verify=True)
    ops = prep.ops(result.model)
    assert ops["BatchNormalization"] == 0 and ops["ConstantOfShape"] == 0
    assert all(r.verify is not None for r in result.records)
    # every weight is the same fill, so the fused weights of equal shape collapse into one initializer each
    assert result.records[2].result.details["duplicate_initializers"] > 0
    handle = GraphHandle(result.model)
    again = Cleanup().run(handle, PassContext())
    assert again.rewritten == 0


def test_cleanup_then_fold_constants_are_compatible(prep: Any) -> None:
    _out, (res_c, res_f), _ = prep.apply(_model(), Cleanup(), FoldConstants())
    assert res_f.rewritten == 0 and res_c.rewritten > 0
