"""qgraph.remedy.apply: a remedy (float or 16-bit activations) for nodes anywhere in a model, If/Loop bodies
included."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qgraph import GraphHandle, NodeSelector, Pipeline, get_pass
from qgraph.data import CallableSource
from qgraph.pipeline.recipe import Recipe
from qgraph.quant.qdq_graph import quantized_nodes
from qgraph.quant.reference_weights import ReferenceWeights
from qgraph.remedy.apply import apply_remedy, body_candidates, remedy_model
from qgraph.runtime.compare import make_session
from qgraph.testing import mode_feeds, mode_switched_net


@pytest.fixture(scope="module")
def switched() -> onnx.ModelProto:
    """mode_switched_net quantized statically, both branches calibrated (mode 1 and mode 2 samples)."""
    feeds = mode_feeds(8, mode=1) + mode_feeds(8, mode=2, seed=3)
    return Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni")]).run(
        mode_switched_net(), calibration_data=CallableSource(lambda: feeds, "both modes")).model


def _branch(model: onnx.ModelProto, attr: str) -> onnx.GraphProto:
    node = next(n for n in model.graph.node if n.op_type == "If")
    return next(a.g for a in node.attribute if a.name == attr)


def _reads_dq(graph: onnx.GraphProto, name: str) -> bool:
    producer = {o: n for n in graph.node for o in n.output}
    node = next(n for n in graph.node if n.name == name)
    return any(i in producer and producer[i].op_type == "DequantizeLinear" for i in node.input)


def test_body_candidates_and_selector_filter(switched: onnx.ModelProto) -> None:
    found, notes = body_candidates(switched)
    assert sorted(found) == [("else/conv", "Conv"), ("else/relu", "Relu"), ("then/conv", "Conv"),
                             ("then/relu", "Relu")], found
    assert not notes
    convs, _ = body_candidates(switched, NodeSelector(op_types=("Conv",), exclude=NodeSelector(regex=("^else",))))
    assert convs == [("then/conv", "Conv")]


def test_remedy_model_reaches_one_branch_and_keeps_the_other(switched: onnx.ModelProto) -> None:
    out = remedy_model(switched, ["then/conv", "head"], "float")
    assert out.unplaced == [] and [scope for scope, _ in out.outcomes] == ["", "switch.then_branch"]
    assert not _reads_dq(_branch(out.model, "then_branch"), "then/conv")
    assert _reads_dq(_branch(out.model, "else_branch"), "else/conv")  # the other branch is untouched
    assert _reads_dq(_branch(switched, "then_branch"), "then/conv")  # the input model is not modified
    onnx.checker.check_model(out.model, full_check=True)
    names = [n for n, _ in body_candidates(switched)[0]] + ["head"]
    weights = ReferenceWeights(mode_switched_net())  # float weights by (output, position), bodies included
    every = remedy_model(switched, names, "float", weights).model
    for mode in (1, 2):  # every quantized node in float with its float weights: the float model, both branches
        feed = mode_feeds(1, mode=mode, seed=9)[0]
        (ref,), (got,) = make_session(mode_switched_net()).run(None, feed), make_session(every).run(None, feed)
        assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))
    assert remedy_model(switched, ["nope"], "float").unplaced == ["nope"]


def test_remedy_model_widens_inside_a_body(switched: onnx.ModelProto) -> None:
    out = remedy_model(switched, ["then/conv"], "a16w8")
    (scope, outcome), = out.outcomes
    assert scope == "switch.then_branch" and getattr(outcome, "widened", None) == ["then/conv"]
    then = _branch(out.model, "then_branch")
    sixteen = {t.name for t in then.initializer if t.data_type == onnx.TensorProto.UINT16}
    assert sixteen, "the branch's own 16-bit zero point"
    onnx.checker.check_model(out.model, full_check=True)  # the body's com.microsoft import reached the model
    assert any(o.domain == "com.microsoft" for o in out.model.opset_import)
    feed = mode_feeds(1, mode=1, seed=9)[0]
    assert make_session(out.model).run(None, feed)[0].shape == (1, 4, 8, 8)


def test_repeated_body_names_are_numbered_and_chosen_one_by_one(switched: onnx.ModelProto) -> None:
    model = onnx.ModelProto()
    model.CopyFrom(switched)
    for node in _branch(model, "else_branch").node:
        if node.name == "else/conv":
            node.name = "then/conv"  # the same name in both branches
    found, notes = body_candidates(model)
    names = [n for n, _ in found]
    # the If's attributes are sorted (else_branch first): its conv keeps the name, the then-branch one is #2
    assert sorted(names) == ["else/relu", "then/conv", "then/conv#2", "then/relu"] and not notes
    out = remedy_model(model, ["then/conv#2"], "float")
    assert out.unplaced == [] and [scope for scope, _ in out.outcomes] == ["switch.then_branch"]
    assert not _reads_dq(_branch(out.model, "then_branch"), "then/conv#2")  # exactly that node went to float
    assert _reads_dq(_branch(out.model, "else_branch"), "then/conv")  # its namesake in the other branch did not
    onnx.checker.check_model(out.model, full_check=True)


def test_apply_remedy_float_and_unknown(switched: onnx.ModelProto) -> None:
    handle = GraphHandle(switched)
    outcome = apply_remedy(handle, [n for n in quantized_nodes(handle) if n.name == "head"], "float")
    assert getattr(outcome, "fallen_back", None) == ["head"]
    with pytest.raises(ValueError, match="unknown remedy 'a16'"):
        apply_remedy(GraphHandle(switched), [], "a16")


def test_unnamed_body_nodes_are_chosen_by_the_name_reports_show(switched: onnx.ModelProto) -> None:
    model = onnx.ModelProto()
    model.CopyFrom(switched)
    for attr in ("then_branch", "else_branch"):
        for node in _branch(model, attr).node:
            node.name = ""  # an exporter that names nothing inside the branches
    found, _ = body_candidates(model)
    then_conv = next(n for n in _branch(model, "then_branch").node if n.op_type == "Conv")
    name = f"Conv({then_conv.output[0]})"
    assert (name, "Conv") in found
    recipe = {"name": "fb", "passes": [{"pass": "float_fallback", "nodes": {"names": [name]}}]}
    out = Recipe.from_dict(recipe).pipeline().run(model).model
    assert not _reads_dq(_branch(out, "then_branch"), name)  # that conv is float, its branch named on load
    else_conv = next(n for n in _branch(out, "else_branch").node if n.op_type == "Conv")
    assert _reads_dq(_branch(out, "else_branch"), else_conv.name)  # the other branch's conv is not
    onnx.checker.check_model(out, full_check=True)
