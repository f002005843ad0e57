"""benchmarks/bench_detect.py on what is cheap: the fallback recipe it writes, the lines that explain a slice
below 15 dB, and the changed detections it counts."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from qgraph.metrics import builtin_metric
from qgraph.pipeline.recipe import Recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
bd = pytest.importorskip("bench_detect")


def test_the_fallback_recipe_is_the_ready_recipe_plus_a_task_metric_stage(tmp_path: Path) -> None:
    path = bd.fallback_recipe("ort-x86-vnni", bd.METRICS["layout"], 0.995, tmp_path, "float.onnx", "")
    recipe = Recipe.from_yaml(path)
    names = [p.name for p in recipe.passes]
    assert names[-1] == "float_fallback" and "insert_qdq" in names
    auto = recipe.passes[-1].config.auto
    assert auto.target == ("detection.f1(layout=levels, score=0.5, iou=0.5, size=800x608, strides=8/16/32/64)"
                           ":0.995") and auto.reference == "float.onnx"


def test_changed_detections_and_the_note_for_a_low_slice() -> None:
    metric = builtin_metric("detection(layout=yolov8)")
    ref = np.zeros((1, 6, 40), np.float32)
    ref[0, :, 0] = [10, 10, 4, 4, 0.9, 0.0]
    ref[0, :, 1] = [30, 30, 4, 4, 0.0, 0.27]
    got = ref.copy()
    got[0, 5, 1] = 0.24  # just below 0.25: float's detection is lost
    got[0, :, 2] = [50, 50, 4, 4, 0.26, 0.0]  # a new one just above
    changed = bd.changed(metric, [got], [ref])
    assert sorted(changed) == [("extra", pytest.approx(0.26)), ("lost", pytest.approx(0.27))]
    row = {"model": "m", "tool": "t", "task": metric.scores([got], [ref]), "changed": changed,
           "slices": {"slices_db": {"scores/s8": 12.0, "boxes/s8": 40.0}}}
    (line,) = bd.notes([row])
    assert line == ("m t: scores/s8 12.0 dB below 15 dB; F1 0.5000: 2 detection(s) differ from float (1 lost, "
                    "1 extra), scores 0.260-0.270")


def test_a_recognizer_gets_a_ctc_fallback_target_and_its_changed_strings(tmp_path: Path) -> None:
    path = bd.fallback_recipe("ort-x86-vnni", bd.METRICS["ocr_rec"], 0.99, tmp_path, "float.onnx", "")
    assert Recipe.from_yaml(path).passes[-1].config.auto.target == "ctc.exact:0.99"
    chars = ["blank", "a", "b", " "]
    ref = np.zeros((2, 4, 4), np.float32)
    ref[0, np.arange(4), [1, 0, 2, 3]] = 1.0  # "ab "
    ref[1, np.arange(4), [2, 2, 0, 2]] = 1.0  # "bb" (a blank between the two b)
    got = ref.copy()
    got[0, 3] = [0, 0.6, 0, 0.4]  # the trailing space becomes an a: "aba"
    spec = type("Spec", (), {"extra": {"chars": chars}, "labels": np.array(["ab", "bb"])})()
    out = bd.changed_strings([got], [ref], spec)
    assert out["strings"] == [("ab ", "aba")]
    assert out["truth"] == {"exact": 0.5, "exact_strip": 0.5, "exact_nospace": 0.5, "cer_nospace": 0.25}
