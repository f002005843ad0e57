"""``text_boxes`` (a DB text detector's boxes) and ``ctc`` (greedy CTC decoding of a text recognizer).

``text_boxes``, as PP-OCR's ``DBPostProcess``: the probability map ``[S, 1, H, W]`` (output ``output``) is
thresholded at ``thresh``, dilated by a 2x2 square (``dilate=false`` to skip), split into 8-connected
components; a component's bounding box is kept when its short side is at least 3 pixels and the mean
probability inside the box at least ``box_thresh``; the box grows by ``d = area * unclip / perimeter`` on every
side (pyclipper's unclip of a rectangle) and is dropped when its short side is then below 5. Boxes are
axis-aligned (the wheel fits rotated rectangles; on horizontal text the two agree). Fields: ``f1``,
``precision``, ``recall``: the candidate's boxes matched to the reference's at IoU >= ``match``.

``ctc``: per sample and time step the arg-max over the last axis of ``[S, T, V]``; repeats are merged, then the
``blank`` index removed. Against the reference's decoded strings (or labels: an ``[S, L]`` integer array padded
with negative values, or strings with ``chars=FILE``, one character per line, index 1 the first line when
``blank=0``). Fields: ``exact`` (share of samples decoded exactly), ``cer`` (character error rate:
Σ edit distance / Σ truth length; lower is better).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import Field

from qgraph.errors import DataError
from qgraph.metrics.boxes import BOX_FAILURES, Detections, box_counts, f1_counts, pooled_f1
from qgraph.metrics.components import components
from qgraph.metrics.family import Family, MetricOptions, output


class TextBoxOptions(MetricOptions):
    """Options of ``text_boxes``."""

    output: int = 0
    thresh: float = Field(0.3, description="probability threshold of a text pixel")
    box_thresh: float = Field(0.5, description="mean probability a box keeps")
    unclip: float = Field(1.6, ge=0.0)
    dilate: bool = True
    match: float = Field(0.5, gt=0.0, le=1.0, description="IoU of a true positive")


def text_boxes(prob: np.ndarray, opts: TextBoxOptions) -> Detections:
    """The DB boxes of one map ``[..., H, W]`` as `Detections` (xyxy, score = mean probability, class 0)."""
    p = np.asarray(prob, np.float64)
    p = p.reshape(p.shape[-2], p.shape[-1])
    mask = p > opts.thresh
    if opts.dilate:  # cv2.dilate with a 2x2 kernel (anchor at its centre): the pixel, its up, left, up-left
        grown = mask.copy()
        grown[1:] |= mask[:-1]
        grown[:, 1:] |= mask[:, :-1]
        grown[1:, 1:] |= mask[:-1, :-1]
        mask = grown
    found = components(mask)
    if not len(found):
        return Detections.empty()
    integral = np.zeros((p.shape[0] + 1, p.shape[1] + 1))
    integral[1:, 1:] = p.cumsum(0).cumsum(1)
    y0, x0, y1, x1 = found.T
    bh, bw = y1 - y0, x1 - x0
    mean = (integral[y1, x1] - integral[y0, x1] - integral[y1, x0] + integral[y0, x0]) / (bh * bw)
    d = bh * bw * opts.unclip / (2.0 * (bh + bw))
    keep = (np.minimum(bh, bw) >= 3) & (mean >= opts.box_thresh) & (np.minimum(bh, bw) + 2 * d >= 5)
    h, w = int(p.shape[0]), int(p.shape[1])
    d = d[keep]
    boxes = np.stack([np.maximum(0, np.round(x0[keep] - d)), np.maximum(0, np.round(y0[keep] - d)),
                      np.minimum(w, np.round(x1[keep] + d)), np.minimum(h, np.round(y1[keep] + d))], axis=1)
    return Detections(boxes, mean[keep], np.zeros(int(keep.sum()), np.int64))


def _decode_boxes(opts: TextBoxOptions, outputs: list[np.ndarray]) -> list[Detections]:
    maps = output(outputs, opts.output, "text_boxes")
    if maps.ndim < 3:
        raise DataError(f"metric text_boxes: output {opts.output} shaped {list(maps.shape)}; expected a probability "
                        "map [S, 1, H, W] (or [S, H, W]).")
    return [text_boxes(m, opts) for m in maps]


def _compare_boxes(opts: TextBoxOptions, got: list[Detections], truth: list[Detections], _want: str | None
                   ) -> dict[str, float]:
    return f1_counts(got, truth, opts.match)


def _box_counts(opts: TextBoxOptions, got: list[Detections], truth: list[Detections]) -> np.ndarray:
    return box_counts(got, truth, opts.match)


TEXT_BOXES = Family("text_boxes", {"f1": True, "precision": True, "recall": True}, "f1", TextBoxOptions,
                    _decode_boxes, _compare_boxes, counts=_box_counts, pooled=pooled_f1, failures=BOX_FAILURES,
                    pooled_fields=("f1", "precision", "recall"),
                    summary="DB text-detector boxes vs the reference's: F1, precision, recall")


class CtcOptions(MetricOptions):
    """Options of ``ctc``."""

    output: int = 0
    blank: int = 0
    chars: str | None = Field(None, description="character list file (one per line), to read string labels")


def greedy(probs: np.ndarray, blank: int) -> list[tuple[int, ...]]:
    """Greedy CTC: arg-max per step, repeats merged, blanks removed; one id sequence per sample."""
    ids = np.asarray(probs).argmax(axis=-1).reshape(np.shape(probs)[0], -1)
    new = np.ones_like(ids, bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    keep = new & (ids != blank)
    return [tuple(int(v) for v in row[k]) for row, k in zip(ids, keep, strict=True)]


def edit_distance(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Levenshtein distance (insert, delete, substitute: 1 each), one numpy row per element of ``a``."""
    if not a or not b:
        return max(len(a), len(b))
    bb = np.asarray(b)
    prev = np.arange(len(b) + 1)
    for i, x in enumerate(a, 1):
        sub = prev[:-1] + (bb != x)
        cur = np.empty_like(prev)
        cur[0] = i
        cur[1:] = np.minimum(sub, prev[1:] + 1)
        # insertion runs left to right: cur[j] = min(cur[j], cur[j-1] + 1) == min_k (cur[k] + j - k)
        cur = np.minimum.accumulate(cur - np.arange(len(cur))) + np.arange(len(cur))
        prev = cur
    return int(prev[-1])


