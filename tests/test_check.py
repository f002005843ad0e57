"""``qgraph check``: the validation chain (PyTorch outputs → ONNX FP32 → INT8) on the bundled digits example."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qgraph import Recipe
from qgraph.analysis.check import Drop
from qgraph.cli import main
from qgraph.errors import UsageError
from qgraph.runtime.evaluation import Evaluation, load_labels

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits"
METRIC = f"{DIGITS / 'metric.py'}:top1"


@pytest.fixture(scope="module")
def int8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("check") / "digits.int8.onnx"
    result = Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml").pipeline().run(
        str(DIGITS / "model.onnx"), calibration_data=str(DIGITS / "calibration.npz"))
    result.save(out)
    return out


@pytest.fixture(scope="module")
def degraded(int8: Path) -> Path:
    """The INT8 model with three Q/DQ scales broken: an activation range cut to a tenth (clips), one 25x too wide,
    and channel 5 of a per-channel weight scale 20x too small."""
    m = onnx.load(int8)
    factors = {"/features/features.9/Relu_output_0/scale": 0.1, "/features/features.2/Relu_output_0/scale": 25.0}
    for t in m.graph.initializer:
        value = numpy_helper.to_array(t)
        if t.name in factors:
            t.CopyFrom(numpy_helper.from_array(value * np.float32(factors[t.name]), t.name))
        elif t.name == "features.3.weight/scale":
            value = value.copy()
            value[5] *= np.float32(0.05)
            t.CopyFrom(numpy_helper.from_array(value, t.name))
    out = int8.with_name("degraded.onnx")
    onnx.save(m, out)
    return out


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, object]]:
    code = main(["check", *args, "--json", "-"])
    return code, json.loads(capsys.readouterr().out)


def test_three_stage_chain_passes_within_one_percent(int8: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, data = _check(capsys, str(DIGITS / "model.onnx"), str(int8), "--data", str(DIGITS / "eval.npz"),
                        "--reference-outputs", str(DIGITS / "reference_outputs.npz"), "--metric", METRIC)
    assert code == 0 and data["passed"] is True
    stages = data["stages"]
    assert [s["stage"] for s in stages] == ["reference outputs", "ONNX reference", "candidate 1"]
    with np.load(DIGITS / "eval.npz") as npz:
        labels = npz["labels"]
    with np.load(DIGITS / "reference_outputs.npz") as npz:
        torch_top1 = float(np.mean(npz["logits"].argmax(axis=1) == labels))
    assert stages[0]["metric"] == pytest.approx(torch_top1) and torch_top1 > 0.95
    assert stages[1]["sqnr_db"] > 80  # ONNX export vs PyTorch: float rounding only
    assert stages[1]["top1_agreement"] == 1.0
    assert stages[2]["step_drop"] <= 1.0 and stages[2]["sqnr_db"] > 20
    assert "labels" in data["data"] and str(DIGITS / "eval.npz") in data["data"]


def test_a_degraded_stage_fails_the_gate(int8: Path, degraded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, data = _check(capsys, str(DIGITS / "model.onnx"), str(int8), str(degraded), "--data",
                        str(DIGITS / "eval.npz"), "--reference-outputs", str(DIGITS / "reference_outputs.npz"),
                        "--metric", METRIC, "--max-drop", "1%")
    assert code == 1 and data["passed"] is False
    bad = data["stages"][3]
    assert bad["ok"] is False and bad["step_drop"] > 1.0 and "candidate 2" in data["verdict"]
    assert data["stages"][2]["ok"] is True


def test_without_a_metric_the_gate_uses_top1_agreement(int8: Path, degraded: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, data = _check(capsys, str(DIGITS / "model.onnx"), str(degraded), "--data", str(DIGITS / "eval.npz"),
                        "--max-drop", "0.01")
    assert data["quality"] == "top-1 agreement and output cosine (the lower)"
    stage = data["stages"][1]
    agreement = stage["top1_agreement"]
    assert agreement < 0.99 and code == 1
    assert stage["step_drop"] == pytest.approx(1.0 - min(agreement, stage["cosine"]))


def test_terminal_table_and_messages(int8: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", str(DIGITS / "model.onnx"), str(int8), "--data", str(DIGITS / "eval.npz"), "--metric",
                 METRIC])
    captured = capsys.readouterr()
    assert code == 0
    assert "validation chain" in captured.out and "candidate 1" in captured.out
    assert "PASS: every step keeps" in captured.err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-drop", "abc"], "--max-drop 'abc': give a percentage"),
        (["--max-drop", "-1%"], "finite number ≥ 0"),
        (["--reference-outputs", "missing.npz"], "no such file"),
        (["--metric", "nope.py:f"], "cannot import"),
    ],
)
def test_bad_options_are_one_sentence(int8: Path, extra: list[str], message: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["check", str(DIGITS / "model.onnx"), str(int8), "--data", str(DIGITS / "eval.npz"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_reference_outputs_must_name_the_outputs(int8: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "ref.npz", scores=np.zeros((450, 10), np.float32), other=np.zeros((450,), np.float32))
    code = main(["check", str(DIGITS / "model.onnx"), "--data", str(DIGITS / "eval.npz"), "--reference-outputs",
                 str(tmp_path / "ref.npz")])
    err = capsys.readouterr().err
    assert code == 2 and "no array for output(s) ['logits']" in err
    np.savez(tmp_path / "short.npz", logits=np.zeros((3, 10), np.float32))
    code = main(["check", str(DIGITS / "model.onnx"), "--data", str(DIGITS / "eval.npz"), "--reference-outputs",
                 str(tmp_path / "short.npz")])
    assert code == 2 and "has 3 row(s)" in capsys.readouterr().err


def test_drop_units() -> None:
    assert Drop.parse("1%").measure(0.98, 0.97, True) == pytest.approx(100 * 0.01 / 0.98)
    assert Drop.parse("0.01").measure(0.98, 0.97, True) == pytest.approx(0.01)
    assert Drop.parse("0.5").measure(1.0, 1.2, False) == pytest.approx(0.2)  # an error metric going up
    assert Drop.parse("1%").measure(float("nan"), 0.9, True) == float("inf")  # NaN never passes
    with pytest.raises(UsageError):
        Drop.parse("inf")


def test_labels_are_found_or_given(tmp_path: Path) -> None:
    model = onnx.load(DIGITS / "model.onnx")
    ev = Evaluation.open(model, DIGITS / "eval.npz", samples=10)
    assert ev.labels is not None and len(ev.labels) == 10 and len(ev.feeds) == 10
    assert ev.labels_from == f"{DIGITS / 'eval.npz'}:labels (the first 10 of 450, as --samples cut the data)"
    np.save(tmp_path / "y.npy", np.arange(5))
    assert load_labels(tmp_path / "y.npy")[0].tolist() == [0, 1, 2, 3, 4]
    np.savez(tmp_path / "y.npz", classes=np.arange(3))
    assert load_labels(tmp_path / "y.npz")[1] == f"{tmp_path / 'y.npz'}:classes"  # one array: that one
    assert load_labels(f"{tmp_path / 'y.npz'}:classes")[0].tolist() == [0, 1, 2]
    ev = Evaluation.open(model, DIGITS / "eval.npz", metric=METRIC, samples=450)
    names, outs = ev.outputs(DIGITS / "model.onnx")
    assert names == ["logits"] and ev.score(outs, outs) == pytest.approx(0.9888888, abs=1e-6)


def test_an_output_a_concat_joins_is_checked_part_by_part(detector: dict[str, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A detector's boxes and class scores in one output: the whole output reads > 40 dB while the scores, quantized
    with the boxes' scale, are lost. The stage's SQNR and cosine are the worst part's (its quality, output cosine,
    drops); `--whole-outputs` gives the old view, where the boxes hide the scores."""
    args = ["check", str(detector["float"]), str(detector["int8"]), "--data", str(detector["eval"])]
    assert main([*args, "--max-drop", "50%", "--json", "-"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["output_parts_decisions"] == [
        "output0 is scored as 2 parts (Concat on axis 1 of boxes [4] and scores [18]); the worst part decides"]
    stage = report["stages"][1]
    rows = {o["name"]: o for o in stage["outputs"]}
    assert list(rows) == ["output0", "output0[0:4] (boxes)", "output0[4:22] (scores)"]
    whole, boxes, scores = rows.values()
    assert boxes["part_of"] == scores["part_of"] == "output0" and scores["part"]["start"] == 4
    assert scores["sqnr_db"] < 1 and boxes["sqnr_db"] > 40  # one step of 1.25 px: the scores' whole range
    assert scores["sqnr_db"] <= whole["sqnr_db"] <= boxes["sqnr_db"]
    assert stage["sqnr_db"] == scores["sqnr_db"] and stage["cosine"] == scores["cosine"] == stage["quality"]
    assert stage["cosine"] < 0.5 and not stage["ok"]

    assert main([*args, "--max-drop", "50%", "--whole-outputs", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    stage = report["stages"][1]
    assert [o["name"] for o in stage["outputs"]] == ["output0"] and report["output_parts_decisions"] == []
    assert stage["sqnr_db"] == pytest.approx(whole["sqnr_db"]) and stage["cosine"] > 0.9999

    assert main([*args, "--max-drop", "50%"]) == 1
    captured = capsys.readouterr()
    out, err = " ".join(captured.out.split()), " ".join(captured.err.split())
    assert "output0[0:4] (boxes)" in out and "output0[4:22] (scores)" in out  # the parts table
    assert "output0 is scored as 2 parts" in err and "FAIL: candidate 1" in err


def test_a_builtin_metric_has_its_sampling_interval(degraded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--metric top1`` against the labels: each stage's score comes with its 95 % bootstrap interval over the
    450 samples, as wide as the binomial law says, in the JSON and the table."""
    code, data = _check(capsys, str(DIGITS / "model.onnx"), str(degraded), "--data", str(DIGITS / "eval.npz"),
                        "--metric", "top1", "--max-drop", "50%")
    assert code == 0
    stages = data["stages"]
    assert isinstance(stages, list)
    for stage in stages:
        p, iv = stage["metric"], stage["metric_interval"]
        assert iv["samples"] == 450 and iv["level"] == 0.95 and iv["low"] <= p <= iv["high"]
        half = 1.96 * math.sqrt(p * (1 - p) / 450)
        assert (iv["high"] - iv["low"]) / 2 == pytest.approx(half, abs=0.006)
    assert stages[1]["metric"] < stages[0]["metric"] - 0.02  # the broken scales cost top-1: a wider interval
    main(["check", str(DIGITS / "model.onnx"), str(degraded), "--data", str(DIGITS / "eval.npz"), "--metric",
          "top1", "--max-drop", "50%"])
    out = capsys.readouterr().out
    iv = stages[1]["metric_interval"]
    assert "metric (95% interval)" in out and f"({iv['low']:.4g}-{iv['high']:.4g})" in out


def test_a_failing_drop_within_the_sampling_interval_says_so() -> None:
    from qgraph.analysis.check import CheckResult, CheckRow, _judge
    from qgraph.metrics import Interval
    from qgraph.runtime.evaluation import StageScore

    result = CheckResult([], "data", "top1", Drop.parse("0.5%"))
    first = CheckRow("reference", "a.onnx", StageScore("reference", metric=0.96), quality=0.96)
    _judge(result, first, True)
    result.rows.append(first)
    near = CheckRow("candidate 1", "b.onnx", StageScore("candidate 1", metric=0.95,
                                                        metric_interval=Interval(0.93, 0.97, 0.95, 160)), quality=0.95)
    _judge(result, near, True)
    assert not near.ok and "lies within this stage's 95% interval 0.9300-0.9700 over 160 samples" in near.why
    far = CheckRow("candidate 2", "c.onnx", StageScore("candidate 2", metric=0.90,
                                                       metric_interval=Interval(0.88, 0.92, 0.95, 160)), quality=0.90)
    _judge(result, far, True)
    assert not far.ok and "interval" not in far.why
