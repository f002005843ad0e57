"""``detection``: the detections a model makes, decoded as its own post-process does, against the reference's.

Layouts (``layout=auto`` picks by shape):

- ``yolov8``: one output ``[S, 4+C, N]`` (``cx, cy, w, h`` then C class scores per anchor column);
- ``yolov5``: one output ``[S, N, 4+1+C]`` (box, objectness, C class scores; score = objectness x class score);
- ``levels``: per-level outputs, first the L score outputs ``[S, N_l, C]`` then the L box outputs ``[S, N_l, 4]``
  (distances ``l, t, r, b`` in stride units) or ``[S, N_l, 4(R+1)]`` (distribution focal loss bins: softmax,
  expectation) as PicoDet/NanoDet export them; anchor centres ``((col + 0.5) s, (row + 0.5) s)`` on a
  ``ceil(H/s) x ceil(W/s)`` grid per stride ``s``, which needs ``size=HxW`` (a square is inferred);
- ``nms``: an already-suppressed triple: boxes ``[S, K, 4]``, scores ``[S, K]`` and class labels ``[S, K]``.

Per image: candidates whose best class score is at least ``score`` (after a sigmoid with ``sigmoid=true``), the
best ``candidates`` of them, greedy NMS at ``iou`` (per class, or across classes with ``agnostic=true``), at most
``max_det`` kept. Truth: the reference model's detections decoded the same way, or labels: one table
``[M, 6]`` of ``(image, class, x0, y0, x1, y1)`` rows for every sample. Fields: ``f1``, ``precision``,
``recall`` at match IoU ``match`` (a prediction is a true positive when it takes a truth of its class with
IoU >= ``match``, COCO's greedy order), ``map50`` and ``map`` (mAP@0.5 and mAP@0.5:0.95, 101-point COCO AP).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from qgraph.errors import DataError
from qgraph.metrics.boxes import (
    BOX_FAILURES,
    COCO_IOUS,
    Detections,
    average_precision,
    box_counts,
    cxcywh_to_xyxy,
    f1_counts,
    nms,
    pooled_f1,
)
from qgraph.metrics.family import Family, MetricOptions, split_list


class DetectionOptions(MetricOptions):
    """Options of ``detection``."""

    layout: Literal["auto", "yolov8", "yolov5", "levels", "nms"] = "auto"
    score: float = Field(0.25, description="score threshold of a candidate")
    iou: float = Field(0.45, ge=0.0, le=1.0, description="NMS IoU")
    match: float = Field(0.5, gt=0.0, le=1.0, description="IoU of a true positive (f1, precision, recall)")
    agnostic: bool = Field(False, description="NMS across classes")
    box: Literal["auto", "cxcywh", "xyxy"] = Field("auto", description="auto: cxcywh for yolo, xyxy otherwise")
    sigmoid: bool = Field(False, description="the class outputs are logits")
    max_det: int = Field(300, ge=1)
    candidates: int = Field(3000, ge=1, description="best candidates per image kept for NMS")
    size: str | None = Field(None, description="HxW of the input (levels layout)")
    strides: str = Field("8/16/32/64", description="strides of the levels, '/'-joined")

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            split_list(value.replace("x", "/"), "size")
            if len(value.split("x")) != 2:
                raise ValueError(f"size={value!r}: give HxW, e.g. 800x608")
        return value

    @field_validator("strides")
    @classmethod
    def _strides(cls, value: str) -> str:
        split_list(value, "strides")
        return value


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.asarray(1.0 / (1.0 + np.exp(-np.clip(x, -60, 60))))


def _layout(opts: DetectionOptions, outputs: list[np.ndarray]) -> str:
    if opts.layout != "auto":
        return opts.layout
    shapes = [np.shape(o) for o in outputs]
    if len(outputs) == 1 and len(shapes[0]) == 3:
        return "yolov8" if shapes[0][1] < shapes[0][2] else "yolov5"
    if len(outputs) == 3 and any(len(s) == 3 and s[-1] == 4 for s in shapes) and \
            sum(len(s) == 2 for s in shapes) == 2:
        return "nms"
    if len(outputs) >= 2 and len(outputs) % 2 == 0 and all(len(s) == 3 for s in shapes):
        return "levels"
    raise DataError(f"metric detection: cannot tell the layout of outputs shaped {[list(s) for s in shapes]}; "
                    "give layout=yolov8 ([S,4+C,N]), yolov5 ([S,N,5+C]), levels (score and box outputs per "
                    "level) or nms (boxes, scores, labels).")


def _select(opts: DetectionOptions, boxes: np.ndarray, cls_scores: np.ndarray, xyxy: bool) -> Detections:
    """Threshold, cap and suppress the candidates of one image (``cls_scores [n, C]`` already thresholded)."""
    best = cls_scores.max(axis=1) if cls_scores.size else np.zeros(0)
    classes = cls_scores.argmax(axis=1) if cls_scores.size else np.zeros(0, np.int64)
    if len(best) > opts.candidates:
        top = np.argsort(-best, kind="stable")[: opts.candidates]
        boxes, best, classes = boxes[top], best[top], classes[top]
    corners = np.asarray(boxes, np.float64) if xyxy else cxcywh_to_xyxy(boxes)
    keep = nms(corners, best, classes, opts.iou, opts.agnostic, opts.max_det)
    return Detections(corners[keep], best[keep].astype(np.float64), classes[keep].astype(np.int64))


def _yolo(opts: DetectionOptions, out: np.ndarray, v8: bool) -> list[Detections]:
    rows = np.swapaxes(out, 1, 2) if v8 else out  # [S, N, 4(+1)+C]
    boxes = rows[..., :4]
    cls = rows[..., 4:] if v8 else rows[..., 5:]
    if opts.sigmoid:
        cls = _sigmoid(cls)
    if not v8:
        obj = _sigmoid(rows[..., 4:5]) if opts.sigmoid else rows[..., 4:5]
        cls = cls * obj
    best = cls.max(axis=2)
    xyxy = opts.box == "xyxy"
    found = []
    for s in range(rows.shape[0]):
        keep = np.flatnonzero(best[s] >= opts.score)
        found.append(_select(opts, boxes[s, keep], cls[s, keep], xyxy))
    return found


def _grid(size: tuple[int, int], stride: int) -> np.ndarray:
    """Anchor centres ``[n, 2]`` (x, y) of one level, row-major."""
    rows, cols = math.ceil(size[0] / stride), math.ceil(size[1] / stride)
    yy, xx = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    return np.stack([(xx.ravel() + 0.5) * stride, (yy.ravel() + 0.5) * stride], axis=1)


def _level_size(opts: DetectionOptions, first: int, stride: int) -> tuple[int, int]:
    if opts.size is not None:
        h, w = (int(v) for v in opts.size.split("x"))
        return h, w
    side = math.isqrt(first)
    if side * side != first:
        raise DataError(f"metric detection (levels): the first level has {first} anchors, not a square grid; give "
                        "the input size, e.g. detection.f1(size=800x608).")
    return side * stride, side * stride


def _distances(raw: np.ndarray) -> np.ndarray:
    """``[n, 4]`` distances from ``[n, 4]`` or DFL bins ``[n, 4(R+1)]`` (softmax per side, expectation)."""
    if not len(raw):
        return np.zeros((0, 4))
    if raw.shape[-1] == 4:
        return np.asarray(raw, np.float64)
    bins = raw.reshape(len(raw), 4, -1).astype(np.float64)
    e = np.exp(bins - bins.max(axis=2, keepdims=True))
    return np.asarray((e / e.sum(axis=2, keepdims=True)) @ np.arange(bins.shape[2], dtype=np.float64))


def _levels(opts: DetectionOptions, outputs: list[np.ndarray]) -> list[Detections]:
    half = len(outputs) // 2
    scores, raws = outputs[:half], outputs[half:]
    strides = split_list(opts.strides, "strides")
    if len(strides) < half:
        raise DataError(f"metric detection (levels): {half} levels but strides={opts.strides}; give one stride per "
                        "level, e.g. strides=8/16/32.")
    size = _level_size(opts, np.shape(scores[0])[1], strides[0])
    grids = [_grid(size, s) for s in strides[:half]]
    for g, sc, s in zip(grids, scores, strides, strict=False):
        if len(g) != np.shape(sc)[1]:
            raise DataError(f"metric detection (levels): stride {s} on a {size[0]}x{size[1]} input gives {len(g)} "
                            f"anchors, the output has {np.shape(sc)[1]}; check size= and strides=.")
    found = []
    for s in range(np.shape(scores[0])[0]):
        boxes, cls = [], []
        for grid, sc, raw, stride in zip(grids, scores, raws, strides, strict=False):
            p = _sigmoid(sc[s]) if opts.sigmoid else np.asarray(sc[s])
            keep = np.flatnonzero(p.max(axis=1) >= opts.score)
            d = _distances(np.asarray(raw[s][keep])) * stride
            centre = np.concatenate([grid[keep], grid[keep]], axis=1)
            boxes.append(centre + d * np.array([-1.0, -1.0, 1.0, 1.0]))
            cls.append(p[keep])
        found.append(_select(opts, np.concatenate(boxes), np.concatenate(cls), True))
    return found


def _suppressed(opts: DetectionOptions, outputs: list[np.ndarray]) -> list[Detections]:
    box_i = next(i for i, o in enumerate(outputs) if np.ndim(o) == 3 and np.shape(o)[-1] == 4)
    rest = [i for i in range(len(outputs)) if i != box_i]
    label_i = next((i for i in rest if np.asarray(outputs[i]).dtype.kind in "iu"), rest[1])
    score_i = next(i for i in rest if i != label_i)
    boxes, scores, labels = (np.asarray(outputs[i]) for i in (box_i, score_i, label_i))
    found = []
    for s in range(len(scores)):
        keep = np.flatnonzero(scores[s] >= opts.score)
        b = boxes[s, keep].astype(np.float64)
        found.append(Detections(cxcywh_to_xyxy(b) if opts.box == "cxcywh" else b, scores[s, keep].astype(np.float64),
                                labels[s, keep].astype(np.int64)))
    return found


def decode(opts: DetectionOptions, outputs: list[np.ndarray]) -> list[Detections]:
    """The detections of every sample (module docs)."""
    layout = _layout(opts, outputs)
    if layout in ("yolov8", "yolov5"):
        out = np.asarray(outputs[0])
        if out.ndim != 3:
            raise DataError(f"metric detection ({layout}): output shape {list(out.shape)}, expected 3 axes.")
        return _yolo(opts, out, layout == "yolov8")
    if layout == "levels":
        return _levels(opts, outputs)
    return _suppressed(opts, outputs)


def from_labels(opts: DetectionOptions, labels: np.ndarray, outputs: list[np.ndarray]) -> list[Detections]:
    """Truth per sample from a ``[M, 6]`` table ``(image, class, x0, y0, x1, y1)``."""
    table = np.asarray(labels, np.float64)
    if table.ndim != 2 or table.shape[1] != 6:
        raise DataError(f"metric detection: labels shaped {list(table.shape)}; give one table [M, 6] of rows "
                        "(image, class, x0, y0, x1, y1) in input pixels.")
    count = int(np.shape(outputs[0])[0]) if outputs else int(table[:, 0].max(initial=-1)) + 1
    out = []
    for s in range(count):
        rows = table[table[:, 0] == s]
        out.append(Detections(rows[:, 2:6], np.ones(len(rows)), rows[:, 1].astype(np.int64)))
    return out


def compare(opts: DetectionOptions, got: list[Detections], truth: list[Detections], want: str | None
            ) -> dict[str, float]:
    """``f1``/``precision``/``recall`` always; ``map50``/``map`` when asked for (or ``want`` is None: all)."""
    if len(got) != len(truth):
        raise DataError(f"metric detection: {len(got)} sample(s) scored against {len(truth)}.")
    out = f1_counts(got, truth, opts.match)
    if want in (None, "map50"):
        out["map50"] = average_precision(got, truth, np.array([0.5]))
    if want in (None, "map"):
        out["map"] = average_precision(got, truth, COCO_IOUS)
    return out


def counts(opts: DetectionOptions, got: list[Detections], truth: list[Detections]) -> np.ndarray:
    """True positives, predictions and truths per image (`box_counts`; mAP pools no per-image counts)."""
    if len(got) != len(truth):
        raise DataError(f"metric detection: {len(got)} sample(s) scored against {len(truth)}.")
    return box_counts(got, truth, opts.match)


FAMILY = Family(
    "detection", {"f1": True, "precision": True, "recall": True, "map50": True, "map": True}, "f1",
    DetectionOptions, decode, compare, from_labels=from_labels, labels_per_sample=False, counts=counts,
    pooled=pooled_f1, failures=BOX_FAILURES, pooled_fields=("f1", "precision", "recall"),
    summary="detections (YOLOv5/v8, per-level, NMSed) vs the reference's or labels: F1, precision, recall, mAP")