def _decode_ctc(opts: CtcOptions, outputs: list[np.ndarray]) -> list[tuple[int, ...]]:
    probs = output(outputs, opts.output, "ctc")
    if probs.ndim < 3:
        raise DataError(f"metric ctc: output {opts.output} shaped {list(probs.shape)}; expected [S, T, V].")
    return greedy(probs, opts.blank)


def _ctc_labels(opts: CtcOptions, labels: np.ndarray, _outputs: list[np.ndarray]) -> list[tuple[int, ...]]:
    arr = np.asarray(labels)
    if arr.dtype.kind in "iu":
        return [tuple(int(v) for v in row if v >= 0) for row in arr.reshape(len(arr), -1)]
    if arr.dtype.kind != "U" or opts.chars is None:
        raise DataError("metric ctc: labels are an integer array [S, L] padded with -1, or strings with "
                        "ctc(chars=FILE) naming the recognizer's character list.")
    path = Path(opts.chars)
    if not path.is_file():
        raise DataError(f"metric ctc: chars={opts.chars}: no such file (one character per line).")
    first = 1 if opts.blank == 0 else 0
    index = {c: i + first for i, c in enumerate(path.read_text(encoding="utf-8").splitlines())}
    missing = sorted({c for s in arr.ravel() for c in str(s) if c not in index})
    if missing:
        raise DataError(f"metric ctc: label characters {missing[:10]} are not in {path}.")
    return [tuple(index[c] for c in str(s)) for s in arr.ravel()]


def _ctc_counts(_opts: CtcOptions, got: list[tuple[int, ...]], truth: list[tuple[int, ...]]) -> np.ndarray:
    """Per string: 1 (the sample), exact match, edit distance and the truth's length, ``[S, 4]``."""
    if len(got) != len(truth):
        raise DataError(f"metric ctc: {len(got)} sample(s) scored against {len(truth)} truth string(s).")
    rows = [(1, g == t, edit_distance(g, t), len(t)) for g, t in zip(got, truth, strict=True)]
    return np.array(rows, np.float64).reshape(-1, 4)


def _pooled_ctc(sums: np.ndarray) -> dict[str, np.ndarray]:
    """Exact-match share and CER from summed `_ctc_counts` (1.0 exact for no sample; CER 1 or 0 when no truth
    has characters, by whether any edit is needed)."""
    n, exact, errors, total = (np.asarray(sums, np.float64)[..., i] for i in range(4))
    with np.errstate(divide="ignore", invalid="ignore"):
        return {"exact": np.where(n > 0, exact / np.where(n > 0, n, 1.0), 1.0),
                "cer": np.where(total > 0, errors / np.where(total > 0, total, 1.0), (errors > 0) * 1.0)}


def _compare_ctc(opts: CtcOptions, got: list[tuple[int, ...]], truth: list[tuple[int, ...]], _want: str | None
                 ) -> dict[str, float]:
    return {k: float(v) for k, v in _pooled_ctc(_ctc_counts(opts, got, truth).sum(axis=0)).items()}


CTC = Family("ctc", {"exact": True, "cer": False}, "exact", CtcOptions, _decode_ctc, _compare_ctc,
             from_labels=_ctc_labels, counts=_ctc_counts, pooled=_pooled_ctc, failures=((0.0, -1.0, 1.0, 0.0),),
             pooled_fields=("exact", "cer"),
             summary="greedy CTC strings vs the reference's or labels: exact match, CER")
