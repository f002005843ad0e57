"""Held-out data, labels and the user's metric in ``run --report``, ``diff`` and ``sensitivity``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qgraph.cli import main

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits"
METRIC = f"{DIGITS / 'metric.py'}:top1"
RECIPE = ROOT / "recipes" / "ort-x86-vnni.yaml"


@pytest.fixture(scope="module")
def run_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    folder = tmp_path_factory.mktemp("eval")
    code = main(["run", str(RECIPE), str(DIGITS / "model.onnx"), "-o", str(folder / "int8.onnx"), "-q",
                 "--calibration-data", str(DIGITS / "calibration.npz"), "--report", str(folder / "rep.json"),
                 "--eval-data", str(DIGITS / "eval.npz"), "--metric", METRIC])
    assert code == 0
    return folder, json.loads((folder / "rep.json").read_text())


def test_run_report_measures_on_held_out_data_with_the_metric(run_report: tuple[Path, dict[str, object]]) -> None:
    _, data = run_report
    assert isinstance(data["data"], str) and data["data"].startswith("450 sample(s) of") and "eval.npz" in data["data"]
    assert "labels" in data["data"] and "metric" in data["data"]
    fidelity = {r["stage"]: r for r in data["fidelity"]}  # type: ignore[union-attr]
    assert fidelity["float original"]["metric"] == pytest.approx(0.98888888, abs=1e-6)
    assert abs(fidelity["final"]["metric"] - fidelity["float original"]["metric"]) <= 0.005
    culprits = data["culprits"]
    assert isinstance(culprits, list) and len(culprits) == 15 and culprits[0]["measured"]


def test_eval_options_need_something_to_measure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", str(RECIPE), str(DIGITS / "model.onnx"), "-o", str(tmp_path / "x.onnx"), "-q",
            "--calibration-data", str(DIGITS / "calibration.npz")]
    assert main([*args, "--metric", METRIC]) == 2
    assert "need --eval-data" in capsys.readouterr().err
    assert main([*args, "--eval-data", str(DIGITS / "eval.npz"), "--no-check"]) == 2
    assert "drop --no-check or give --report" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()


def test_sensitivity_ranks_by_the_metric_with_labels_and_prints_culprits(
        run_report: tuple[Path, dict[str, object]], capsys: pytest.CaptureFixture[str]) -> None:
    folder, _ = run_report
    code = main(["sensitivity", str(DIGITS / "model.onnx"), str(folder / "int8.onnx"), "--eval-data",
                 str(DIGITS / "eval.npz"), "--metric", METRIC, "--samples", "64", "-q", "--json",
                 str(folder / "sens.json")])
    captured = capsys.readouterr()
    assert code == 0
    data = json.loads((folder / "sens.json").read_text())
    assert "labels" in data["data"] and data["culprits"]
    assert "Q/DQ pairs by their share of the output error" in captured.out
    assert "evaluated on 64 of 450 sample(s)" in captured.err


def test_diff_reports_top1_agreement_and_the_metric(run_report: tuple[Path, dict[str, object]],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    folder, _ = run_report
    code = main(["diff", str(DIGITS / "model.onnx"), str(folder / "int8.onnx"), "--eval-data",
                 str(DIGITS / "eval.npz"), "--metric", METRIC, "--samples", "450", "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    ev = data["numeric"]["evaluation"]
    assert code == 0 and ev["top1_agreement"] >= 0.99 and ev["metric_a"] == pytest.approx(0.98888888, abs=1e-6)
    assert abs(ev["metric_b"] - ev["metric_a"]) <= 0.005


def test_diff_says_how_many_of_the_samples_it_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`diff --eval-data` reads 8 samples by default: it says `8 of 12` (and how to use more), never just `8`."""
    with np.load(DIGITS / "eval.npz") as data:
        np.savez(tmp_path / "twelve.npz", input=data["input"][:12])
    args = ["diff", str(DIGITS / "model.onnx"), str(DIGITS / "model.onnx"), "--eval-data", str(tmp_path / "twelve.npz")]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "on 8 of 12 sample(s) of" in out and "(--samples to use more)" in out
    assert main([*args, "--samples", "12"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "on 12 sample(s) of" in out and "--samples to use more" not in out


def test_a_builtin_metric_in_the_run_report_has_its_interval(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    """``--metric top1`` against the labels: every fidelity row carries the score's 95 % bootstrap interval over
    the 450 held-out samples, and the check after the run prints it."""
    code = main(["run", str(RECIPE), str(DIGITS / "model.onnx"), "-o", str(tmp_path / "int8.onnx"),
                 "--calibration-data", str(DIGITS / "calibration.npz"), "--report", str(tmp_path / "rep.json"),
                 "--eval-data", str(DIGITS / "eval.npz"), "--metric", "top1"])
    assert code == 0
    rows = {r["stage"]: r for r in json.loads((tmp_path / "rep.json").read_text())["fidelity"]}
    final = rows["final"]
    spread = final["metric_interval"]
    assert spread["samples"] == 450 and spread["low"] <= final["metric"] <= spread["high"] < 1.0
    p = final["metric"]
    assert (spread["high"] - spread["low"]) / 2 == pytest.approx(1.96 * np.sqrt(p * (1 - p) / 450), abs=0.006)
    printed = capsys.readouterr()
    assert f"95% interval {spread['low']:.4g}-{spread['high']:.4g} over 450 samples" in printed.out + printed.err
