"""Built-in metrics by name wherever a metric is: targets, ``Evaluation`` (check, diff, run --report,
sensitivity), the fallback search, and the ``float_fallback`` recipe."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from qgraph.analysis.sensitivity.targets import parse_target
from qgraph.cli import main
from qgraph.data import CallableSource
from qgraph.errors import RecipeError
from qgraph.metrics import BuiltinMetric
from qgraph.pipeline.recipe import Recipe
from qgraph.runtime.evaluation import Evaluation, load_metric
from qgraph.testing.detection import detection_feeds, detection_head

#: detection_head's class scores reach ~0.5: a threshold the float model crosses a few dozen times.
DET = "detection.f1(layout=yolov8, score=0.1)"


def test_targets_take_the_metric_direction_and_relative_goals() -> None:
    t = parse_target("ctc.cer:0.02")
    assert (t.kind, t.higher_is_better, t.goal, t.describe()) == ("metric", False, 0.02, "ctc.cer <= 0.02")
    assert t.met(0.01, t.threshold(0.0)) and not t.met(0.03, t.threshold(0.0))
    r = parse_target("detection.map50(score=0.3) >= float-1%")
    assert (r.relative, r.goal, r.threshold(0.9)) == ("percent", -1.0, pytest.approx(0.891))
    with pytest.raises(RecipeError, match="lower-is-better: write <="):
        parse_target("ctc.cer>=0.1")
    with pytest.raises(RecipeError, match="has no field 'f2'"):
        parse_target("detection.f2:0.9", load=False)


def test_a_recipe_names_a_task_metric_target_and_a_bad_one_names_file_and_line() -> None:
    ok = Recipe.from_text("name: r\npasses:\n  - pass: float_fallback\n    auto: {target: 'detection.f1:0.98'}\n")
    assert ok.passes[0].name == "float_fallback"
    with pytest.raises(RecipeError, match=r"<recipe>:4:20: .*Options of detection"):
        Recipe.from_text("name: r\npasses:\n  - pass: float_fallback\n    auto: {target: 'detection(thr=1):0.98'}\n")


def _npz(path: Path, feeds: list[dict[str, np.ndarray]], **extra: np.ndarray) -> Path:
    np.savez(path, images=np.concatenate([f["images"] for f in feeds]), **extra)
    return path


def test_evaluation_gives_a_detection_metric_the_whole_label_table(tmp_path: Path) -> None:
    model = detection_head()
    feeds = detection_feeds(3)
    # two boxes on image 2 only: more label rows than samples would be refused for a per-sample metric
    table = np.array([[2, 1, 0, 0, 5, 5], [2, 3, 1, 1, 4, 4], [2, 3, 1, 1, 4, 4], [2, 3, 1, 1, 4, 4]], float)
    ev = Evaluation.open(model, _npz(tmp_path / "eval.npz", feeds, labels=table), metric=f"{DET[:-1]}, match=0.01)")
    assert isinstance(ev.metric, BuiltinMetric) and ev.labels is not None and len(ev.labels) == 4
    _, outs = ev.outputs(model)
    value = ev.score(outs, outs)
    want = ev.metric.scores(outs, table)
    assert value == pytest.approx(want["f1"]) and want["reference_count"] == 4.0
    assert isinstance(load_metric("ctc.cer"), BuiltinMetric)


def _quantized(feeds: list[dict[str, np.ndarray]]) -> onnx.ModelProto:
    from qgraph import Pipeline
    from qgraph.pipeline.pass_api import get_pass

    model = detection_head()
    # a shared scale at the final Concat: the class scores round to a few levels, the detections change
    return Pipeline([get_pass("insert_qdq")(preset="ort-x86-vnni", elementwise="always", joins={"keep_float": False})]
                    ).run(model, calibration_data=CallableSource(lambda: feeds, "images")).model


def test_the_fallback_search_meets_a_detection_target(tmp_path: Path) -> None:
    from qgraph.analysis.sensitivity.search import auto_fallback

    feeds = detection_feeds(16)
    model, qdq = detection_head(), _quantized(feeds)
    data = _npz(tmp_path / "eval.npz", detection_feeds(16, seed=5))
    result = auto_fallback(model, qdq, str(data), f"{DET}:0.99")
    assert result.float_score == 1.0 and result.int8_score < 0.99, result.message()
    assert result.target_met and result.score >= 0.99
    assert 0 < len(result.nodes) < 10


def test_check_and_diff_score_with_a_builtin_metric(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    feeds = detection_feeds(8)
    model, qdq = detection_head(), _quantized(feeds)
    onnx.save(model, tmp_path / "f.onnx")
    onnx.save(qdq, tmp_path / "q.onnx")
    data = _npz(tmp_path / "eval.npz", detection_feeds(8, seed=3))
    code = main(["check", str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), "--data", str(data), "--metric", DET,
                 "--json", "-"])
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert code in (0, 1) and stages[0]["metric"] == 1.0 and 0.0 <= stages[-1]["metric"] < 1.0
    assert main(["check", str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), "--data", str(data), "--metric",
                 "detection.f9"]) == 2
    assert "detection has no field 'f9'" in capsys.readouterr().err
