"""Hostile input, round 2 (issue #31): every file an input reads is safe from the outputs, the gate never passes
what it did not check, invalid models are blamed on the model, and nothing hangs. One case per item of the issue,
each building its hostile files in the workspace (see `conftest.Workspace.run` for the promises checked)."""

from __future__ import annotations

import importlib.util
import os
import re
import stat
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_support import RECIPE_PREP, Workspace, conv_model, one_input_model  # type: ignore[import-not-found]

import qgraph.cli._app as _app
from qgraph.cli import main


def save_external(ws: Workspace, name: str = "m.onnx", data: str = "m.data") -> None:
    """``conv_model`` saved as ``name`` with every weight in ``data`` beside it."""
    onnx.save(conv_model(), ws.root / name, save_as_external_data=True, location=data, size_threshold=0)


# ------------------------------------------------------------------ 1. outputs never replace a file an input reads
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "{prep.yaml}", "{m.onnx}", "-o", "{m.data}"], "-o {m.data}: writing it would overwrite a file"),
        (["run", "{prep.yaml}", "{m.onnx}", "-o", "{m}"], "the model's weights would go to {m.data}"),
        (["lower", "{m.onnx}", "--opset", "13", "-o", "{m.data}"], "({m.onnx}, which reads {m.data})"),
        (["diff", "{m.onnx}", "{model.onnx}", "--html", "{m.data}"], "--html {m.data}: writing it"),
        (["diff", "{model.onnx}", "{m.onnx}", "--json", "{hard.data}"], "which reads"),
        (["check", "{model.onnx}", "{m.onnx}", "--data", "{data.npz}", "--json", "{m.data}"], "which reads"),
        (["run", "{prep.yaml}", "{model.onnx}", "-o", "{folder/b.npz}", "--calibration-data", "{folder}"],
         "which reads {folder/b.npz}"),
        (["run", "{cal.yaml}", "{model.onnx}", "-o", "{data.npz}"], "is also an input"),
        (["diff", "{model.onnx}", "{model.onnx}", "--inputs", "{data.npz}", "--metric", "{metric.py}:score",
          "--json", "{metric.py}"], "is also an input"),
        (["calibrate", "{cal.yaml}", "{model.onnx}", "-o", "{data.npz}"], "is also an input"),
    ],
    ids=["run-external-data", "run-companion-data", "lower-external-data", "diff-html", "diff-json-hard-link",
         "check-json", "data-folder-file", "recipe-calibration-data", "metric-file", "calibrate-recipe-data"],
)
def test_an_output_never_overwrites_a_file_an_input_reads(ws: Workspace, argv: list[str], says: str) -> None:
    save_external(ws)
    os.link(ws.root / "m.data", ws.root / "hard.data")
    (ws.root / "folder").mkdir()
    for name in ("a.npz", "b.npz"):
        (ws.root / "folder" / name).write_bytes((ws.root / "data.npz").read_bytes())
    (ws.root / "cal.yaml").write_text(RECIPE_PREP + f"calibration: {{data: {ws.path('data.npz')}}}\n")
    (ws.root / "metric.py").write_text("def score(outputs, refs):\n    return 1.0\n")
    names = ["prep.yaml", "cal.yaml", "m.onnx", "m.data", "hard.data", "model.onnx", "data.npz", "folder/b.npz",
             "folder", "metric.py", "m"]

    def fill(text: str) -> str:
        for name in sorted(names, key=len, reverse=True):
            text = text.replace("{" + name + "}", ws.path(name))
        return text

    ws.run(*[fill(a) for a in argv], code=2, says=(fill(says),))


# ------------------------------------------------------------------ 2-5, 20. the gate passes only what it checked
def two_outputs(order: tuple[str, str], names: tuple[str, str] = ("y", "s"),
                weight: np.ndarray | None = None) -> onnx.ModelProto:
    """``conv_model`` (with ``weight``) with a second output ``s = Sigmoid(y)``; ``order`` lists the graph outputs
    by role."""
    model = conv_model(weight=weight)
    g = model.graph
    for n in g.node:
        if n.name == "fc":
            n.output[0] = "y0"
    g.node.append(onnx.helper.make_node("Sigmoid", ["y0"], ["s0"], name="sig"))
    g.node.append(onnx.helper.make_node("Identity", ["y0"], [names[0]], name="out_y"))
    g.node.append(onnx.helper.make_node("Identity", ["s0"], [names[1]], name="out_s"))
    del g.output[:]
    by_role = {"y": names[0], "s": names[1]}
    for role in order:
        g.output.append(onnx.helper.make_tensor_value_info(by_role[role], onnx.TensorProto.FLOAT, ["N", 2]))
    return model


