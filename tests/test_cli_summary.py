"""What the README promises is visible in the terminal: the pass catalogue reads well at 80 columns, the run
summary shows decisions, unmatched selectors and skips, the report lists them, inspect names real blockers
(issue #12 items 5 and 8)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console

from qgraph import Recipe
from qgraph.cli import main
from qgraph.pipeline.pass_api import discover

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits"


@pytest.fixture
def narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("qgraph.cli._app.out", Console(width=80, emoji=False))


def test_pass_catalogue_at_80_columns(narrow: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["passes"]) == 0
    text = capsys.readouterr().out
    assert "PydanticUndefined" not in text and "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert re.search(r"^    remove_identity = true$", text, re.M)  # one option a line, real defaults
    assert re.search(r"^float_fallback .*\n(?:.*\n)*?    nodes = null$", text, re.M)  # a None default shows as null


def test_one_pass_in_full_with_a_working_example(narrow: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["passes", "insert_qdq"]) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "  weights.reduce_range: auto | bool = auto" in text
    assert "preset ort-x86-avx2: x86 AVX2 without VNNI" in text
    example = text.split("example:\n", 1)[1]
    recipe = Recipe.from_text("name: example\n" + "\n".join(line[2:] for line in example.splitlines()))
    assert recipe.passes[0].name == "insert_qdq"
    for name in discover():  # every pass's example is a valid entry of that pass (required fields left aside)
        assert main(["passes", name]) == 0
        example = capsys.readouterr().out.split("example:\n", 1)[1]
        if "# required" in example:
            continue
        parsed = Recipe.from_text("name: example\n" + "\n".join(line[2:] for line in example.splitlines()))
        assert parsed.passes[0].name == name
    assert main(["passes", "fuse_batchnrom"]) == 2
    assert "Did you mean 'fuse_batchnorm'" in capsys.readouterr().err


def test_run_summary_shows_decisions_unmatched_and_skips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\npasses:\n  - pass: insert_qdq\n    preset: ort-x86-vnni\n"
                      "    nodes: {names: [does_not_exist]}\n    weights: {reduce_range: auto}\n")
    report = tmp_path / "r.html"
    args = ["run", str(recipe), str(DIGITS / "model.onnx"), "-o", str(tmp_path / "o.onnx"),
            "--calibration-data", str(DIGITS / "calibration.npz")]
    assert main([*args, "--report", str(report)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "matched nothing: names: 'does_not_exist' matched no node" in err
    assert "decision: reduce_range: auto -> false: the recipe declares no target.cpu" in err
    assert f"wrote report {report}" in err
    html = report.read_text()
    assert 'id="decisions"' in html and "does_not_exist" in html
    assert main([*args, "-q"]) == 0
    quiet = capsys.readouterr().err
    assert "✓" not in quiet and "decision:" not in quiet


def test_inspect_names_real_blockers_and_target_relevant_checks(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    int8 = tmp_path / "int8.onnx"
    assert main(["run", str(ROOT / "recipes" / "ort-x86-vnni.yaml"), str(DIGITS / "model.onnx"), "-o", str(int8),
                 "--calibration-data", str(DIGITS / "calibration.npz"), "-q"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(int8), "--opset", "11", "--target", "tensorrt"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "what blocks opset 11" in text
    assert "DequantizeLinear node" in text and "per-axis" in text
    assert "definition changes" not in text
    assert "saturation" not in text
    assert main(["inspect", str(DIGITS / "model.onnx"), "--opset", "13"]) == 0
    assert "converts to opset 13 with the same results" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["run", "calibrate", "sensitivity", "check", "validate", "diff", "passes"])
def test_help_shows_what_to_type(command: str, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Help never eats `[ray]` as markup, flags show no `<bool>` value, arguments are upper-case names."""
    monkeypatch.setenv("COLUMNS", "200")
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert "<bool>" not in text and "--help " in text
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    names = re.findall(r"[{\[]([A-Za-z_]+)[}\]]", usage.split("[OPTIONS]", 1)[1])
    assert names and all(n.isupper() for n in names), usage
    if command in ("run", "sensitivity"):
        assert "pip install 'qgraph[ray]'" in text
    if command == "run":
        assert re.search(r"--verify +Check float-preserving", text) and "{RECIPE} {MODEL}..." in usage


def test_root_help_flags(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "<bool>" not in text and re.search(r"--debug +Show tracebacks", text)


def test_attention_decisions_are_never_cut_and_come_first() -> None:
    """A branch the calibration data never ran (left float) must not hide under "... N more (decision)"."""
    from qgraph.cli.run import SHOWN_PER_PASS, print_pass
    from qgraph.pipeline.pass_api import PassResult

    r = PassResult()
    for i in range(SHOWN_PER_PASS + 3):
        r.decide(f"routine {i}")
    r.decide("switch.else_branch: never ran on the calibration data; the rest stays float", attention=True)
    r.decide("routine last")
    console = Console(record=True, width=200)
    print_pass(console, "insert_qdq", r, 0.1, None)
    lines = console.export_text().splitlines()
    assert lines[1] == "    attention: switch.else_branch: never ran on the calibration data; the rest stays float"
    assert lines[2:2 + SHOWN_PER_PASS] == [f"    decision: routine {i}" for i in range(SHOWN_PER_PASS)]
    assert lines[2 + SHOWN_PER_PASS] == "    ... 4 more (decision); see --report"
    assert r.to_dict()["attention"] == [r.decisions[-2]] and "attention" not in PassResult().to_dict()


def test_output_to_a_pipe_is_not_cut_at_80_columns(tmp_path: Path) -> None:
    """In a CI log (stdout a pipe, COLUMNS unset) the gate's table was cut at rich's default 80 columns: the
    reference path read ``examp…utputs.npz`` and the step drop ``0.22`` for 0.225%; with COLUMNS set, or on a
    terminal, rich's own width stays."""
    import io
    import os
    import subprocess
    import sys

    from qgraph.cli._app import PIPED_WIDTH, console_width

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    # paths as a user in the checkout types them: the same length wherever the checkout is
    digits = DIGITS.relative_to(DIGITS.parents[1])
    args = ["check", str(digits / "model.onnx"), str(digits / "model.onnx"), "--data", str(digits / "eval.npz"),
            "--reference-outputs", str(digits / "reference_outputs.npz"), "--metric", str(digits / "metric.py:top1")]
    done = subprocess.run([sys.executable, "-c", "import sys; from qgraph.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, env=env, cwd=DIGITS.parents[1], timeout=120)
    assert done.returncode == 0, done.stderr
    assert str(digits / "reference_outputs.npz") in done.stdout and "…" not in done.stdout, done.stdout
    assert console_width(io.StringIO(), {}) == PIPED_WIDTH
    assert console_width(io.StringIO(), {"COLUMNS": "100"}) is None

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert console_width(Tty(), {}) is None
