"""Bad inputs: each gives exit code 2, a clear one-paragraph message, no traceback, input untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from qgraph import save_model
from qgraph.cli import main

RECIPE = "name: t\npasses:\n  - pass: toy_drop_identity\n"


@pytest.fixture
def workspace(toy_passes, small_model, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    save_model(small_model, tmp_path / "model.onnx")
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    return tmp_path


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    text = captured.err + captured.out
    assert "Traceback" not in text
    return code, " ".join(text.split())


def _cycle_model() -> onnx.ModelProto:
    nodes = [
        onnx.helper.make_node("Add", ["x", "c"], ["a"], name="first"),
        onnx.helper.make_node("Relu", ["a"], ["b"], name="second"),
        onnx.helper.make_node("Neg", ["b"], ["c"], name="third"),
    ]
    graph = onnx.helper.make_graph(
        nodes, "cyc",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [1])],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        ("truncated", "is not a readable ONNX model"),
        ("not_onnx", "not a readable ONNX model"),
        ("missing", "model file not found"),
        ("cycle", "the graph has a cycle (first -> second -> third)"),
    ],
)
def test_bad_models(workspace: Path, capsys, make: str, expected: str) -> None:  # type: ignore[no-untyped-def]
    model = workspace / "model.onnx"
    if make == "truncated":
        bad = workspace / "bad.onnx"
        bad.write_bytes(model.read_bytes()[:57])
    elif make == "not_onnx":
        bad = workspace / "bad.onnx"
        bad.write_text("name: this is yaml, not onnx\n" * 20)
    elif make == "missing":
        bad = workspace / "nope.onnx"
    else:
        bad = workspace / "bad.onnx"
        bad.write_bytes(_cycle_model().SerializeToString())
    before = bad.read_bytes() if bad.exists() else None
    code, text = _run(capsys, "run", str(workspace / "recipe.yaml"), str(bad), "-o", str(workspace / "o.onnx"))
    assert code == 2
    assert expected in text
    assert not (workspace / "o.onnx").exists()
    assert (bad.read_bytes() if bad.exists() else None) == before


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [("- pass: toy_drop_identity\n", "the recipe is a list; expected a mapping"), ("", "the recipe is empty")],
)
def test_bad_recipes(workspace: Path, capsys, recipe: str, expected: str) -> None:  # type: ignore[no-untyped-def]
    (workspace / "bad.yaml").write_text(recipe)
    code, text = _run(capsys, "run", str(workspace / "bad.yaml"), str(workspace / "model.onnx"), "-o",
                      str(workspace / "o.onnx"))
    assert code == 2 and expected in text
    assert not (workspace / "o.onnx").exists()


@pytest.mark.parametrize(
    ("arrays", "expected"),
    [
        (
            {"input": np.zeros((4, 4), np.float32)},
            "input names do not match the model. Missing: ['x']; unknown: ['input']",
        ),
        ({"x": np.zeros((4, 4), np.float64)}, "input 'x': dtype float64 but the model expects float32"),
        ({"x": np.zeros((4, 5), np.float32)}, "input 'x': dimension 1 is 5 but the model fixes it to 4"),
        ({"x": np.zeros((4, 2, 2, 4), np.float32)}, "input 'x': array of shape [4, 2, 2, 4] fits neither"),
        # concrete advice: the model's shape with N on its batch axis, never "(N, ?, 4)"
        ({"x": np.zeros((4, 2, 2, 4), np.float32)},
         "Store it as (N, 4): the model's shape with N samples on its batch axis 0; or choose --data-layout."),
        ({"x": np.array([[0, 1, 2, np.nan]] * 3, np.float32)}, "sample 0, input 'x': contains NaN"),
    ],
)
def test_bad_calibration_data(workspace: Path, capsys, arrays: dict, expected: str) -> None:  # type: ignore[no-untyped-def,type-arg]
    np.savez(workspace / "data.npz", **arrays)
    code, text = _run(capsys, "run", str(workspace / "recipe.yaml"), str(workspace / "model.onnx"), "-o",
                      str(workspace / "o.onnx"), "--calibration-data", str(workspace / "data.npz"))
    assert code == 2, text
    assert expected in text
    assert not (workspace / "o.onnx").exists()


def test_debug_flag_shows_the_traceback(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--debug", "run", str(workspace / "recipe.yaml"), str(workspace / "nope.onnx"), "-o", "x.onnx"],
                 ["run", str(workspace / "recipe.yaml"), str(workspace / "nope.onnx"), "-o", "x.onnx", "--debug"]):
        assert main(argv) == 2  # the traceback, and the exit code of bad input all the same
        err = capsys.readouterr().err
        assert "Traceback" in err and "ModelError" in err and "model file not found" in err


def test_labels_without_eval_data_is_refused_before_any_work(workspace: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    code, text = _run(capsys, "run", str(workspace / "recipe.yaml"), str(workspace / "model.onnx"), "-o",
                      str(workspace / "o.onnx"), "--labels", "nope.npy", "--report", str(workspace / "r.json"))
    assert code == 2 and "--labels and --metric need --eval-data" in text, text
    assert not (workspace / "o.onnx").exists() and not (workspace / "r.json").exists()


def test_missing_recipe_says_where_relative_paths_start(workspace: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(workspace)
    code, text = _run(capsys, "run", "nope.yaml", "model.onnx", "-o", "o.onnx")
    assert code == 2, text
    assert f"recipe file not found: nope.yaml. Check the path (relative paths start at {workspace})." in text
    assert "Traceback" not in text and not (workspace / "o.onnx").exists()


def test_swapped_recipe_and_model_say_the_order(workspace: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`qgraph run MODEL RECIPE`: it said '6783084 bytes is too large for a recipe' (a real model) or 'contains a
    NUL byte'; a recipe given as a model read as a corrupt ONNX file. Both now name the mix-up and the order."""
    monkeypatch.chdir(workspace)
    code, text = _run(capsys, "run", "model.onnx", "recipe.yaml", "-o", "o.onnx")
    assert code == 2 and "model.onnx: is an ONNX model, not a recipe (YAML text)" in text, text
    assert "`qgraph run RECIPE.yaml MODEL.onnx -o OUT`" in text
    code, text = _run(capsys, "validate", "model.onnx")
    assert code == 2 and "is an ONNX model, not a recipe" in text, text
    code, text = _run(capsys, "diff", "recipe.yaml", "model.onnx")
    assert code == 2 and "recipe.yaml is a recipe (YAML), not an ONNX model" in text, text
    assert sorted(p.name for p in workspace.iterdir()) == ["model.onnx", "recipe.yaml"]
