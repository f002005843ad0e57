"""Fresh names (`qgraph.graph.fresh`): one rule for graphsurgeon and protos, every scope known."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import onnx
import pytest
from hypothesis import given
from onnx import helper, numpy_helper

from qgraph.graph import GraphHandle, ProtoNames, free_name, fresh_name, model_names
from qgraph.runtime.kernels.corrections import ProtoEmitter


def _model_with_a_body() -> onnx.ModelProto:
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["inner/t"], name="inner/node")], "then", [],
                             [helper.make_tensor_value_info("inner/t", onnx.TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["other"], name="neg")], "else", [],
                              [helper.make_tensor_value_info("other", onnx.TensorProto.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros(2, np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_every_scope_is_known() -> None:
    names = set(model_names(_model_with_a_body()))
    assert {"inner/t", "inner/node", "other", "neg", "if", "c", "x", "y", "w"} <= names
    fresh = ProtoNames(_model_with_a_body())
    assert fresh.fresh("inner/t") == "inner/t_1"  # a body's tensor is taken, as a top-graph one is
    assert fresh.fresh("neg") == "neg_1"
    assert fresh.fresh("neg") == "neg_2"  # handed-out names are remembered
    assert fresh.fresh("free") == "free"  # a free base is kept exactly: no rename without a clash
    assert fresh_name(_model_with_a_body(), "w") == "w_1"


def test_a_namespace_is_free_of_every_name_under_it() -> None:
    fresh = ProtoNames(_model_with_a_body())
    assert fresh.prefix("inner") == "inner_1/"  # "inner/t" and "inner/node" live under "inner/"
    assert fresh.prefix("inner") == "inner_2/"  # handed out once
    assert fresh.prefix("probe") == "probe/"
    with pytest.raises(ValueError, match="inside a namespace"):
        fresh.fresh("probe/x")  # names inside a handed-out namespace are its owner's
    assert fresh.fresh("probe") == "probe_1"
    assert fresh.prefix("neg") == "neg_1/"  # a stem equal to a name is not a free namespace either


def test_the_graphsurgeon_handle_follows_the_same_rule() -> None:
    handle = GraphHandle(_model_with_a_body())
    taken = set(model_names(_model_with_a_body()))
    for base in ("inner/t", "neg", "x", "y", "new"):
        assert handle.unique_name(base) == free_name(base, taken.__contains__)


@given(st.lists(st.sampled_from(["a", "a_1", "a/b", "a_2/c", "b", "a_1_1"]), max_size=8),
       st.lists(st.sampled_from(["a", "a/b", "b", "a_1"]), min_size=1, max_size=8))
def test_names_handed_out_are_distinct_and_unused(existing: list[str], asked: list[str]) -> None:
    fresh = ProtoNames(existing)
    given_out = [fresh.fresh(b) for b in asked]
    spaces = [fresh.prefix(b) for b in asked]
    assert len(set(given_out)) == len(given_out) and not set(given_out) & set(existing)
    assert len(set(spaces)) == len(spaces)
    for space in spaces:
        assert not any(n.startswith(space) or n == space[:-1] for n in [*existing, *given_out])



def test_the_emulation_emitter_follows_the_same_rule() -> None:
    """The CPU-emulation subgraphs (`qgraph.runtime.kernels.corrections.ProtoEmitter`) name by the same rule."""
    taken = set(model_names(_model_with_a_body()))
    emitter = ProtoEmitter(set(taken), opset=17)
    assert [emitter.name(b) for b in ("neg", "neg", "inner/t", "new")] == ["neg_1", "neg_2", "inner/t_1", "new"]
    assert emitter.const("w", [1.0]) == "w_1" and emitter.inits[0].name == "w_1"
