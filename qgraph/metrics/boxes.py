"""Boxes: IoU, greedy non-maximum suppression, and matching one set of detections to another.

Boxes are ``[k, 4]`` arrays of ``(x0, y0, x1, y1)`` corners (any consistent axis order works: IoU does not care).
Everything is vectorised over boxes; the only Python loops run over the kept detections of one image.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: IoU thresholds of mAP@0.5:0.95 (COCO): 0.50, 0.55, ..., 0.95.
COCO_IOUS = np.round(np.arange(0.5, 0.951, 0.05), 2)


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU matrix ``[len(a), len(b)]``: ``|A ∩ B| / |A ∪ B|``; 0 where the union is empty (zero-area boxes)."""
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0.0, None), axis=2)
    area_a = np.prod(np.clip(a[:, 2:] - a[:, :2], 0.0, None), axis=1)
    area_b = np.prod(np.clip(b[:, 2:] - b[:, :2], 0.0, None), axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def cxcywh_to_xyxy(boxes: np.ndarray) -> np.ndarray:
    """``(cx, cy, w, h)`` -> ``(cx - w/2, cy - h/2, cx + w/2, cy + h/2)``."""
    b = np.asarray(boxes, np.float64)
    half = b[..., 2:] / 2
    return np.concatenate([b[..., :2] - half, b[..., :2] + half], axis=-1)


def nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou: float, agnostic: bool,
        max_det: int) -> np.ndarray:
    """Indices kept by greedy NMS, best score first: a box is dropped when its IoU with a kept box (of the same
    class, unless ``agnostic``) is above ``iou``. At most ``max_det`` are kept.

    One IoU row per kept box against the boxes still alive, so the cost is O(kept x candidates), never the full
    candidates² matrix (an INT8 model that lights up every anchor still scores in milliseconds)."""
    if not len(scores):
        return np.zeros(0, np.int64)
    order = np.argsort(-scores, kind="stable")
    b = np.asarray(boxes, np.float64)[order]
    if not agnostic:  # the usual trick: move each class to its own region so boxes of two classes never overlap
        span = float(np.abs(b).max()) * 2 + 1
        b = b + (np.asarray(classes, np.float64)[order] * span)[:, None]
    alive = np.arange(len(order))
    kept: list[int] = []
    while len(alive) and len(kept) < max_det:
        i = int(alive[0])
        kept.append(i)
        rest = alive[1:]
        alive = rest[box_iou(b[i], b[rest])[0] <= iou]
    return order[np.asarray(kept, np.int64)]