def nan_model() -> onnx.ModelProto:
    """``conv_model`` whose conv weights are all NaN (every output value NaN)."""
    return conv_model(weight=np.full((4, 3, 3, 3), np.nan, np.float32))


def test_outputs_are_paired_by_name(ws: Workspace) -> None:
    onnx.save(two_outputs(("y", "s")), ws.root / "a.onnx")
    onnx.save(two_outputs(("s", "y")), ws.root / "swapped.onnx")
    onnx.save(two_outputs(("y", "s"), names=("logits", "probs")), ws.root / "renamed.onnx")
    out = ws.run("check", ws.path("a.onnx"), ws.path("swapped.onnx"), "--data", ws.path("data.npz"), code=0,
                 says=("PASS",))
    assert "inf (exact)" in out.text  # the same outputs, compared name by name whatever their order
    ws.run("check", ws.path("a.onnx"), ws.path("renamed.onnx"), "--data", ws.path("data.npz"), code=1,
           says=("its outputs are ['logits', 'probs'], the reference's ['y', 's']", "compared by name"))


@pytest.mark.parametrize(
    ("case", "code", "says"),
    [
        ("metric-inf", 1, ("the metric", "returned inf on the reference's outputs", "FAIL")),
        ("metric-exit", 2, ("--metric", "called sys.exit(0)", "A metric returns a float")),
        ("nan-candidate-100%", 1, ("candidate 1", "NaN/Inf in output y (8 of 8 values)", "FAIL")),
        ("max-drop-200%", 2, ("--max-drop '200%'", "at most 100%")),
        ("nan-reference", 1, ("reference (", "NaN/Inf in output y (8 of 8 values)", "fix the reference",
                              "│ not compared │")),
        ("nan-reference-outputs", 1, ("reference outputs (", "NaN/Inf in output y (1 of 8 values)")),
        ("total-drop-unit", 0, ("PASS",)),
    ],
)
def test_the_gate_never_passes_what_it_did_not_check(ws: Workspace, case: str, code: int, says: tuple[str, ...],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_app.out, "width", 400)  # whole table cells on any terminal
    onnx.save(nan_model(), ws.root / "nan.onnx")
    (ws.root / "metric.py").write_text("import math, sys\ndef inf(outputs, refs):\n    return math.inf\n"
                                       "def leave(outputs, refs):\n    sys.exit(0)\n")
    refs = {"y": np.zeros((4, 2), np.float32)}
    refs["y"][0, 0] = np.nan
    np.savez(ws.root / "refs.npz", **refs)
    base = ["check", ws.path("model.onnx"), ws.path("model.onnx"), "--data", ws.path("data.npz")]
    argv = {
        "metric-inf": [*base, "--metric", ws.path("metric.py") + ":inf"],
        "metric-exit": [*base, "--metric", ws.path("metric.py") + ":leave"],
        "nan-candidate-100%": ["check", ws.path("model.onnx"), ws.path("nan.onnx"), "--data", ws.path("data.npz"),
                               "--max-drop", "100%"],
        "max-drop-200%": [*base, "--max-drop", "200%"],
        "nan-reference": ["check", ws.path("nan.onnx"), ws.path("model.onnx"), "--data", ws.path("data.npz")],
        "nan-reference-outputs": ["check", ws.path("model.onnx"), "--reference-outputs", ws.path("refs.npz"),
                                  "--data", ws.path("data.npz")],
        "total-drop-unit": [*base, "--max-drop", "1%", "--max-total-drop", "0.001"],
    }[case]
    out = ws.run(*argv, code=code, says=says)
    if case == "nan-reference":
        assert re.search(r"drops [\d.]+%", out.text) is None  # the good candidate is not blamed
    if case == "total-drop-unit":
        assert "│ 0% │ 0 │ ok" in out.text, out.text  # the step drop in %, the absolute total drop without


