"""What every built-in metric family provides: its options, its fields, decoding and comparing.

A family turns a model's outputs into what a user judges (detections, text boxes, strings, classes) with
``decode``, the reference's outputs or the labels into the truth with ``truth`` / ``from_labels``, and
``compare`` scores the first against the second, giving every field it knows (``f1``, ``precision``, ...).

A family whose fields pool additive per-sample counts (true positives, predictions, exact strings, edits, ...) also
gives ``counts`` (one row of counts per sample) and ``pooled`` (the fields from summed counts, vectorised): the
sampling interval of its score (`qgraph.metrics.interval`) resamples those rows instead of re-running ``compare``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from qgraph.errors import DataError


class MetricOptions(BaseModel):
    """Base of a family's options: frozen, unknown keys are errors (the message lists the known ones)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


Decode = Callable[[Any, list[np.ndarray]], Any]
Compare = Callable[[Any, Any, Any, "str | None"], dict[str, float]]
#: ``(options, got, truth) -> counts [S, k]``: additive counts per sample
Counts = Callable[[Any, Any, Any], np.ndarray]
#: ``sums [..., k] -> {field: values [...]}``: the fields from summed counts (the same formulas as ``compare``)
Pooled = Callable[[np.ndarray], dict[str, np.ndarray]]


def _no_labels(name: str) -> Callable[[Any, np.ndarray, list[np.ndarray]], Any]:
    def refuse(_opts: Any, _labels: np.ndarray, _outputs: list[np.ndarray]) -> Any:
        raise DataError(f"metric {name} compares with the reference model's outputs; it takes no --labels.")
    return refuse


@dataclass(frozen=True)
class Family:
    """One built-in metric family (see the module docs)."""

    name: str
    #: field -> whether higher is better
    fields: dict[str, bool]
    default: str
    options: type[MetricOptions]
    decode: Decode
    compare: Compare
    #: the truth from the reference model's outputs (default: ``decode``)
    truth: Decode | None = None
    #: the truth from labels ``(options, labels, outputs)``; None: labels are refused
    from_labels: Callable[[Any, np.ndarray, list[np.ndarray]], Any] | None = None
    #: False: the labels are one table for every sample (detection boxes), not one row per sample
    labels_per_sample: bool = True
    summary: str = ""
    #: per-sample counts and the fields they pool into (None: no sampling interval, e.g. cosine over whole arrays)
    counts: Counts | None = None
    pooled: Pooled | None = None
    #: how one failure of each kind changes a sample's counts (a lost and an extra detection; a misread line): the
    #: interval's bound when no sample differs (`qgraph.metrics.interval`, the rule of three)
    failures: tuple[tuple[float, ...], ...] = ()
    #: the fields ``pooled`` gives (the others, e.g. mAP, have no interval)
    pooled_fields: tuple[str, ...] = ()

    def truth_of(self, opts: Any, refs: list[np.ndarray]) -> Any:
        """The truth decoded from the reference outputs."""
        return (self.truth or self.decode)(opts, refs)

    def truth_from_labels(self, opts: Any, labels: np.ndarray, outputs: list[np.ndarray]) -> Any:
        """The truth read from labels (or a `DataError` when the family takes none)."""
        return (self.from_labels or _no_labels(self.name))(opts, labels, outputs)


def output(outputs: list[np.ndarray], index: int, metric: str) -> np.ndarray:
    """Output ``index`` (negative counts from the end), or a `DataError` naming the metric."""
    if not -len(outputs) <= index < len(outputs):
        raise DataError(f"metric {metric}: output={index}, but the model has {len(outputs)} output(s).")
    return np.asarray(outputs[index])


def split_list(text: str, what: str, cast: Callable[[str], Any] = int) -> list[Any]:
    """``8/16/32`` -> ``[8, 16, 32]`` (``ValueError`` naming ``what`` on a bad item)."""
    try:
        return [cast(t) for t in text.replace(",", "/").split("/") if t.strip()]
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected numbers joined with '/'") from None
