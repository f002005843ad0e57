"""``qgraph run RECIPE MODEL... --out-dir DIR``: every good model written even when one fails (exit 1, the
summary table names the failure), the same outputs locally and on Ray, collisions and bad arguments refused
before any work (exit 2)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import onnx
import pytest

import qgraph.cli._app as _app
from qgraph.cli import main
from qgraph.pipeline.batch import output_path
from qgraph.pipeline.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits"
RECIPE = ROOT / "recipes" / "ort-x86-vnni.yaml"


@pytest.fixture
def models(tmp_path: Path) -> list[Path]:
    """Two copies of the digits CNN and a corrupt file between them."""
    folder = tmp_path / "in"
    folder.mkdir()
    a, b, broken = folder / "a.onnx", folder / "b.onnx", folder / "broken.onnx"
    shutil.copy(DIGITS / "model.onnx", a)
    shutil.copy(DIGITS / "model.onnx", b)
    broken.write_bytes(b"not an onnx model")
    return [a, broken, b]


@pytest.fixture(autouse=True)
def _wide_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_app.out, "width", 400)  # one table row per line: cells are not folded


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["run", *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _graph(path: Path) -> bytes:
    return onnx.load(path).graph.SerializeToString()


def _many(models: list[Path], out: Path, *extra: str) -> list[str]:
    return [str(RECIPE), *map(str, models), "--out-dir", str(out), "--calibration-data",
            str(DIGITS / "calibration.npz"), "-q", *extra]


def test_one_broken_model_others_written_exit_1_table_lists_it(
    models: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = _run(capsys, *_many(models, out))
    assert code == 1
    assert sorted(p.name for p in out.iterdir()) == ["a.int8.onnx", "b.int8.onnx"]
    single = tmp_path / "single.onnx"
    assert main(["run", str(RECIPE), str(models[0]), "-o", str(single), "-q", "--calibration-data",
                 str(DIGITS / "calibration.npz")]) == 0
    assert _graph(out / "a.int8.onnx") == _graph(single) == _graph(out / "b.int8.onnx")
    rows = {cells[0]: cells for line in stdout.splitlines()
            if len(cells := [c.strip() for c in line.split("│")[1:-1]]) == 6}
    a, broken, b = (rows[str(m)] for m in models)
    n = len(Recipe.from_yaml(RECIPE).passes)
    assert a[1:3] == b[1:3] == ["ok", f"{n}/{n}"] and a[4] == str(out / "a.int8.onnx") and a[5] == ""
    assert broken[1:3] == ["failed", f"0/{n}"] and broken[4] == "-"
    assert broken[5].startswith(f"{models[1]} is not a readable ONNX model")
    assert "2 of 3 models written" in stderr and "exit 1" in stderr


def test_all_good_exit_0_and_ray_writes_the_same_outputs(
    local_ray: Any, models: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = [models[0], models[2]]
    code, _, _ = _run(capsys, *_many(good, tmp_path / "local"))
    assert code == 0
    code, stdout, stderr = _run(capsys, *_many(models, tmp_path / "ray", "--executor", "ray", "--jobs", "2"))
    assert code == 1 and "failed" in stdout and "Ray (local), 2 at once" in stderr
    for m in good:  # byte-identical files (provenance included)
        assert output_path(m, tmp_path / "ray").read_bytes() == output_path(m, tmp_path / "local").read_bytes()
    assert not output_path(models[1], tmp_path / "ray").exists()


def test_per_model_calibration_data_by_stem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(DIGITS / "model.onnx", folder / "digits.onnx")
    shutil.copy(DIGITS / "model.onnx", folder / "nodata.onnx")
    shutil.copy(DIGITS / "calibration.npz", folder / "digits.npz")
    code, stdout, _ = _run(capsys, str(RECIPE), str(folder / "digits.onnx"), str(folder / "nodata.onnx"),
                           "--out-dir", str(tmp_path / "out"), "--calibration-data", str(folder / "{stem}.npz"), "-q")
    assert code == 1
    assert (tmp_path / "out" / "digits.int8.onnx").exists() and not (tmp_path / "out" / "nodata.int8.onnx").exists()
    assert "nodata.npz" in next(line for line in stdout.splitlines() if "nodata.onnx" in line)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{a}", "{b}"], "--out-dir DIR"),
        (["{a}", "{b}", "--out-dir", "{out}", "-o", "{out}/x.onnx"], "drop -o"),
        (["{a}", "-o", "{out}/x.onnx", "--executor", "ray"], "--out-dir"),
        (["{a}", "{b}", "--out-dir", "{out}", "--address", "auto"], "needs --executor ray"),
        (["{a}", "{b}", "--out-dir", "{out}", "--report", "{out}/r.html"], "one model"),
        (["{a}", "{other_a}", "--out-dir", "{out}"], "would both be written"),
        (["{a}"], "Missing option '-o'"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(
    models: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(models[0], other / "a.onnx")
    names = {"a": models[0], "b": models[2], "out": tmp_path / "out", "other_a": other / "a.onnx"}
    code, _, stderr = _run(capsys, str(RECIPE), *(a.format(**names) for a in args))
    assert code == 2
    assert message in " ".join(stderr.split()) and "Traceback" not in stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_output_that_is_an_input_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copy(DIGITS / "model.onnx", tmp_path / "m.onnx")
    shutil.copy(DIGITS / "model.onnx", tmp_path / "m.int8.onnx")
    code, _, stderr = _run(capsys, str(RECIPE), str(tmp_path / "m.onnx"), str(tmp_path / "m.int8.onnx"),
                           "--out-dir", str(tmp_path))
    assert code == 2 and "is also an input" in " ".join(stderr.split())