# ------------------------------------------------------------------ 10. an invalid model is the model's fault
def invalid_model(kind: str) -> onnx.ModelProto:
    """``conv_model`` broken one way: a tensor nothing produces, an op the default domain lacks, a tensor nothing
    produces inside an If body, a graph output nobody produces."""
    model = conv_model()
    g = model.graph
    h = onnx.helper
    if kind == "undefined-tensor":
        g.node[1].input[0] = "ghost"  # relu reads a tensor that does not exist
    elif kind == "unknown-op":
        g.node[1].op_type = "Reluu"
    elif kind == "undefined-in-subgraph":
        body = h.make_graph([h.make_node("Identity", ["ghost"], ["t"], name="inner")], "then",
                            [], [h.make_tensor_value_info("t", onnx.TensorProto.FLOAT, None)])
        other = h.make_graph([h.make_node("Identity", ["y"], ["e"], name="inner_e")], "else",
                             [], [h.make_tensor_value_info("e", onnx.TensorProto.FLOAT, None)])
        g.initializer.append(onnx.numpy_helper.from_array(np.array(True), "cond"))
        g.node.append(h.make_node("If", ["cond"], ["z"], name="branch", then_branch=body, else_branch=other))
        g.output.append(h.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None))
    else:  # an output nobody produces
        g.output.append(h.make_tensor_value_info("nobody", onnx.TensorProto.FLOAT, ["N", 2]))
    return model


@pytest.mark.parametrize(("kind", "says"), [
    ("undefined-tensor", "input 'ghost' is produced by no node"),
    ("unknown-op", "Reluu does not exist at opset 17"),
    ("undefined-in-subgraph", "input 'ghost' is produced by no node"),
    ("output-nobody-produces", "graph output 'nobody' is produced by no node"),
])
def test_an_invalid_input_model_is_blamed_on_the_model(ws: Workspace, kind: str, says: str) -> None:
    onnx.save(invalid_model(kind), ws.root / "bad.onnx")
    for argv in (["run", ws.path("prep.yaml"), ws.path("bad.onnx"), "-o", ws.path("out.onnx")],
                 ["lower", ws.path("bad.onnx"), "--opset", "13", "-o", ws.path("out.onnx")]):
        out = ws.run(*argv, code=2, says=("the input model is not a valid ONNX graph", says, "Fix the model"))
        assert "bug" not in out.text


# ------------------------------------------------------------------ 6, 11. values that do not fit are recipe errors
def control_model() -> onnx.ModelProto:
    """Inputs ``x: float32[1, 2]`` and ``sr: int64[]``; ``out = x * Cast(sr)``."""
    h = onnx.helper
    nodes = [h.make_node("Cast", ["sr"], ["srf"], name="cast", to=onnx.TensorProto.FLOAT),
             h.make_node("Mul", ["x", "srf"], ["out"], name="mul")]
    graph = h.make_graph(nodes, "control", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2]),
                                            h.make_tensor_value_info("sr", onnx.TensorProto.INT64, [])],
                         [h.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [1, 2])])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(("value", "says"), [
    ("{sr: 16000.7}", "input 'sr' is int64: 16000.7 is not a whole number"),
    ("{sr: true}", "input 'sr' is int64: True is a bool"),
    ("{sr: 1.0e+23}", "does not fit int64"),
    ("{x: [[1.0e+40, 1]]}", "does not fit float32"),
])
def test_a_value_that_does_not_fit_the_input_dtype_is_a_recipe_error(ws: Workspace, value: str, says: str) -> None:
    onnx.save(control_model(), ws.root / "control.onnx")
    (ws.root / "spec.yaml").write_text(f"name: spec\npasses:\n  - pass: specialize_inputs\n    inputs: {value}\n")
    out = ws.run("run", ws.path("spec.yaml"), ws.path("control.onnx"), "-o", ws.path("out.onnx"), code=2,
                 says=(f"{ws.path('spec.yaml')}:4:", says))
    assert "bug" not in out.text and "identical" not in out.text


@pytest.mark.parametrize(("option", "says"), [
    ("specialize_inputs\n    inputs: {sr: .nan}", "nan is not a finite number"),
    ("specialize_inputs\n    inputs: {sr: null}", "null is not a number"),
    ("specialize_inputs\n    inputs: {sr: abc}", "'abc' is not a number"),
    ("specialize_inputs\n    inputs: {x: [[1, 2], [3]]}", "ragged"),
    ("optimize_rounding\n    seed: -1", "greater than or equal to 0"),
])
def test_bad_option_values_fail_validate(ws: Workspace, option: str, says: str) -> None:
    (ws.root / "bad.yaml").write_text(f"name: bad\npasses:\n  - pass: {option}\n")
    ws.run("validate", ws.path("bad.yaml"), code=2, says=(f"{ws.path('bad.yaml')}:4:", says))


