"""``detection``: each output layout decoded by hand, labels, options, and the metric by name."""

from __future__ import annotations

import numpy as np
import pytest

from qgraph.errors import DataError, RecipeError
from qgraph.metrics import builtin_metric, is_builtin
from qgraph.metrics.detection import DetectionOptions, decode


def _v8(rows: list[list[float]]) -> np.ndarray:
    """One image of a YOLOv8 head from anchor rows ``(cx, cy, w, h, scores...)``: ``[1, 4+C, N]``."""
    return np.array(rows, np.float32).T[None]


def test_yolov8_threshold_nms_and_box_format() -> None:
    out = _v8([[10, 10, 4, 4, 0.9, 0.1], [10.5, 10, 4, 4, 0.1, 0.8], [10.2, 10, 4, 4, 0.7, 0.0],
               [50, 50, 10, 10, 0.2, 0.1]])
    (found,) = decode(DetectionOptions(layout="yolov8"), [out])
    # anchor 3 is below 0.25; anchor 2 overlaps anchor 0 (same class) and goes; anchor 1 is another class
    assert found.classes.tolist() == [0, 1]
    assert found.scores == pytest.approx([0.9, 0.8])
    assert found.boxes[0] == pytest.approx([8, 8, 12, 12])
    (agnostic,) = decode(DetectionOptions(layout="yolov8", agnostic=True), [out])
    assert agnostic.classes.tolist() == [0]
    (xyxy,) = decode(DetectionOptions(layout="yolov8", box="xyxy", iou=1.0), [out])
    assert xyxy.boxes[0] == pytest.approx([10, 10, 4, 4])


def test_yolov5_multiplies_objectness_and_auto_tells_the_layouts_apart() -> None:
    v5 = np.array([[[10, 10, 4, 4, 0.5, 0.9, 0.1], [30, 30, 4, 4, 0.2, 0.9, 0.9]]], np.float32)  # [1, N=2, 5+2]
    (found,) = decode(DetectionOptions(layout="yolov5"), [v5])
    assert found.scores == pytest.approx([0.45])  # 0.5 x 0.9; the other is 0.2 x 0.9 = 0.18 < 0.25
    logits = v5.copy()
    logits[..., 4:] = np.log(v5[..., 4:] / (1 - v5[..., 4:]))
    (same,) = decode(DetectionOptions(layout="yolov5", sigmoid=True), [logits])
    assert same.scores == pytest.approx([0.45], rel=1e-5)
    # auto: [S, a, b] is a YOLOv8 head when a < b (4+C rows, many anchors), else YOLOv5 rows
    wide = np.zeros((1, 6, 100), np.float32)
    wide[0, :, 7] = [10, 10, 4, 4, 0.2, 0.6]
    (auto,) = decode(DetectionOptions(), [wide])
    assert auto.classes.tolist() == [1]
    tall = np.zeros((1, 100, 7), np.float32)
    tall[0, 7] = [10, 10, 4, 4, 0.5, 0.9, 0.1]
    (auto5,) = decode(DetectionOptions(), [tall])
    assert auto5.scores == pytest.approx([0.45])


def test_levels_decode_dfl_distances_around_anchor_centres() -> None:
    # a 16x16 input, strides 8 and 16: 2x2 anchors then 1x1; 2 classes; 4 sides x 3 bins
    scores = [np.zeros((1, 4, 2), np.float32), np.zeros((1, 1, 2), np.float32)]
    scores[0][0, 3, 1] = 0.9  # anchor (row 1, col 1) of stride 8: centre (12, 12)
    bins = [np.full((1, 4, 12), -50.0, np.float32), np.zeros((1, 1, 12), np.float32)]
    bins[0][0, 3].reshape(4, 3)[:, 1] = 50.0  # every side: bin 1 -> distance 1 x stride 8
    (found,) = decode(DetectionOptions(strides="8/16"), [*scores, *bins])  # size inferred: 2x2 at stride 8
    assert found.classes.tolist() == [1]
    assert found.boxes[0] == pytest.approx([4, 4, 20, 20])
    with pytest.raises(DataError, match="stride 8 on a 24x16 input gives 6 anchors"):
        decode(DetectionOptions(strides="8/16", size="24x16"), [*scores, *bins])


def test_an_already_suppressed_triple_and_labels_as_a_table() -> None:
    boxes = np.array([[[0, 0, 10, 10], [20, 20, 30, 30]]], np.float32)
    scores = np.array([[0.9, 0.1]], np.float32)
    labels = np.array([[3, 1]], np.int64)
    (found,) = decode(DetectionOptions(), [boxes, scores, labels])
    assert (found.classes.tolist(), found.boxes.tolist()) == ([3], [[0, 0, 10, 10]])
    metric = builtin_metric("detection.recall")
    table = np.array([[0, 3, 0, 0, 10, 10], [0, 1, 20, 20, 30, 30]], float)
    assert metric([boxes, scores, labels], table) == pytest.approx(0.5)  # the 0.1 box is below the threshold
    assert builtin_metric("detection.recall(score=0.05)")([boxes, scores, labels], table) == 1.0
    with pytest.raises(DataError, match=r"\(image, class, x0, y0, x1, y1\)"):
        metric([boxes, scores, labels], np.zeros((2, 3)))


def test_the_metric_against_the_reference_and_its_fields() -> None:
    ref = _v8([[10, 10, 4, 4, 0.9, 0.1], [40, 40, 8, 8, 0.1, 0.8]])
    # first box: IoU 3.5*4/(32-14) = 0.78 (a hit up to match IoU 0.75); second: IoU 4*8/(2*64-32) = 1/3
    moved = _v8([[10.5, 10, 4, 4, 0.9, 0.1], [44, 40, 8, 8, 0.1, 0.8]])
    f1 = builtin_metric("detection.f1(layout=yolov8)")
    assert f1([ref], [ref]) == 1.0
    assert f1([moved], [ref]) == pytest.approx(0.5)
    assert builtin_metric("detection.f1(layout=yolov8, match=0.3)")([moved], [ref]) == 1.0
    scores = builtin_metric("detection(layout=yolov8)").scores([moved], [ref])
    assert scores["map50"] == pytest.approx(0.5)  # class 0 AP 1, class 1 AP 0
    assert scores["map"] == pytest.approx((6 / 10 + 0) / 2)  # class 0: AP 1 at IoU 0.50..0.75, 0 above


def test_the_decoded_reference_is_reused_while_the_same_arrays_come_back() -> None:
    ref = _v8([[10, 10, 4, 4, 0.9, 0.1]])
    metric = builtin_metric("detection(layout=yolov8)")
    refs = [ref]
    metric([ref], refs)
    first = metric._cache
    metric([ref * 1.0], refs)
    assert metric._cache is first
    metric([ref], [ref.copy()])
    assert metric._cache is not first


def test_names_and_bad_options() -> None:
    assert is_builtin("detection.f1(score=0.3)") and is_builtin("ctc.cer") and is_builtin("top1")
    assert not is_builtin("mymod:detection") and not is_builtin("path/to.py:f") and not is_builtin("nosuch.f1")
    with pytest.raises(RecipeError, match="Options of detection: layout, score"):
        builtin_metric("detection(threshold=0.3)", RecipeError)
    with pytest.raises(DataError, match="size='8'"):
        builtin_metric("detection(size=8)")
    with pytest.raises(DataError, match="cannot tell the layout"):
        builtin_metric("detection")([np.zeros((2, 3))], [np.zeros((2, 3))])
