"""qgraph.graph.naming: one name per node, the same in every report and accepted by every selector."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph import GraphHandle, Pipeline, get_pass
from qgraph.analysis.diff.protos import ModelIndex
from qgraph.analysis.diff.structural import structural_diff
from qgraph.analysis.inspect import inspect_model
from qgraph.analysis.report import build_report
from qgraph.analysis.sensitivity.ranking import candidate_nodes
from qgraph.cli import main
from qgraph.graph import named_model, proto_node_names, unique_names
from qgraph.io.model_io import model_fingerprint
from qgraph.pipeline.recipe import Recipe
from qgraph.quant.qdq_graph import quantized_nodes
from qgraph.testing import mode_switched_net, ort_quantize_static
from qgraph.testing.mobilenet import mobilenet_v2

#: Unnamed nodes, a repeated name, a node named like a generated name, and two If branches that each write ``t``.
TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2] x, bool c) => (float[2] y, float[2] z) {
  a = Relu(x)
  b = Neg(a)
  d = Abs(b)
  e = Exp(d)
  z = Add(e, a)
  y = If(c) <then_branch = t1 () => (float[2] t) { t = Sigmoid(x) },
             else_branch = t2 () => (float[2] t) { t = Sigmoid(x) }>
}
"""


def _text_model() -> onnx.ModelProto:
    model = onnx.parser.parse_model(TEXT)
    nodes = model.graph.node
    nodes[1].name = nodes[2].name = "same"  # Neg and Abs share a name
    nodes[3].name = "Add(z)"  # a real name equal to the name the unnamed Add would get
    onnx.checker.check_model(model)
    return model


EXPECTED = ["Relu(a)", "same", "same#2", "Add(z)", "Add(z)#2", "If(y)", "Sigmoid(t)", "Sigmoid(t)#2"]


def test_the_rule_on_unnamed_repeated_and_colliding_names() -> None:
    model = _text_model()
    handle = GraphHandle(model)
    assert [n.name for g in handle.scopes() for n in g.nodes] == EXPECTED
    assert handle.naming.unnamed == ["Relu(a)", "Add(z)#2", "If(y)", "Sigmoid(t)", "Sigmoid(t)#2"]
    assert handle.naming.repeated == [("same", "same#2")]
    notice = handle.naming.notice()
    assert notice is not None and "5 unnamed node(s)" in notice and "same → same#2" in notice
    assert [n.name for n in model.graph.node] == ["", "same", "same", "Add(z)", "", ""]  # the input is untouched


def test_handle_proto_diff_and_inspect_give_the_same_names(tmp_path: Path) -> None:
    model = _text_model()
    scopes, naming = proto_node_names(model.graph)
    assert naming.names == EXPECTED and [len(names) for _, names in scopes] == [6, 1, 1]
    keys = [r.key for r in ModelIndex.build(model).nodes]
    # diff keys: the same names, prefixed by their scope inside the branches
    assert keys == [*EXPECTED[:6], "If(y).then_branch/Sigmoid(t)", "If(y).else_branch/Sigmoid(t)#2"]
    exported = GraphHandle(model).to_onnx()
    assert [n.name for g in (exported.graph, *(a.g for a in exported.graph.node[5].attribute)) for n in g.node] == \
        EXPECTED
    assert [r.key for r in ModelIndex.build(exported).nodes] == keys  # named output and unnamed input: one key each
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    info = inspect_model(path)
    assert sorted(info["subgraphs"]) == ["/If(y).else_branch", "/If(y).then_branch"]
    assert "5 unnamed node(s)" in info["node_naming"]