# ------------------------------------------------------------------ 7. the check measures what was written
def test_the_final_check_measures_the_model_written_not_the_file_read_back(ws: Workspace,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from qgraph.pipeline.runner import PipelineResult

    real_save = PipelineResult.save

    def save_then_replaced(self: PipelineResult, path: str | Path) -> Path:
        written = real_save(self, path)
        onnx.save(nan_model(), written)  # a concurrent writer replaces the file before the check
        return written

    monkeypatch.setattr(PipelineResult, "save", save_then_replaced)
    out = ws.run("run", ws.path("int8.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"), "--calibration-data",
                 ws.path("data.npz"), "--eval-data", ws.path("data.npz"), "--min-sqnr", "5", code=0,
                 says=("wrote",), outputs=("out.onnx",))
    assert "nan" not in out.text.lower().replace("nan/inf", "")


# ------------------------------------------------------------------ 8. nothing compared is said
def test_verify_says_when_nothing_could_be_compared(ws: Workspace) -> None:
    onnx.save(one_input_model(onnx.TensorProto.FLOAT, [0, 3], op="Cast"), ws.root / "zerosize.onnx")
    out = ws.run("run", ws.path("prep.yaml"), ws.path("zerosize.onnx"), "-o", ws.path("out.onnx"), "--verify",
                 code=0, says=("nothing could be compared", "every output was empty (0 values)"),
                 outputs=("out.onnx",))
    assert "relative error 0.00e+00" not in out.text


# ------------------------------------------------------------------ 9. non-finite search targets
@pytest.mark.parametrize("target", ["sqnr:nan", "sqnr:inf", "cosine:nan"])
def test_sensitivity_refuses_non_finite_targets(ws: Workspace, target: str) -> None:
    onnx.save(conv_model(), ws.root / "other.onnx")
    ws.run("sensitivity", ws.path("model.onnx"), ws.path("other.onnx"), "--data", ws.path("data.npz"), "--target",
           target, code=2, says=(f"invalid target {target!r}", "not a finite number"))


# ------------------------------------------------------------------ 15, 21, 22. labels checked before the run
@pytest.mark.parametrize(("labels", "says"), [
    (np.zeros((8,), np.int64), "8 label(s) for 4 sample row(s)"),
    (np.zeros((2,), np.int64), "2 label(s) for 4 sample row(s)"),
    (np.array(3), "a single value (a 0-d array)"),
])
@pytest.mark.parametrize("command", ["run", "check", "diff"])
def test_labels_that_do_not_match_the_samples_are_refused_before_any_output(ws: Workspace, labels: np.ndarray,
                                                                           says: str, command: str) -> None:
    np.save(ws.root / "labels.npy", labels)
    (ws.root / "metric.py").write_text("def acc(outputs, labels):\n    return 1.0\n")
    common = ["--labels", ws.path("labels.npy"), "--metric", ws.path("metric.py") + ":acc"]
    argv = {"run": ["run", ws.path("int8.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"),
                    "--calibration-data", ws.path("data.npz"), "--eval-data", ws.path("data.npz")],
            "check": ["check", ws.path("model.onnx"), ws.path("model.onnx"), "--data", ws.path("data.npz")],
            "diff": ["diff", ws.path("model.onnx"), ws.path("model.onnx"), "--inputs", ws.path("data.npz")]}[command]
    ws.run(*argv, *common, code=2, says=(f"labels {ws.path('labels.npy')}", says))


def test_a_metric_failing_after_the_write_says_the_output_was_written(ws: Workspace) -> None:
    (ws.root / "metric.py").write_text("def boom(outputs, refs):\n    raise RuntimeError('boom')\n")
    ws.run("run", ws.path("int8.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"), "--calibration-data",
           ws.path("data.npz"), "--eval-data", ws.path("data.npz"), "--metric", ws.path("metric.py") + ":boom",
           code=2, says=("raised RuntimeError: boom", f"{ws.path('out.onnx')} was written before the check failed"),
           outputs=("out.onnx",))


# ------------------------------------------------------------------ 18, 23. non-regular inputs, loops, foreign content
def make_special(ws: Workspace, kind: str, name: str) -> str:
    """A FIFO, a character device node copied from /dev/zero (skipped without the right to create one), or a
    symlink loop named ``name`` in the workspace."""
    path = ws.root / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.stat("/dev/zero").st_rdev)
        except (PermissionError, FileNotFoundError, AttributeError):
            pytest.skip("cannot create a device node here")
    else:
        path.symlink_to(path)
    return str(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
@pytest.mark.parametrize("kind", ["fifo", "device", "loop"])
@pytest.mark.parametrize("role", ["recipe", "model", "data", "labels", "check-candidate"])
def test_inputs_that_are_not_regular_files_are_refused_at_once(ws: Workspace, kind: str, role: str) -> None:
    says = {"fifo": "is a named pipe (FIFO), not a regular file", "device": "is a device, not a regular file",
            "loop": "is a symlink loop"}[kind]
    special = make_special(ws, kind, {"recipe": "r.yaml", "model": "m.onnx", "data": "d.npz", "labels": "l.npy",
                                      "check-candidate": "c.onnx"}[role])
    run = ["run", ws.path("int8.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"), "--calibration-data",
           ws.path("data.npz")]
    argv = {"recipe": ["run", special, ws.path("model.onnx"), "-o", ws.path("out.onnx")],
            "model": ["run", ws.path("prep.yaml"), special, "-o", ws.path("out.onnx")],
            "data": [*run[:-1], special],
            "labels": ["check", ws.path("model.onnx"), ws.path("model.onnx"), "--data", ws.path("data.npz"),
                       "--labels", special],
            "check-candidate": ["check", ws.path("model.onnx"), special, "--data", ws.path("data.npz")]}[role]
    ws.run(*argv, code=2, says=(special, says))


@pytest.mark.parametrize(("content", "name", "says"), [
    (b"x,y\n1,2\n", "data.txt.npz", "is not a .npz file (its content is text)"),
    (b"\x00\x01garbage", "folder/0.npy", "is not a .npy file (its content is something else)"),
])
def test_array_files_of_another_kind_say_what_they_are(ws: Workspace, content: bytes, name: str, says: str) -> None:
    onnx.save(one_input_model(onnx.TensorProto.FLOAT, [1, 3]), ws.root / "one.onnx")
    (ws.root / "folder").mkdir()
    (ws.root / name).write_bytes(content)
    data = ws.path(name) if name.endswith(".npz") else ws.path("folder")
    out = ws.run("diff", ws.path("one.onnx"), ws.path("one.onnx"), "--inputs", data, code=2, says=(says,))
    assert "pickle" not in out.text


# ------------------------------------------------------------------ 13. verify on inputs whose sizes are unknown
def matmul_model(shape: list[int | str] | None) -> onnx.ModelProto:
    """``y = x @ W`` with ``W: [4, 2]`` and ``x`` declared as ``shape`` (None: no shape at all)."""
    h = onnx.helper
    x = (h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape) if shape is not None else
         h.make_value_info("x", h.make_tensor_type_proto(onnx.TensorProto.FLOAT, shape=None)))
    graph = h.make_graph([h.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "mm", [x],
                         [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                         [onnx.numpy_helper.from_array(np.ones((4, 2), np.float32), "W")])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("shape", [["N", "K"], None], ids=["symbolic", "undeclared"])
@pytest.mark.parametrize("command", ["run", "lower"])
def test_verify_on_unknown_input_sizes_says_what_to_give(ws: Workspace, shape: list[int | str] | None,
                                                        command: str) -> None:
    onnx.save(matmul_model(shape), ws.root / "mm.onnx")
    argv = (["run", ws.path("prep.yaml"), ws.path("mm.onnx")] if command == "run" else
            ["lower", ws.path("mm.onnx"), "--opset", "13"])
    ws.run(*argv, "-o", ws.path("out.onnx"), "--verify", code=2,
           says=("onnxruntime cannot run the reference model on the inputs it was given (x: float32[",
                 "MatMul dimension mismatch", "give data whose samples have the sizes the model expects"))


# ------------------------------------------------------------------ 14, 15. inputs the two sides disagree on
@pytest.mark.parametrize(("elem", "shape", "says"), [
    (onnx.TensorProto.BFLOAT16, [1, 3], "bfloat16[1,3] in B"),
    (onnx.TensorProto.FLOAT16, [1, 3], "float16[1,3] in B"),
    (onnx.TensorProto.BOOL, [1, 3], "bool[1,3] in B"),
    (onnx.TensorProto.DOUBLE, [1, 3], "float64[1,3] in B"),
    (onnx.TensorProto.INT64, [1, 3], "int64[1,3] in B"),
    (onnx.TensorProto.UINT8, [1, 3], "uint8[1,3] in B"),
    (onnx.TensorProto.FLOAT, [0, 3], "float32[0,3] in B"),
])
def test_diff_names_an_input_the_models_type_differently(ws: Workspace, elem: int, shape: list[int],
                                                         says: str) -> None:
    onnx.save(one_input_model(onnx.TensorProto.FLOAT, [1, 3], op="Cast"), ws.root / "a.onnx")
    onnx.save(one_input_model(elem, shape, op="Cast"), ws.root / "b.onnx")
    ws.run("diff", ws.path("a.onnx"), ws.path("b.onnx"), "--inputs", "random", code=2,
           says=("input a: float32[1,3] in A", says))


def test_reference_outputs_that_are_not_an_npz_are_named(ws: Workspace) -> None:
    (ws.root / "refs.npz").write_bytes(b"\x80\x04\x95pickled-looking bytes")
    out = ws.run("check", ws.path("model.onnx"), "--reference-outputs", ws.path("refs.npz"), "--data",
                 ws.path("data.npz"), code=2, says=(f"--reference-outputs {ws.path('refs.npz')}: is not a .npz file",))
    assert "pickle" not in out.text


# ------------------------------------------------------------------ 16, 19. a Ray cluster that cannot answer
def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("command", ["run", "sensitivity"])
def test_a_ray_address_that_does_not_answer_is_said_at_once(ws: Workspace, command: str) -> None:
    pytest.importorskip("ray")
    address = f"127.0.0.1:{closed_port()}"
    argv = (["run", ws.path("prep.yaml"), ws.path("model.onnx"), "--out-dir", ws.path("out")] if command == "run"
            else ["sensitivity", ws.path("model.onnx"), ws.path("model.onnx"), "--data", ws.path("data.npz")])
    ws.run(*argv, "--executor", "ray", "--address", address, code=2,
           says=(f"--address {address}: the Ray cluster did not answer",))


def test_a_ray_client_address_without_the_client_extra_is_said(ws: Workspace) -> None:
    pytest.importorskip("ray")
    if importlib.util.find_spec("grpc") is not None:
        pytest.skip("Ray's client is installed here")
    ws.run("run", ws.path("prep.yaml"), ws.path("model.onnx"), "--out-dir", ws.path("out"), "--executor", "ray",
           "--address", "ray://127.0.0.1:10001", code=2, says=("pip install 'ray[client]'",))


def test_a_tensor_with_dims_but_no_bytes_is_blamed_on_the_model(ws: Workspace) -> None:
    model = conv_model()
    model.graph.initializer[0].ClearField("raw_data")
    onnx.save(model, ws.root / "nobytes.onnx")
    for argv in (["inspect", "--json", ws.path("nobytes.onnx")],
                 ["run", ws.path("prep.yaml"), ws.path("nobytes.onnx"), "-o", ws.path("out.onnx")]):
        ws.run(*argv, code=2, says=("tensor 'W' declares dims [4, 3, 3, 3] (108 value(s)) but holds no data",))


# ------------------------------------------------------------------ 17. names the file system refuses, or nearly
@pytest.mark.parametrize(("name", "code", "says"), [
    ("a" * 256, 2, "the file name is 256 bytes; this file system allows"),
    ("d/" * 2100 + "x.onnx", 2, "the path is"),
    ("b" * 244, 0, "wrote"),
])
def test_output_names_the_file_system_refuses_are_found_first(ws: Workspace, name: str, code: int,
                                                              says: str) -> None:
    out = ws.run("run", ws.path("prep.yaml"), ws.path("model.onnx"), "-o", ws.path(name), code=code, says=(says,),
                 outputs=(name,) if code == 0 else ())
    assert ("wrote" in out.text) == (code == 0)  # a refusal comes before the run, never after it


def test_ray_start_keeps_the_sigterm_handler() -> None:
    import signal

    from qgraph.runtime.executor.ray_tasks import _keeping_sigterm

    def ours(signum: int, frame: object) -> None: ...

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        _keeping_sigterm(lambda: signal.signal(signal.SIGTERM, lambda s, f: None))  # what ray.init does
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------ 24-27. real models made by other tools
def test_diff_probes_an_opset_9_float_model_with_ops_it_has(ws: Workspace) -> None:
    onnx.save(conv_model(opset=9), ws.root / "op9.onnx")
    ws.run("run", ws.path("int8.yaml"), ws.path("op9.onnx"), "-o", ws.path("q.onnx"), "--calibration-data",
           ws.path("data.npz"), code=0, outputs=("q.onnx",))
    out = ws.run("diff", ws.path("op9.onnx"), ws.path("q.onnx"), "--eval-data", ws.path("data.npz"), "--exact-top",
                 "0", code=0, says=("alone: output SQNR",), outputs=("q.onnx",))
    assert "No Op registered" not in out.text


def bad_axis_qdq() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """A float ``y = x @ W`` and a QDQ copy whose per-axis weight scale has the wrong length (4 for 3 columns)."""
    h, nh = onnx.helper, onnx.numpy_helper
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)

    def model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> onnx.ModelProto:
        graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
                             [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3])], inits)
        return h.make_model(graph, opset_imports=[h.make_opsetid("", 13)], ir_version=8)

    mm = h.make_node("MatMul", ["x", "W"], ["y"], name="mm")
    codes = np.clip(np.round(w / 0.02), -127, 127).astype(np.int8)
    inits = [nh.from_array(codes, "Wq"), nh.from_array(np.full(4, 0.02, np.float32), "Ws"),
             nh.from_array(np.zeros(4, np.int8), "Wz")]
    dq = h.make_node("DequantizeLinear", ["Wq", "Ws", "Wz"], ["W"], name="dq", axis=1)
    return model([mm], [nh.from_array(w, "W")]), model([dq, mm], inits)


