"""Box math of the built-in metrics: IoU, NMS, COCO matching, F1 and AP, hand-computed and as properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph.metrics.boxes import COCO_IOUS, Detections, average_precision, box_iou, f1_counts, match, nms


def test_iou_of_two_offset_squares_is_one_seventh() -> None:
    iou = box_iou(np.array([[0, 0, 2, 2]]), np.array([[1, 1, 3, 3], [5, 5, 6, 6], [0, 0, 2, 2]]))
    assert iou[0] == pytest.approx([1 / 7, 0.0, 1.0])


def test_iou_of_a_zero_area_box_is_zero_not_nan() -> None:
    assert box_iou(np.array([[1, 1, 1, 1]]), np.array([[1, 1, 1, 1]]))[0, 0] == 0.0


def test_nms_keeps_the_best_of_overlapping_boxes_per_class_unless_agnostic() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 0, 11, 10], [0, 0, 10, 10], [50, 50, 60, 60]], float)
    scores = np.array([0.9, 0.8, 0.7, 0.6])
    classes = np.array([0, 0, 1, 0])
    assert nms(boxes, scores, classes, 0.5, agnostic=False, max_det=10).tolist() == [0, 2, 3]
    assert nms(boxes, scores, classes, 0.5, agnostic=True, max_det=10).tolist() == [0, 3]
    assert nms(boxes, scores, classes, 0.5, agnostic=True, max_det=1).tolist() == [0]
    # IoU of boxes 0 and 1 is 90/110 = 0.818: above 0.85 both stay
    assert nms(boxes, scores, classes, 0.85, agnostic=False, max_det=10).tolist() == [0, 1, 2, 3]


def _det(boxes: list[list[float]], scores: list[float], classes: list[int]) -> Detections:
    return Detections(np.array(boxes, float).reshape(-1, 4), np.array(scores, float), np.array(classes, np.int64))


def test_f1_pooled_over_images_by_hand() -> None:
    truth = [_det([[0, 0, 10, 10]], [1], [0]), _det([[20, 20, 30, 30]], [1], [1])]
    pred = [_det([[0, 0, 10, 10], [40, 40, 50, 50]], [0.9, 0.8], [0, 0]),
            _det([[20, 20, 30, 30]], [0.9], [0])]  # right box, wrong class: no match
    out = f1_counts(pred, truth, 0.5)
    assert (out["precision"], out["recall"]) == pytest.approx((1 / 3, 1 / 2))
    assert out["f1"] == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    assert (out["count"], out["reference_count"]) == (3.0, 2.0)


def test_f1_when_one_side_is_empty() -> None:
    one = [_det([[0, 0, 1, 1]], [1], [0])]
    none = [Detections.empty()]
    assert f1_counts(none, none, 0.5)["f1"] == 1.0
    assert f1_counts(none, one, 0.5) == pytest.approx({"f1": 0.0, "precision": 1.0, "recall": 0.0, "count": 0.0,
                                                       "reference_count": 1.0})
    assert f1_counts(one, none, 0.5)["f1"] == 0.0


def test_coco_matching_takes_the_highest_iou_truth_in_score_order() -> None:
    truth = _det([[0, 0, 10, 10], [0, 0, 10, 12]], [1, 1], [0, 0])
    pred = _det([[0, 0, 10, 11.9], [0, 0, 10, 10]], [0.6, 0.9], [0, 0])
    # pred 1 (score 0.9) goes first and takes truth 0 (IoU 1); pred 0 then takes truth 1 (IoU 119/120)
    assert match(pred, truth, np.array([0.5, 0.995])).tolist() == [[True, True], [False, True]]


def test_average_precision_by_hand() -> None:
    truth = [_det([[0, 0, 10, 10], [20, 0, 30, 10]], [1, 1], [0, 0])]
    pred = [_det([[0, 0, 10, 10], [50, 50, 60, 60], [20, 0, 30, 10]], [0.9, 0.8, 0.7], [0, 0, 0])]
    # precision 1, 1/2, 2/3 at recall 1/2, 1/2, 1: envelope 1 up to recall 0.5 (51 points), 2/3 after (50 points)
    assert average_precision(pred, truth, np.array([0.5])) == pytest.approx((51 + 50 * 2 / 3) / 101)
    # a class with truth but no prediction: AP 0 for it, the mean over the two classes halves
    truth2 = [_det([[0, 0, 10, 10], [40, 0, 50, 10]], [1, 1], [0, 1])]
    assert average_precision([_det([[0, 0, 10, 10]], [0.9], [0])], truth2, np.array([0.5])) == pytest.approx(0.5)
    assert average_precision([Detections.empty()], [Detections.empty()], COCO_IOUS) == 1.0


boxes_st = st.lists(st.tuples(st.floats(0, 100), st.floats(0, 100), st.floats(0.5, 50), st.floats(0.5, 50)),
                    min_size=1, max_size=12)


def _xyxy(raw: list[tuple[float, float, float, float]]) -> np.ndarray:
    a = np.array(raw, float)
    return np.concatenate([a[:, :2], a[:, :2] + a[:, 2:]], axis=1)


@settings(max_examples=60, deadline=None)
@given(boxes_st, boxes_st)
def test_iou_is_symmetric_in_unit_interval_and_one_on_itself(a: list, b: list) -> None:
    x, y = _xyxy(a), _xyxy(b)
    iou = box_iou(x, y)
    assert np.allclose(iou, box_iou(y, x).T)
    assert np.all((iou >= 0) & (iou <= 1 + 1e-12))
    assert np.allclose(np.diag(box_iou(x, x)), 1.0)


@settings(max_examples=60, deadline=None)
@given(boxes_st, st.data())
def test_identical_detections_give_f1_and_map_one_and_order_does_not_matter(raw: list, data: st.DataObject) -> None:
    n = len(raw)
    classes = np.array(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), np.int64)
    scores = np.linspace(0.95, 0.3, n)  # distinct scores: the matching order is defined
    det = Detections(_xyxy(raw), scores, classes)
    assert f1_counts([det], [det], 0.5)["f1"] == 1.0
    assert average_precision([det], [det], COCO_IOUS) == pytest.approx(1.0)
    perm = np.array(data.draw(st.permutations(range(n))))
    shuffled = Detections(det.boxes[perm], det.scores[perm], det.classes[perm])
    other = Detections(_xyxy(raw) + data.draw(st.floats(-3, 3)), scores[::-1].copy(), classes)
    assert f1_counts([shuffled], [other], 0.5) == f1_counts([det], [other], 0.5)
    assert average_precision([shuffled], [other], COCO_IOUS) == pytest.approx(
        average_precision([det], [other], COCO_IOUS))
    truth_perm = Detections(other.boxes[perm], other.scores[perm], other.classes[perm])
    assert average_precision([det], [truth_perm], COCO_IOUS) == pytest.approx(
        average_precision([det], [other], COCO_IOUS))


@settings(max_examples=60, deadline=None)
@given(boxes_st, st.floats(0.1, 0.9))
def test_nms_leaves_no_two_kept_boxes_above_the_threshold(raw: list, thr: float) -> None:
    b = _xyxy(raw)
    kept = nms(b, np.linspace(1, 0.1, len(b)), np.zeros(len(b), np.int64), thr, agnostic=True, max_det=100)
    iou = box_iou(b[kept], b[kept])
    np.fill_diagonal(iou, 0)
    assert np.all(iou <= thr)
    dropped = np.setdiff1d(np.arange(len(b)), kept)
    if len(dropped):  # every dropped box overlaps a kept one with a better score
        assert np.all(box_iou(b[dropped], b[kept]).max(axis=1) > thr)
