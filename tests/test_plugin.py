"""Plug-in passes from a third-party package (examples/plugin), found through the `qgraph.passes` entry-point
group and run from YAML exactly like built-ins; broken or mis-declared plug-ins are excluded with a warning."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from qgraph import Recipe
from qgraph.cli import main
from qgraph.pipeline import pass_api
from qgraph.runtime.compare import make_session, run

PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "plugin"


def _installed() -> bool:
    return any(ep.name == "neg_to_mul" for ep in entry_points(group=pass_api.ENTRY_POINT_GROUP))


@pytest.fixture
def example_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The example package's passes, discoverable: installed (CI installs it from its pyproject), or made visible
    for this test through a dist-info beside it that declares the same entry points."""
    if os.environ.get("CI") == "true":
        assert _installed(), "CI installs examples/plugin (pip install -e examples/plugin); it is missing"
    if not _installed():
        dist = tmp_path / "qgraph_example_passes-0.1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: qgraph-example-passes\nVersion: 0.1.0\n")
        # entry_points.txt is `name = module:attr` without TOML's quotes (tomllib needs Python 3.11: no parser)
        text = (PLUGIN / "pyproject.toml").read_text()
        section = text.split('[project.entry-points."qgraph.passes"]', 1)[1].split("\n[", 1)[0]
        pairs = [ln.split("=", 1) for ln in section.splitlines() if "=" in ln and not ln.lstrip().startswith("#")]
        lines = "".join(f"{name.strip()} = {target.strip().strip(chr(34))}\n" for name, target in pairs)
        assert lines.count("\n") >= 2, section  # neg_to_mul and critical_path
        (dist / "entry_points.txt").write_text("[qgraph.passes]\n" + lines)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.syspath_prepend(str(PLUGIN))
    pass_api.rediscover()
    yield
    for name in ("neg_to_mul", "critical_path"):
        pass_api._REGISTRY.pop(name, None)
    for mod in [m for m in sys.modules if m.startswith("qgraph_example_passes")]:
        sys.modules.pop(mod)
    pass_api.rediscover()


def _neg_model() -> onnx.ModelProto:
    """y = Neg(Relu(Neg(x))) in the top graph, and Neg inside both branches of an If."""
    then_b = helper.make_graph([helper.make_node("Neg", ["y"], ["t"], name="then_neg")], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4])])
    else_b = helper.make_graph([helper.make_node("Identity", ["y"], ["e"], name="else_id")], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4])])
    nodes = [helper.make_node("Neg", ["x"], ["a"], name="neg1"), helper.make_node("Relu", ["a"], ["b"], name="relu"),
             helper.make_node("Neg", ["b"], ["y"], name="neg2"),
             helper.make_node("If", ["c"], ["z"], name="branch", then_branch=then_b, else_branch=else_b)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
                                           helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_example_plugins_run_from_yaml(example_plugins: None, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    onnx.save(_neg_model(), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    assert main(["run", str(PLUGIN / "recipe.yaml"), str(tmp_path / "m.onnx"), "-o", str(out), "--verify"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "neg_to_mul: matched 3, rewritten 3" in err and "verified" in err
    model = onnx.load(str(out))
    ops = [n.op_type for n in model.graph.node]
    assert "Neg" not in ops and ops.count("Mul") == 2
    then_b = next(a.g for n in model.graph.node if n.op_type == "If" for a in n.attribute if a.name == "then_branch")
    assert [n.op_type for n in then_b.node] == ["Mul"]
    x = np.array([1.0, -2.0, 3.5, 0.0], np.float32)
    for c in (True, False):
        got = run(make_session(model), {"x": x, "c": np.array(c)})["z"]
        want = run(make_session(_neg_model()), {"x": x, "c": np.array(c)})["z"]
        np.testing.assert_array_equal(got, want)


def test_critical_path_analysis(example_plugins: None) -> None:
    recipe = Recipe.from_text("name: r\npasses:\n  - pass: critical_path\n    show: 3\n")
    chain = onnx.parser.parse_model(
        '<ir_version: 8, opset_import: ["" : 17]> g (float[2] x) => (float[2] y) '
        "{ a = Relu(x) b = Neg(a) c = Abs(a) d = Add(b, c) y = Relu(d) }"
    )
    res = recipe.pipeline().run(chain).records[0].result
    assert res.details["length"] == 4 and res.details["nodes"] == 5  # Relu -> Neg|Abs -> Add -> Relu
    assert res.details["ops"] in ({"Relu": 2, "Add": 1, "Neg": 1}, {"Relu": 2, "Add": 1, "Abs": 1})
    assert len(res.details["path"]) == 3 and res.rewritten == 0 and not res.changed
    # what it found is a decision, so the run summary shows it (details and notes reach the report only)
    branch = next(op for op in res.details["ops"] if op not in ("Relu", "Add"))  # Neg or Abs: a tie
    assert res.decisions == [f"critical path: 4 of 5 nodes run one after another (Relu x2, {branch} x1, Add x1; "
                             f"starts at {res.details['path'][0]})"]


def test_a_broken_plugin_is_excluded_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "broken_plugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from qgraph import Pass, PassConfig\n"
        "class C(PassConfig):\n    pass\n"
        "class Misnamed(Pass[C]):\n    name = 'other_name'\n    config_class = C\n"
    )
    (pkg / "fails.py").write_text("raise ImportError('a dependency is missing')\n")
    dist = tmp_path / "broken_plugins-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugins\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[qgraph.passes]\nmisnamed = broken_plugins:Misnamed\nfails = broken_plugins.fails:X\n"
        "notapass = broken_plugins:C\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.warns(UserWarning) as record:
            passes = pass_api.rediscover()
        text = " ".join(str(w.message) for w in record)
        assert "'misnamed'" in text and "pass's name is 'other_name'" in text
        assert "'fails'" in text and "fails to import" in text
        assert "'notapass'" in text and "not a qgraph.Pass subclass" in text
        assert "fuse_batchnorm" in passes and "misnamed" not in passes and "other_name" not in passes
    finally:
        sys.modules.pop("broken_plugins", None)
        sys.modules.pop("broken_plugins.fails", None)
        monkeypatch.undo()
        pass_api.rediscover()