@pytest.mark.parametrize("debug", [False, True])
def test_diff_blames_a_malformed_qdq_node_with_exit_2(ws: Workspace, debug: bool) -> None:
    float_model, qdq = bad_axis_qdq()
    onnx.save(float_model, ws.root / "f.onnx")
    onnx.save(qdq, ws.root / "q.onnx")
    np.savez(ws.root / "xs.npz", x=np.random.default_rng(1).standard_normal((4, 1, 4)).astype(np.float32))
    argv = ["diff", ws.path("f.onnx"), ws.path("q.onnx"), "--eval-data", ws.path("xs.npz")]
    if not debug:
        ws.run(*argv, code=2, says=("DequantizeLinear node. Name:'dq'", "The node it names is malformed"))
        return
    assert main([*argv, "--debug"]) == 2  # --debug after the command, and the same exit code with the traceback


def test_lower_to_a_higher_opset_reports_the_rewrite(ws: Workspace) -> None:
    onnx.save(conv_model(opset=9), ws.root / "op9.onnx")
    out = ws.run("lower", ws.path("op9.onnx"), "--opset", "13", "-o", ws.path("op13.onnx"), code=0,
                 says=("opset 9 -> 13",), outputs=("op13.onnx",))
    assert "although the pass reported no rewrite" not in out.text


def test_an_output_with_a_trailing_slash_is_refused(ws: Workspace) -> None:
    ws.run("run", ws.path("prep.yaml"), ws.path("model.onnx"), "-o", ws.path("out/newdir") + "/", code=2,
           says=("ends with a slash, so it names a folder",))
    assert not (ws.root / "out").exists()


# ------------------------------------------------------------------ 12. a shapeless input given data of any rank
def test_smooth_quant_names_activations_without_a_channel_axis() -> None:
    from qgraph.passes.smooth_quant.measure import ChannelStats

    from qgraph.errors import DataError

    stats = ChannelStats("x", rows=4)
    with pytest.raises(DataError, match=r"tensor 'x' is a single value \(0-d\) on calibration sample 0"):
        stats.update(np.float32(1.5), 0)
    stats.update(np.ones((2, 3), np.float32), 1)
    with pytest.raises(DataError, match=r"has 5 channel\(s\) \(last axis\) on calibration sample 2, 3 on the"):
        stats.update(np.ones((2, 5), np.float32), 2)
    assert stats.absmax.tolist() == [1.0, 1.0, 1.0]  # the good sample is kept, the bad ones never folded in
