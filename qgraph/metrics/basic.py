"""``top1``, ``topk``, ``cosine`` and ``sqnr``.

``top1``: share of samples whose arg-max class (last axis of output ``output``, trailing singleton axes dropped)
equals the reference's (or the label). ``topk``: share whose reference arg-max (or label) is among the ``k``
highest candidate scores.

``cosine`` and ``sqnr``: per output slice, against the reference outputs; the field is the lowest over every
output (``outputs=0/2`` to choose) and slice. ``split=4/8`` cuts each output along ``axis`` (default 1) at those
indices (a YOLO head: ``split=4`` for boxes and scores). ``cosine = Σ r c / (|r| |c|)`` over the slice's values;
``sqnr = 10 log10(Σ r² / Σ (c - r)²)`` dB (inf when equal).
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import Field

from qgraph.errors import DataError
from qgraph.metrics.family import Family, MetricOptions, output, split_list


class ClassOptions(MetricOptions):
    """Options of ``top1`` and ``topk``."""

    output: int = 0
    k: int = Field(5, ge=1, description="topk: how many of the highest scores count")


def _scores(opts: ClassOptions, outputs: list[np.ndarray], name: str) -> np.ndarray:
    arr = output(outputs, opts.output, name)
    while arr.ndim > 2 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim < 2:
        raise DataError(f"metric {name}: output {opts.output} shaped {list(arr.shape)}; expected class scores "
                        "[S, C].")
    return arr.reshape(-1, arr.shape[-1])


def _argmax(opts: ClassOptions, outputs: list[np.ndarray]) -> np.ndarray:
    return np.asarray(_scores(opts, outputs, "top1").argmax(axis=1))


def _topk(opts: ClassOptions, outputs: list[np.ndarray]) -> np.ndarray:
    s = _scores(opts, outputs, "topk")
    k = min(opts.k, s.shape[1])
    return np.asarray(np.argpartition(-s, k - 1, axis=1)[:, :k])


def _class_labels(_opts: ClassOptions, labels: np.ndarray, _outputs: list[np.ndarray]) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim == 2 and arr.shape[1] > 1:  # one-hot or scores
        return np.asarray(arr.argmax(axis=1))
    return arr.reshape(-1).astype(np.int64)


def _compare_top1(_opts: ClassOptions, got: np.ndarray, truth: np.ndarray, _want: str | None) -> dict[str, float]:
    if len(got) != len(truth):
        raise DataError(f"metric top1: {len(got)} row(s) scored against {len(truth)}.")
    return {"agreement": float(np.mean(got == truth)) if len(got) else 1.0}


def _compare_topk(_opts: ClassOptions, got: np.ndarray, truth: np.ndarray, _want: str | None) -> dict[str, float]:
    if len(got) != len(truth):
        raise DataError(f"metric topk: {len(got)} row(s) scored against {len(truth)}.")
    return {"agreement": float(np.mean(np.any(got == truth[:, None], axis=1))) if len(got) else 1.0}


def _hits(got: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Per row: 1 (the row) and whether it agrees, ``[rows, 2]`` (top-1: the classes; top-k: ``got`` [rows, k])."""
    hit = got == truth if got.ndim == 1 else np.any(got == truth[:, None], axis=1)
    return np.stack([np.ones(len(hit)), hit.astype(np.float64)], axis=1)


def _row_counts(_opts: ClassOptions, got: np.ndarray, truth: np.ndarray) -> np.ndarray:
    if len(got) != len(truth):
        raise DataError(f"metric top1/topk: {len(got)} row(s) scored against {len(truth)}.")
    return _hits(np.asarray(got), np.asarray(truth))


def _pooled_agreement(sums: np.ndarray) -> dict[str, np.ndarray]:
    n, hits = np.asarray(sums, np.float64)[..., 0], np.asarray(sums, np.float64)[..., 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        return {"agreement": np.where(n > 0, hits / np.where(n > 0, n, 1.0), 1.0)}


TOP1 = Family("top1", {"agreement": True}, "agreement", ClassOptions, _argmax, _compare_top1,
              from_labels=_class_labels, summary="arg-max class equal to the reference's (or the label)",
              counts=_row_counts, pooled=_pooled_agreement, failures=((0.0, -1.0),),
              pooled_fields=("agreement",))
TOPK = Family("topk", {"agreement": True}, "agreement", ClassOptions, _topk, _compare_topk, truth=_argmax,
              from_labels=_class_labels, summary="reference's class (or the label) among the k highest scores",
              counts=_row_counts, pooled=_pooled_agreement, failures=((0.0, -1.0),),
              pooled_fields=("agreement",))


class SliceOptions(MetricOptions):
    """Options of ``cosine`` and ``sqnr``."""

    outputs: str | None = Field(None, description="'/'-joined output indices (default: every output)")
    split: str | None = Field(None, description="'/'-joined indices to cut each output at along axis")
    axis: int = 1


def slices(opts: SliceOptions, outputs: list[np.ndarray]) -> list[np.ndarray]:
    """Every scored slice, float64 (see module docs)."""
    chosen = split_list(opts.outputs, "outputs") if opts.outputs else list(range(len(outputs)))
    cuts = split_list(opts.split, "split") if opts.split else []
    out = []
    for i in chosen:
        arr = output(outputs, i, "cosine/sqnr").astype(np.float64)
        if cuts and -arr.ndim <= opts.axis < arr.ndim:
            out += [p for p in np.split(arr, cuts, axis=opts.axis) if p.size]
        else:
            out.append(arr)
    return out


def _compare_cosine(_opts: SliceOptions, got: list[np.ndarray], truth: list[np.ndarray], _want: str | None
                    ) -> dict[str, float]:
    values = []
    for c, r in zip(got, truth, strict=True):
        norm = float(np.linalg.norm(c) * np.linalg.norm(r))
        values.append(float(np.sum(c * r)) / norm if norm else float(np.array_equal(c, r)))
    return {"min": min(values, default=1.0)}


def _compare_sqnr(_opts: SliceOptions, got: list[np.ndarray], truth: list[np.ndarray], _want: str | None
                  ) -> dict[str, float]:
    values = []
    for c, r in zip(got, truth, strict=True):
        noise, signal = float(np.sum((c - r) ** 2)), float(np.sum(r ** 2))
        values.append(math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal else -math.inf))
    return {"min": min(values, default=math.inf)}


COSINE = Family("cosine", {"min": True}, "min", SliceOptions, slices, _compare_cosine,
                summary="lowest cosine over output slices vs the reference")
SQNR = Family("sqnr", {"min": True}, "min", SliceOptions, slices, _compare_sqnr,
              summary="lowest SQNR (dB) over output slices vs the reference")