def test_named_models_keep_every_name_exactly() -> None:
    for model in (mobilenet_v2(width=0.25, resolution=32, classes=10), mode_switched_net()):
        names = [n.name for g in _scopes(model) for n in g.node]
        assert all(names) and len(set(names)) == len(names)
        handle = GraphHandle(model)
        assert not handle.naming.changed and handle.naming.notice() is None
        assert [n.name for g in _scopes(handle.to_onnx()) for n in g.node] == names
        assert named_model(model)[0] is model  # nothing to do: no copy
        assert [r.name for r in ModelIndex.build(model).nodes if not r.scope] == [n.name for n in model.graph.node]
    result = Pipeline([get_pass("fuse_batchnorm")()]).run(model := mobilenet_v2(width=0.25, resolution=32, classes=10))
    assert result.load_decisions == []
    original = {n.name for n in model.graph.node}
    assert {n.name for n in result.model.graph.node if n.op_type != "BatchNormalization"} <= original


def _scopes(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    return [g for g, _ in proto_node_names(model.graph)[0]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["", "", "a", "b", "a#2", "Relu(x)"]), st.sampled_from(["Relu", "Add"]),
                          st.sampled_from([[], [""], ["x"], ["y"], ["", "x"]])), max_size=12))
def test_rule_properties(nodes: list[tuple[str, str, list[str]]]) -> None:
    names = unique_names(nodes).names
    assert all(names) and len(set(names)) == len(names)
    seen: set[str] = set()
    for (given_name, _, _), final in zip(nodes, names, strict=True):
        if given_name and given_name not in seen:
            assert final == given_name  # the first node of a name keeps it exactly
        seen.add(given_name)
    again = unique_names([(n, op, outs) for n, (_, op, outs) in zip(names, nodes, strict=True)])
    assert again.names == names and not again.changed  # idempotent


def test_rule_is_linear_in_repeated_names() -> None:
    n = 20000  # quadratic numbering would probe 2e8 names here
    nodes = [("conv", "Conv", [f"t{i}"]) for i in range(n)] + [("", "Relu", ["same"])] * n
    start = time.perf_counter()
    names = unique_names(nodes).names
    assert time.perf_counter() - start < 5.0
    assert names[:3] == ["conv", "conv#2", "conv#3"] and names[n : n + 2] == ["Relu(same)", "Relu(same)#2"]
    assert len(set(names)) == 2 * n


# ------------------------------------------------------------------ onnxruntime's unnamed QDQ nodes, end to end
@pytest.fixture(scope="module")
def ort_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small MobileNetV2 without node names, and onnxruntime's QDQ model of it (compute nodes unnamed)."""
    folder = tmp_path_factory.mktemp("naming")
    model = mobilenet_v2(width=0.25, resolution=32, classes=10, seed=1)
    for node in model.graph.node:
        node.name = ""
    onnx.save(model, folder / "float.onnx")
    x = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    np.savez(folder / "data.npz", input=x)
    qdq = ort_quantize_static(folder / "float.onnx", folder / "qdq.onnx", [{"input": x[i : i + 1]} for i in range(4)])
    return {"folder": folder, "float": model, "qdq": qdq}


