"""The graph handle: indexes, networkx view, iterative toposort, cycles, tags, export."""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs
import pytest

from qgraph import GraphHandle, ModelError
from qgraph.graph import TAG_PREFIX


def _chain(n: int, reverse: bool) -> onnx.ModelProto:
    nodes = [onnx.helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"], name=f"n{i}") for i in range(n)]
    if reverse:
        nodes.reverse()
    graph = onnx.helper.make_graph(
        nodes, "chain",
        [onnx.helper.make_tensor_value_info("t0", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info(f"t{n}", onnx.TensorProto.FLOAT, [1])],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)


def test_toposort_has_no_recursion_limit() -> None:
    handle = GraphHandle(_chain(5000, reverse=True))
    handle.toposort()
    assert [n.name for n in handle.graph.nodes[:3]] == ["n0", "n1", "n2"]
    assert handle.graph.nodes[-1].name == "n4999"
    assert handle.walks["toposort"] == 1


def test_index_and_nx_view_are_cached_until_changed() -> None:
    handle = GraphHandle(_chain(10, reverse=False))
    assert handle.producer("t3") is handle.index.by_name["n2"]
    assert [n.name for n in handle.consumers("t3")] == ["n3"]
    assert handle.nx.number_of_edges() == 9
    assert handle.nx.edges[0, 1]["tensors"] == ["t1"]
    _ = handle.index, handle.nx, handle.index
    assert handle.walks["index"] == 1 and handle.walks["nx"] == 1
    handle.changed()
    _ = handle.nx
    assert handle.walks["index"] == 2 and handle.walks["nx"] == 2


def test_cycle_is_a_model_error() -> None:
    handle = GraphHandle(_chain(3, reverse=False))
    handle.graph.nodes[0].inputs[0] = handle.graph.nodes[2].outputs[0]
    with pytest.raises(ModelError, match="cycle"):
        handle.toposort()


def test_tags_survive_export_and_reimport() -> None:
    handle = GraphHandle(_chain(2, reverse=False))
    out = handle.graph.outputs[0]
    mid = gs.Variable("t2/pre", dtype=out.dtype, shape=out.shape)
    handle.graph.nodes[-1].outputs[0] = mid
    node = gs.Node("Neg", handle.unique_name("n1"), inputs=[mid], outputs=[out])
    handle.graph.nodes.append(node)
    handle.tag(node, "my_pass")
    model = handle.to_onnx()
    assert node.name == "n1_1"
    assert model.graph.node[-1].doc_string == TAG_PREFIX + "my_pass"
    again = GraphHandle(model)
    assert again.tags == {"n1_1": "my_pass"}
    assert again.to_onnx().graph.node[-1].doc_string == TAG_PREFIX + "my_pass"


def test_export_caps_ir_version_for_onnxruntime() -> None:
    model = _chain(2, reverse=False)
    model.ir_version = 14
    assert GraphHandle(model).to_onnx().ir_version == 10
    model.ir_version = 3
    assert GraphHandle(model).to_onnx().ir_version == 8  # opset 17 needs IR 8


def test_constant_values_from_initializers_and_constant_nodes() -> None:
    model = onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y) {
          a = Constant<value_floats = [1.5, 2.5]>()
          b = Constant<value_int = 7>()
          y = Add(x, a)
        }"""
    )
    handle = GraphHandle(model)
    assert handle.constant_value(handle.index.tensors["a"]).tolist() == [1.5, 2.5]  # type: ignore[union-attr]
    assert handle.constant_value(handle.index.tensors["b"]).tolist() == 7  # type: ignore[union-attr]
    assert handle.constant_value(handle.index.tensors["x"]) is None
