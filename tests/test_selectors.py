"""The selector language: names, regex, op types, ranges, exclusions, and unmatched reporting."""

from __future__ import annotations

import onnx
import pytest
from pydantic import ValidationError

from qgraph import GraphHandle, NodeSelector, SubgraphRange, select

NODES = [  # (name, op, inputs, output)
    ("enc/0/relu", "Relu", ["x"], "a"),
    ("enc/0/sig", "Sigmoid", ["a"], "b"),
    ("enc/1/relu", "Relu", ["b"], "c"),
    ("enc/1/tanh", "Tanh", ["c"], "d"),
    ("head/relu", "Relu", ["x"], "e"),
    ("head/add", "Add", ["d", "e"], "y"),
]


def _model() -> onnx.ModelProto:
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node(op, ins, [out], name=name) for name, op, ins, out in NODES], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8])],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture
def handle() -> GraphHandle:
    return GraphHandle(_model())


def test_each_criterion(handle: GraphHandle) -> None:
    assert select(handle, NodeSelector(names=("enc/0/sig",))).names == ["enc/0/sig"]
    assert select(handle, NodeSelector(regex=("^enc/1/",))).names == ["enc/1/relu", "enc/1/tanh"]
    assert select(handle, NodeSelector(op_types=("Relu",))).names == ["enc/0/relu", "enc/1/relu", "head/relu"]
    rng = NodeSelector(ranges=(SubgraphRange(start="a", end="d"),))
    assert select(handle, rng).names == ["enc/0/sig", "enc/1/relu", "enc/1/tanh"]
    by_node = NodeSelector(ranges=(SubgraphRange(start="enc/0/relu", end="enc/1/relu"),))
    assert select(handle, by_node).names == ["enc/0/relu", "enc/0/sig", "enc/1/relu"]


def test_union_exclude_and_everything(handle: GraphHandle) -> None:
    sel = NodeSelector(op_types=("Relu",), names=("head/add",), exclude=NodeSelector(regex=("^head/",)))
    assert select(handle, sel).names == ["enc/0/relu", "enc/1/relu"]
    assert len(select(handle, NodeSelector()).nodes) == 6
    assert NodeSelector().is_everything


def test_unmatched_criteria_are_reported(handle: GraphHandle) -> None:
    sel = NodeSelector(
        names=("nope",), regex=("^dec/",), op_types=("Conv", "Relu"),
        ranges=(SubgraphRange(start="e", end="a"),), exclude=NodeSelector(names=("ghost",)),
    )
    result = select(handle, sel)
    assert result.names == ["enc/0/relu", "enc/1/relu", "head/relu"]
    assert result.unmatched == [
        "names: 'nope' matched no node",
        "regex: '^dec/' matched no node name",
        "op_types: no Conv node in the graph",
        "ranges: no path from 'e' to 'a'",
        "exclude names: 'ghost' matched no node",
    ]


def test_invalid_regex_and_unknown_keys_are_rejected() -> None:
    with pytest.raises(ValidationError, match="invalid regular expression"):
        NodeSelector(regex=("(",))
    with pytest.raises(ValidationError, match="extra"):
        NodeSelector.model_validate({"name": ["a"]})


def test_selection_builds_the_analysis_views_once(handle: GraphHandle) -> None:
    for start, end in [("a", "d"), ("x", "y"), ("b", "c")]:
        select(handle, NodeSelector(ranges=(SubgraphRange(start=start, end=end),), op_types=("Relu",)))
    assert handle.walks["index"] == 1 and handle.walks["nx"] == 1
