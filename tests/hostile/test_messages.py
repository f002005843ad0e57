"""Hostile input, part 2 (issue #17 items 8, 9, 11-16, 19, 20): what used to end in a traceback, a hang or a
misleading hint now ends in one paragraph naming the file, field or input and what to do."""

from __future__ import annotations

import json
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_support import Workspace, conv_model, one_input_model  # type: ignore[import-not-found]
from onnx import TensorProto, helper, numpy_helper


# ------------------------------------------------------------------ 8. recipes that attack the YAML loader
def _alias_bomb(levels: int) -> str:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, levels + 1):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "name: bomb\n" + "\n".join(lines) + "\npasses:\n  - pass: cleanup\n"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (_alias_bomb(9), "expands to more than 100000 nodes"),
        ("name: deep\npasses: " + "[" * 100_000 + "\n", "nests 100000 levels deep"),
        ("name: nul\x00\npasses:\n  - pass: cleanup\n", "contains a NUL byte"),
        ("name: t\npasses:\n  - pass: !foo cleanup\n", "YAML tags such as !foo are not used"),
    ],
    ids=["alias-bomb", "deep-nesting", "nul-byte", "tag"],
)
def test_recipes_that_attack_the_loader_fail_fast(ws: Workspace, text: str, says: str) -> None:
    (ws.root / "bad.yaml").write_text(text)
    start = time.perf_counter()
    ws.run("validate", ws.path("bad.yaml"), code=2, says=(says,))
    assert time.perf_counter() - start < 2.0


# ------------------------------------------------------------------ 9. a generator that never ends
def test_an_endless_generator_is_capped(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    (ws.root / "endless_data.py").write_text(
        "import numpy as np\n"
        "def feeds():\n"
        "    rng = np.random.default_rng(0)\n"
        "    while True:\n"
        "        yield {'x': rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}\n"
    )
    monkeypatch.syspath_prepend(str(ws.root))
    ws.run("run", ws.path("int8.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"), "--calibration-data",
           "endless_data:feeds", "--samples", "16", code=0, outputs=("out.onnx",),
           says=("read the first 16 samples of endless_data:feeds",))


# ------------------------------------------------------------------ 11. usage errors
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "Usage:"),
        (["bogus"], "No such command"),
        (["run", "{prep}", "{model}"], "Missing option"),
        (["lower", "{model}", "--opset", "abc", "-o", "{out}"], "Invalid value for '--opset'"),
        (["sensitivity", "{model}", "{model}", "--data", "{data}", "--jobs", "0"], "--jobs"),
        (["calibrate", "{int8}", "{model}", "-o", "{out}", "--calibration-data", "{data}", "--method", "bogus"],
         "--method 'bogus': choose one of minmax"),
        (["sensitivity", "{model}", "{model}", "--data", "{data}", "--samples", "-1"], "--samples"),
    ],
    ids=["no-args", "unknown-command", "missing-output", "opset-abc", "jobs-0", "method-bogus", "samples-neg"],
)
def test_usage_errors_exit_2(ws: Workspace, argv: list[str], says: str) -> None:
    names = {"{prep}": ws.path("prep.yaml"), "{int8}": ws.path("int8.yaml"), "{model}": ws.path("model.onnx"),
             "{data}": ws.path("data.npz"), "{out}": ws.path("out.json")}
    ws.run(*[names.get(a, a) for a in argv], code=2, says=(says,))


# ------------------------------------------------------------------ 12. inspect on files that are not models
@pytest.mark.parametrize(
    ("kind", "says"),
    [("truncated", "is not a readable ONNX model"), ("random", "not a readable ONNX model"),
     ("text", "not a readable ONNX model"), ("missing", "model file not found"), ("directory", "is a directory")],
)
def test_inspect_on_files_that_are_not_models(ws: Workspace, kind: str, says: str) -> None:
    bad = ws.root / "bad.onnx"
    if kind == "truncated":
        bad.write_bytes((ws.root / "model.onnx").read_bytes()[:50])
    elif kind == "random":
        bad.write_bytes(np.random.default_rng(3).integers(0, 256, 300, dtype=np.uint8).tobytes())
    elif kind == "text":
        bad.write_text("this is not a model\n" * 10)
    elif kind == "directory":
        bad.mkdir()
    ws.run("inspect", str(bad), code=2, says=(says,))


# ------------------------------------------------------------------ 13. external data that is missing or escapes
def _external_model(root: Path, location: str) -> Path:
    model = conv_model()
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    w.external_data.add(key="location", value=location)
    path = root / "ext" / "m.onnx"
    path.parent.mkdir(exist_ok=True)
    onnx.save(model, path)
    return path


