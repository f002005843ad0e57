"""Hostile input, part 1 (issue #17 items 1-7, 10, 17, 18, 21): files that must never be destroyed and results
that must never say "no error" where there is one."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_support import Workspace, conv_model  # type: ignore[import-not-found]

from qgraph import save_model
from qgraph.io.outputs import Terminated


# ------------------------------------------------------------------ 1. outputs that are inputs
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "{prep.yaml}", "{model.onnx}", "-o", "{model.onnx}"], "-o {model.onnx}: is also an input"),
        (["run", "{prep.yaml}", "{model.onnx}", "-o", "{prep.yaml}"], "is also an input of this command"),
        (["run", "{int8.yaml}", "{model.onnx}", "-o", "{data.npz}", "--calibration-data", "{data.npz}"],
         "is also an input"),
        (["run", "{prep.yaml}", "{model.onnx}", "-o", "{link.onnx}"], "is also an input"),
        (["lower", "{model.onnx}", "--opset", "13", "-o", "{model.onnx}"], "is also an input"),
        (["calibrate", "{int8.yaml}", "{model.onnx}", "-o", "{model.onnx}", "--calibration-data", "{data.npz}"],
         "is also an input"),
        (["calibrate", "{int8.yaml}", "{model.onnx}", "-o", "{data.npz}", "--calibration-data", "{data.npz}"],
         "is also an input"),
        (["diff", "{model.onnx}", "{other.onnx}", "--html", "{model.onnx}"], "--html {model.onnx}: is also an input"),
        (["sensitivity", "{model.onnx}", "{other.onnx}", "--data", "{data.npz}", "--target", "sqnr:10",
          "-o", "{model.onnx}"], "is also an input"),
        (["run", "{prep.yaml}", "{model.onnx}", "-o", "{out.html}", "--report", "{out.html}"],
         "is also the path given to -o"),
    ],
    ids=["run-model", "run-recipe", "run-data", "run-symlink", "lower", "calibrate-model", "calibrate-data",
         "diff-html", "sensitivity", "report-equals-output"],
)
def test_an_output_never_overwrites_an_input(ws: Workspace, argv: list[str], says: str) -> None:
    (ws.root / "link.onnx").symlink_to(ws.root / "model.onnx")
    onnx.save(conv_model(), ws.root / "other.onnx")
    names = {n: ws.path(n) for n in ("prep.yaml", "int8.yaml", "model.onnx", "data.npz", "link.onnx", "other.onnx",
                                     "out.html")}
    def fill(text: str) -> str:
        for name, path in names.items():
            text = text.replace("{" + name + "}", path)
        return text

    ws.run(*[fill(a) for a in argv], code=2, says=(fill(says),))


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="no /dev/null on this system")
def test_a_device_is_never_replaced_by_a_file(ws: Workspace) -> None:
    ws.run("run", ws.path("prep.yaml"), ws.path("model.onnx"), "-o", "/dev/null", code=2,
           says=("-o /dev/null: is not a regular file",))
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


# ------------------------------------------------------------------ 3. NaN never reads as "no error"
def test_diff_counts_and_names_nan_outputs(ws: Workspace) -> None:
    w = np.full((4, 3, 3, 3), np.nan, np.float32)
    onnx.save(conv_model(weight=w), ws.root / "nan.onnx")
    out = ws.run("diff", ws.path("model.onnx"), ws.path("nan.onnx"), "--inputs", ws.path("data.npz"), code=1,
                 says=("non-finite values (NaN/Inf) in the outputs: y (0 in A, 8 in B)",))
    assert "max abs 0" not in out.text


def test_verify_fails_on_nan_from_a_negative_variance_batchnorm(ws: Workspace) -> None:
    onnx.save(conv_model(bn_var=np.array([1, -1, 1, 1], np.float32)), ws.root / "bn.onnx")
    ws.run("run", ws.path("prep.yaml"), ws.path("bn.onnx"), "-o", ws.path("out.onnx"), "--verify",
           "--calibration-data", ws.path("data.npz"), code=1,
           says=("the model before it already produces NaN/Inf", "holds non-finite values"))


# ------------------------------------------------------------------ 4. zero samples are not a perfect match
def test_empty_data_is_refused(ws: Workspace) -> None:
    np.savez(ws.root / "empty.npz", x=np.zeros((0, 1, 3, 8, 8), np.float32))
    ws.run("diff", ws.path("model.onnx"), ws.path("model.onnx"), "--inputs", ws.path("empty.npz"), code=2,
           says=("0 samples",))
    for n in ("0", "-5"):
        ws.run("diff", ws.path("model.onnx"), ws.path("model.onnx"), "--inputs", ws.path("data.npz"),
               "--samples", n, code=2, says=("--samples",))


# ------------------------------------------------------------------ 5. duplicate names
def test_duplicate_initializer_names_are_refused(ws: Workspace) -> None:
    onnx.save(conv_model(duplicate_initializer=True), ws.root / "dup.onnx")
    ws.run("run", ws.path("prep.yaml"), ws.path("dup.onnx"), "-o", ws.path("out.onnx"), code=2,
           says=("two initializers named 'G'",))


# ------------------------------------------------------------------ 6. target opset is honoured
def test_recipe_target_opset_is_applied(ws: Workspace) -> None:
    (ws.root / "t.yaml").write_text("name: t\ntarget: {opset: 13}\npasses:\n  - pass: cleanup\n")
    out = ws.run("run", ws.path("t.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"), code=0,
                 says=("target.opset 13: converted from opset 17",), outputs=("out.onnx",))
    assert out.code == 0
    model = onnx.load(ws.root / "out.onnx")
    assert {o.domain: o.version for o in model.opset_import}[""] == 13


# ------------------------------------------------------------------ 7. tolerance
@pytest.mark.parametrize("tol", ["nan", "inf", "-1", "0"])
def test_tolerance_must_be_finite_and_positive(ws: Workspace, tol: str) -> None:
    ws.run("run", ws.path("prep.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"), "--verify",
           "--tolerance", tol, code=2, says=("--tolerance", "finite number greater than 0"))


# ------------------------------------------------------------------ 10. external data re-save, SIGTERM
def test_resave_with_existing_external_data_replaces_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "X.onnx.data").write_bytes(b"stale")  # in the working directory
    sub = tmp_path / "out"
    sub.mkdir()
    (sub / "X.onnx.data").write_bytes(b"stale")  # and beside the target
    model = conv_model()
    save_model(model, sub / "X.onnx", external_data=True)
    loaded = onnx.load(str(sub / "X.onnx"))
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(loaded.graph.initializer[0]),
                                  onnx.numpy_helper.to_array(model.graph.initializer[0]))
    assert (tmp_path / "X.onnx.data").read_bytes() == b"stale"
    assert not [p for p in sub.iterdir() if p.name.startswith(".qgraph-")]
    assert model.graph.initializer[0].HasField("raw_data")  # the caller's model is untouched


def test_sigterm_during_a_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "m.onnx"
    (tmp_path / "m.onnx.data").write_bytes(b"old data")
    import qgraph.io.model_io as mio

    real = mio._externalize

    def interrupted(*args: object, **kwargs: object) -> object:
        real(*args, **kwargs)  # type: ignore[arg-type]
        raise Terminated()

    monkeypatch.setattr(mio, "_externalize", interrupted)
    with pytest.raises(Terminated):
        save_model(conv_model(), target, external_data=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx.data"]
    assert (tmp_path / "m.onnx.data").read_bytes() == b"old data"


# ------------------------------------------------------------------ 17. output paths and failing writes
@pytest.mark.parametrize(("output", "says"), [("", "-o .: the output path is empty or a directory"),
                                              ("adir", "is a directory")])
def test_bad_output_paths(ws: Workspace, output: str, says: str) -> None:
    (ws.root / "adir").mkdir()
    ws.run("run", ws.path("prep.yaml"), ws.path("model.onnx"), "-o", ws.path(output) if output else "", code=2,
           says=(says,))


@pytest.mark.parametrize(("err", "says"), [(errno.ENOSPC, "No space left on device"),
                                           (errno.EROFS, "Read-only file system")])
def test_a_failing_write_exits_1_with_the_os_reason(ws: Workspace, monkeypatch: pytest.MonkeyPatch, err: int,
                                                    says: str) -> None:
    def fail(*args: object) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr("qgraph.io.outputs.os.replace", fail)
    ws.run("run", ws.path("prep.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"), code=1,
           says=("cannot write", says, "Nothing was written"))


def test_report_path_problems_are_found_before_the_model_is_written(ws: Workspace) -> None:
    ws.run("run", ws.path("prep.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"), "--report",
           ws.path("r.pdf"), code=2, says=("--report", ".html or .json"))


@pytest.mark.parametrize("kind", ["bad-yaml", "not-utf8", "directory"])
def test_bad_patches(ws: Workspace, kind: str) -> None:
    patch = ws.root / "p.yaml"
    if kind == "bad-yaml":
        patch.write_text("passes: [\n")
    elif kind == "not-utf8":
        patch.write_bytes(b"passes:\n  - pass: cleanup\xff\xfe\n")
    else:
        patch.mkdir()
    says = {"bad-yaml": "YAML syntax error", "not-utf8": "is not UTF-8", "directory": "is a directory"}[kind]
    ws.run("run", ws.path("prep.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"), "--patch", str(patch),
           code=2, says=(says,))


def test_schema_into_a_missing_folder(ws: Workspace) -> None:
    ws.run("schema", "-o", ws.path("new/dir/schema.json"), code=0, outputs=("new/dir/schema.json",))
    assert (ws.root / "new/dir/schema.json").read_text().startswith("{")


# ------------------------------------------------------------------ 18. NaN weights in insert_qdq
def test_nan_weight_is_named_by_insert_qdq(ws: Workspace) -> None:
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    w[1, 0, 0, 0] = np.inf
    onnx.save(conv_model(weight=w), ws.root / "inf.onnx")
    ws.run("run", ws.path("int8.yaml"), ws.path("inf.onnx"), "-o", ws.path("out.onnx"), "--calibration-data",
           ws.path("data.npz"), code=1, says=("constant 'W' (input of node 'conv') holds 1 NaN/Inf",))


# ------------------------------------------------------------------ 21. umask, SIGINT, validate every file
def test_outputs_respect_the_umask(ws: Workspace) -> None:
    old = os.umask(0o022)
    try:
        ws.run("calibrate", ws.path("int8.yaml"), ws.path("model.onnx"), "-o", ws.path("ranges.json"),
               "--calibration-data", ws.path("data.npz"), code=0, outputs=("ranges.json",))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(ws.root / "ranges.json").st_mode) == 0o644


def test_ctrl_c_says_nothing_was_written(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("qgraph.pipeline.runner.Pipeline.run", interrupt)
    ws.run("run", ws.path("prep.yaml"), ws.path("model.onnx"), "-o", ws.path("out.onnx"), code=130,
           says=("interrupted: nothing was written",))


def test_validate_reports_every_file(ws: Workspace) -> None:
    out = ws.run("validate", ws.path("missing.yaml"), ws.path("prep.yaml"), ws.path("int8.yaml"), code=2,
                 says=("recipe file not found", "prep.yaml: ok", "int8.yaml: ok"))
    assert out.code == 2


@pytest.mark.parametrize(("flag", "value"), [("--max-nodes", "-3"), ("--max-time", "-1"), ("--samples", "-1"),
                                             ("--jobs", "0")])
def test_sensitivity_bounds(ws: Workspace, flag: str, value: str) -> None:
    onnx.save(conv_model(), ws.root / "other.onnx")
    ws.run("sensitivity", ws.path("model.onnx"), ws.path("other.onnx"), "--data", ws.path("data.npz"), flag, value,
           code=2, says=(flag,))