def _fallback(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    recipe = Recipe.from_dict({"name": "fb", "passes": [{"pass": "float_fallback", "nodes": {"names": names}}]})
    return recipe.pipeline().run(model).model


def _quantized(model: onnx.ModelProto) -> set[str]:
    return {n.name for n in quantized_nodes(GraphHandle(model))}


def _reads_dq(model: onnx.ModelProto, name: str) -> bool:
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    node = next(n for n in model.graph.node if n.name == name)
    return any(producer.get(t) == "DequantizeLinear" for t in node.input)


def test_sensitivity_names_select_exactly_that_node(ort_models: dict[str, Any], capsys: Any) -> None:
    folder, qdq = ort_models["folder"], ort_models["qdq"]
    assert sum(not n.name for n in qdq.graph.node) > 50  # onnxruntime left the compute nodes unnamed
    code = main(["sensitivity", str(folder / "float.onnx"), str(folder / "qdq.onnx"), "--eval-data",
                 str(folder / "data.npz"), "--json", str(folder / "s.json"), "--exact-top", "0", "-q"])
    assert code == 0
    printed = capsys.readouterr().out
    rows = json.loads((folder / "s.json").read_text())["nodes"]
    assert len(rows) == len(_quantized(qdq)) > 50  # every quantized node is a candidate (none "unusable")
    picked = rows[0]["name"]  # the most sensitive node, as the table prints it
    assert picked in printed and picked.startswith(rows[0]["op"] + "(")
    before = _quantized(qdq)
    out = _fallback(qdq, [picked])
    assert not _reads_dq(out, picked)  # its Q/DQ (activations and weight) are gone
    assert _quantized(out) == before - {picked}  # and only its


def test_diff_names_select_and_show_the_change(ort_models: dict[str, Any]) -> None:
    folder, model, qdq = ort_models["folder"], ort_models["float"], ort_models["qdq"]
    assert main(["diff", str(folder / "float.onnx"), str(folder / "qdq.onnx"), "--json", str(folder / "d.json")]) == 0
    structural = json.loads((folder / "d.json").read_text())["structural"]
    coverage = {r["node"]: r["status"] for r in structural["qdq_coverage"]["b"]["nodes"]}
    conv = next(k for k, status in coverage.items() if k.startswith("Conv(") and status == "int8")
    # the float model's unnamed Conv has the same name: the quantizer kept its output tensor
    assert conv in ModelIndex.build(model).by_key
    out = _fallback(qdq, [conv])
    after = {r.node: r.status for r in structural_diff(qdq, out).coverage_b.nodes}
    assert after[conv] == "float"
    assert {k for k, s in after.items() if s != coverage[k]} == {conv}  # exactly that node changed


def test_repeated_names_are_selected_one_by_one(ort_models: dict[str, Any]) -> None:
    qdq = onnx.ModelProto()
    qdq.CopyFrom(ort_models["qdq"])
    convs = [n for n in qdq.graph.node if n.op_type == "Conv"][:2]
    for node in convs:
        node.name = "dup"
    found, notes = candidate_nodes(qdq)
    assert {"dup", "dup#2"} <= {name for name, _ in found} and not notes
    out = _fallback(qdq, ["dup#2"])
    second = next(n for n in out.graph.node if n.output[0] == convs[1].output[0])
    first = next(n for n in out.graph.node if n.output[0] == convs[0].output[0])
    assert (first.name, second.name) == ("dup", "dup#2")
    assert not _reads_dq(out, "dup#2") and _reads_dq(out, "dup")


def test_run_of_an_unnamed_model_names_its_output_and_says_so(ort_models: dict[str, Any]) -> None:
    model = ort_models["float"]
    result = Pipeline([get_pass("fold_constants")()]).run(model)
    (decision,) = result.load_decisions
    assert decision.startswith(f"input model: {len(model.graph.node)} unnamed node(s) named <OpType>(<first output>)")
    diff = structural_diff(model, result.model)
    # node for node: every output node carries the name the diff gives the unnamed input's node
    assert diff.renamed == 0 and not diff.removed and not diff.added
    assert [n.name for n in result.model.graph.node] == [r.key for r in ModelIndex.build(model).nodes]
    recipe = Recipe.from_dict({"name": "fold", "passes": [{"pass": "fold_constants"}]})
    report = build_report(recipe, recipe.pipeline().run(model, keep_input=False))
    assert report.decisions[0] == {"pass": "load", "kind": "decision", "text": decision}  # shown in the report


def test_fingerprint_is_the_named_models() -> None:
    """A ranges file or provenance hash made on the unnamed model matches qgraph's named export of it."""
    model = _text_model()
    named, naming = named_model(model)
    assert naming.changed and named is not model
    assert model_fingerprint(model) == model_fingerprint(named)
    other = onnx.ModelProto()
    other.CopyFrom(named)
    other.graph.node[5].attribute[0].g.node[0].name = "renamed"  # a real change inside a body still counts
    assert model_fingerprint(other) != model_fingerprint(model)