@pytest.mark.parametrize(
    ("location", "says"),
    [("missing.data", "that file does not exist beside the model"), ("../secret.data", "outside the model's folder"),
     ("/etc/hostname", "an absolute path"), ("link.data", "outside the model's folder")],
    ids=["missing", "dotdot", "absolute", "symlink-out"],
)
def test_external_data_problems_name_the_tensor(ws: Workspace, location: str, says: str) -> None:
    (ws.root / "secret.data").write_bytes(b"\0" * 432)
    path = _external_model(ws.root, location)
    if location == "link.data":
        (path.parent / "link.data").symlink_to(ws.root / "secret.data")
    ws.run("inspect", str(path), code=2, says=("tensor 'W'", says))


# ------------------------------------------------------------------ 14. valid models the random feeds must fit
@pytest.mark.parametrize(
    ("elem", "shape", "op"),
    [(TensorProto.FLOAT, ["N", "T"], "Identity"), (TensorProto.FLOAT, None, "Identity"),
     (TensorProto.FLOAT, [0, 3], "Identity"), (TensorProto.BFLOAT16, [2], "Cast"), (TensorProto.BOOL, [], "Not")],
    ids=["dynamic-dims", "no-shape", "zero-size", "bfloat16", "scalar-bool"],
)
def test_random_and_verify_feeds_fit_odd_inputs(ws: Workspace, elem: int, shape: list[int | str] | None,
                                                op: str) -> None:
    onnx.save(one_input_model(elem, shape, op), ws.root / "odd.onnx")
    ws.run("lower", ws.path("odd.onnx"), "--opset", "13", "-o", ws.path("low.onnx"), "--verify", code=0,
           outputs=("low.onnx",))
    ws.run("run", ws.path("prep.yaml"), ws.path("odd.onnx"), "-o", ws.path("out.onnx"), "--verify", code=0,
           outputs=("out.onnx",))
    ws.run("diff", ws.path("odd.onnx"), ws.path("low.onnx"), "--inputs", "random", code=0)