@dataclass(frozen=True)
class Detections:
    """The detections of one image: xyxy ``boxes [k, 4]``, ``scores [k]``, integer ``classes [k]``."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray

    @classmethod
    def empty(cls) -> Detections:
        """No detection."""
        return cls(np.zeros((0, 4)), np.zeros(0), np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.scores)


def match(pred: Detections, truth: Detections, thresholds: np.ndarray) -> np.ndarray:
    """Which predictions are true positives, per IoU threshold: ``[len(thresholds), len(pred)]`` booleans.

    COCO's rule: predictions in descending score order each take the not yet taken truth of the same class with
    the highest IoU, when that IoU is at least the threshold."""
    hits = np.zeros((len(thresholds), len(pred)), bool)
    if not len(pred) or not len(truth):
        return hits
    iou = box_iou(pred.boxes, truth.boxes)
    iou[np.asarray(pred.classes)[:, None] != np.asarray(truth.classes)[None, :]] = -1.0
    order = np.argsort(-pred.scores, kind="stable")
    for t, thr in enumerate(thresholds):
        taken = np.zeros(len(truth), bool)
        for p in order:
            row = np.where(taken, -1.0, iou[p])
            j = int(np.argmax(row))
            if row[j] >= thr:
                taken[j] = True
                hits[t, p] = True
    return hits


def box_counts(pred: list[Detections], truth: list[Detections], iou: float) -> np.ndarray:
    """Per image: true positives at match IoU ``iou``, predictions and truths, ``[S, 3]``."""
    rows = [(int(match(p, t, np.array([iou]))[0].sum()), len(p), len(t)) for p, t in zip(pred, truth, strict=True)]
    return np.array(rows, np.float64).reshape(-1, 3)


#: One lost detection (a truth unmatched, one prediction fewer) and one extra (a prediction more), in `box_counts`.
BOX_FAILURES = ((-1.0, -1.0, 0.0), (0.0, 1.0, 0.0))


def pooled_f1(sums: np.ndarray) -> dict[str, np.ndarray]:
    """F1, precision and recall from summed ``box_counts`` (any leading axes): 1.0 each when neither side detects
    anything; precision 1.0 when nothing is predicted, recall 1.0 when there is nothing to find."""
    tp, n_pred, n_true = (np.asarray(sums, np.float64)[..., i] for i in range(3))
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(n_pred > 0, tp / np.where(n_pred > 0, n_pred, 1.0), 1.0)
        recall = np.where(n_true > 0, tp / np.where(n_true > 0, n_true, 1.0), 1.0)
        both = precision + recall
        f1 = np.where(both > 0, 2 * precision * recall / np.where(both > 0, both, 1.0), 0.0)
    return {"f1": f1, "precision": precision, "recall": recall, "count": n_pred, "reference_count": n_true}


def f1_counts(pred: list[Detections], truth: list[Detections], iou: float) -> dict[str, float]:
    """Precision, recall and F1 pooled over images at one match IoU (`pooled_f1` of the summed `box_counts`)."""
    return {k: float(v) for k, v in pooled_f1(box_counts(pred, truth, iou).sum(axis=0)).items()}


def average_precision(pred: list[Detections], truth: list[Detections], thresholds: np.ndarray) -> float:
    """Mean over ``thresholds`` and over the classes that have a truth of COCO's 101-point interpolated AP.

    Per class: predictions pooled over images in descending score order; precision is made monotone (running
    maximum from the right) and read at recall 0, 0.01, ..., 1 (0 beyond the highest recall reached). No truth at
    all: 1.0 when nothing is predicted either, else 0.0."""
    classes = np.unique(np.concatenate([np.asarray(t.classes) for t in truth])) if truth else np.zeros(0)
    if not len(classes):
        return 1.0 if not sum(len(p) for p in pred) else 0.0
    hits = [match(p, t, thresholds) for p, t in zip(pred, truth, strict=True)]
    all_hits = np.concatenate(hits, axis=1) if hits else np.zeros((len(thresholds), 0), bool)
    scores = np.concatenate([p.scores for p in pred]) if pred else np.zeros(0)
    pred_cls = np.concatenate([np.asarray(p.classes) for p in pred]) if pred else np.zeros(0)
    true_cls = np.concatenate([np.asarray(t.classes) for t in truth])
    recall_points = np.linspace(0.0, 1.0, 101)
    aps = np.zeros((len(thresholds), len(classes)))
    for c_i, c in enumerate(classes):
        sel = np.flatnonzero(pred_cls == c)
        sel = sel[np.argsort(-scores[sel], kind="stable")]
        if not len(sel):
            continue  # a class to find and nothing predicted: AP 0
        n_true = int(np.sum(true_cls == c))
        tp = np.cumsum(all_hits[:, sel], axis=1)  # [T, k]
        fp = np.cumsum(~all_hits[:, sel], axis=1)
        recall = tp / n_true
        precision = tp / np.maximum(tp + fp, 1)
        envelope = np.maximum.accumulate(precision[:, ::-1], axis=1)[:, ::-1]
        for t in range(len(thresholds)):
            idx = np.searchsorted(recall[t], recall_points, side="left")
            read = np.where(idx < len(sel), envelope[t][np.minimum(idx, len(sel) - 1)], 0.0)
            aps[t, c_i] = float(np.mean(read))
    return float(aps.mean())