# ------------------------------------------------------------------ 15. calibration data that is broken
def _scalar_model() -> onnx.ModelProto:
    """y = x * float(sr): one float input and a 0-d int64 input."""
    nodes = [helper.make_node("Cast", ["sr"], ["srf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Mul", ["x", "srf"], ["y"], name="mul")]
    graph = helper.make_graph(nodes, "s", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                                           helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_0d_array_is_one_sample_of_a_scalar_input(ws: Workspace) -> None:
    onnx.save(_scalar_model(), ws.root / "s.onnx")
    np.savez(ws.root / "s.npz", x=np.ones((1, 4), np.float32), sr=np.array(16000, np.int64))
    ws.run("run", ws.path("prep.yaml"), ws.path("s.onnx"), "-o", ws.path("out.onnx"), "--verify",
           "--calibration-data", ws.path("s.npz"), code=0, outputs=("out.onnx",))


MODULES = {
    "raises": "def feeds():\n    import numpy as np\n    yield {'x': np.zeros((1, 3, 8, 8), np.float32)}\n"
              "    raise RuntimeError('camera unplugged')\n",
    "returns_none": "def feeds():\n    return None\n",
    "exits": "import sys\ndef feeds():\n    sys.exit(3)\n",
    "exits_on_import": "import sys\nsys.exit(3)\ndef feeds():\n    return []\n",
    "syntax": "def feeds(:\n",
    "imports_missing": "import no_such_package_xyz\ndef feeds():\n    return []\n",
}


@pytest.mark.parametrize(
    ("spec", "says"),
    [("raises:feeds", "raised RuntimeError: camera unplugged"),
     ("returns_none:feeds", "returned NoneType, not an iterable of feed dicts"),
     ("exits:feeds", "called sys.exit(3)"), ("exits_on_import:feeds", "called sys.exit(3)"),
     ("syntax:feeds", "syntax error at"), ("imports_missing:feeds", "cannot import module 'imports_missing'"),
     (":feeds", "give it as package.module:function"), ("", "is empty")],
    ids=["raises", "none", "sys-exit", "sys-exit-import", "syntax", "import-error", "no-module", "empty"],
)
def test_broken_data_modules(ws: Workspace, monkeypatch: pytest.MonkeyPatch, spec: str, says: str) -> None:
    for name, text in MODULES.items():
        (ws.root / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(ws.root))
    for name in MODULES:
        sys.modules.pop(name, None)
    out = ws.run("run", ws.path("int8.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"),
                 "--calibration-data", spec, code=2, says=(says,), outputs=tuple(
                     str(p.relative_to(ws.root)) for p in ws.root.rglob("__pycache__*")))
    assert out.code == 2


@pytest.mark.parametrize("kind", ["foreign-zip", "pickled", "text"])
def test_npz_files_that_are_not_arrays(ws: Workspace, kind: str) -> None:
    bad = ws.root / "bad.npz"
    if kind == "foreign-zip":
        with zipfile.ZipFile(bad, "w") as z:
            z.writestr("readme.txt", "not an array")
    elif kind == "pickled":
        np.savez(bad, x=np.array([{"a": 1}], dtype=object))
    else:
        bad.write_text("x,y\n1,2\n")
    out = ws.run("run", ws.path("int8.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"),
                 "--calibration-data", str(bad), code=2, says=(str(bad),))
    assert "allow_pickle" not in out.text


def test_extra_arrays_may_have_other_sample_counts(ws: Workspace) -> None:
    np.savez(ws.root / "labeled.npz", x=np.zeros((4, 1, 3, 8, 8), np.float32), labels=np.arange(10))
    ws.run("run", ws.path("int8.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"), "--calibration-data",
           ws.path("labeled.npz"), code=0, outputs=("out.onnx",))


# ------------------------------------------------------------------ 16. opsets beyond what onnx knows
def test_opsets_beyond_the_installed_onnx(ws: Workspace) -> None:
    top = onnx.defs.onnx_opset_version()
    ws.run("lower", ws.path("model.onnx"), "--opset", "30", "-o", ws.path("o.onnx"), code=2,
           says=(f"supports opsets 7 to {top}",))
    (ws.root / "r.yaml").write_text("name: r\npasses:\n  - pass: raise_opset\n    opset: 29\n")
    ws.run("validate", ws.path("r.yaml"), code=2, says=(f"less than or equal to {top}",))
    (ws.root / "l.yaml").write_text("name: l\npasses:\n  - pass: lower_opset\n    opset: 1e23\n")
    ws.run("validate", ws.path("l.yaml"), code=2, says=("passes[0].opset",))


# ------------------------------------------------------------------ 19-20. clean machine output, honest hints
def test_graphsurgeon_warnings_never_reach_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    import onnx_graphsurgeon as gs

    import qgraph.graph  # noqa: F401  (installs the redirection)

    gs.logger.G_LOGGER.warning("a graphsurgeon warning")
    captured = capsys.readouterr()
    assert "a graphsurgeon warning" in captured.err
    assert captured.out == ""


def test_inspect_json_is_pure_json(ws: Workspace, capsys: pytest.CaptureFixture[str]) -> None:
    from qgraph.cli import main

    assert main(["inspect", ws.path("model.onnx"), "--json"]) == 0
    json.loads(capsys.readouterr().out)


def test_hints_do_not_mislead(ws: Workspace) -> None:
    onnx.save(one_input_model(TensorProto.FLOAT, None), ws.root / "ns.onnx")
    np.savez(ws.root / "ns.npz", a=np.zeros((2, 3), np.float64))
    out = ws.run("run", ws.path("prep.yaml"), ws.path("ns.onnx"), "-o", ws.path("o.onnx"), "--calibration-data",
                 ws.path("ns.npz"), code=2, says=("dtype float64 but the model expects float32", "np.float32"))
    assert "rank 0" not in out.text
    weird = ws.root / "a:b:c.onnx"
    ws.run("inspect", str(weird), code=2, says=("a:b:c.onnx",))


def test_string_inputs_are_not_called_np_object(ws: Workspace) -> None:
    onnx.save(one_input_model(TensorProto.STRING, ["N"]), ws.root / "str.onnx")
    np.savez(ws.root / "str.npz", a=np.zeros((2, 1), np.int32))
    out = ws.run("run", ws.path("prep.yaml"), ws.path("str.onnx"), "-o", ws.path("o.onnx"), "--calibration-data",
                 ws.path("str.npz"), code=2, says=("input 'a'",))
    assert "np.object" not in out.text


def test_duplicate_node_outputs_are_refused(ws: Workspace) -> None:
    model = conv_model()
    model.graph.node.insert(1, helper.make_node("Identity", ["x"], ["c"], name="clash"))
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), "unused"))
    onnx.save(model, ws.root / "clash.onnx")
    ws.run("inspect", ws.path("clash.onnx"), code=2, says=("tensor 'c' is produced twice",))
