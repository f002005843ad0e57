"""Built-in task metrics: a model judged by what its user sees (detections, text boxes, strings, classes).

Named by text wherever a metric is (``--metric`` of ``check``, ``diff``, ``run --report``, ``sensitivity``; a
target ``detection.f1:0.98`` of the fallback search): ``NAME[.FIELD][(OPTION=VALUE, ...)]``
(`qgraph.metrics.spec`). Each is called like a user metric, ``metric(outputs, truth) -> float``, where
``outputs[i]`` is model output ``i`` over every sample (axis 0) and ``truth`` the reference's outputs in the same
layout or the labels. The formulas are in ``docs/metrics.md`` and in each family's module.

Pure numpy; the reference's decoded truth is kept between calls with the same reference arrays, so a fallback
search that scores hundreds of candidates against one reference decodes it once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError

from qgraph.errors import DataError, QGraphError
from qgraph.metrics.basic import COSINE, SQNR, TOP1, TOPK
from qgraph.metrics.detection import FAMILY as DETECTION
from qgraph.metrics.family import Family
from qgraph.metrics.interval import Interval, bootstrap, samples_to_show
from qgraph.metrics.spec import MetricSpec, looks_builtin, parse_spec
from qgraph.metrics.text import CTC, TEXT_BOXES

#: Every built-in family by name.
FAMILIES: dict[str, Family] = {f.name: f for f in (DETECTION, TEXT_BOXES, CTC, TOP1, TOPK, COSINE, SQNR)}

__all__ = ["FAMILIES", "BuiltinMetric", "Interval", "MetricSpec", "builtin_metric", "is_builtin"]


def is_builtin(text: str) -> bool:
    """Whether ``text`` names a built-in metric (its family is known; options are checked by `builtin_metric`)."""
    if not looks_builtin(text):
        return False
    name = text.strip().split("(", 1)[0].split(".", 1)[0].strip()
    return name in FAMILIES


@dataclass
class BuiltinMetric:
    """A built-in metric bound to its field and options; call it as ``metric(outputs, truth)``."""

    spec: MetricSpec
    family: Family
    field: str
    options: Any
    _cache: tuple[list[np.ndarray], Any] | None = dataclasses.field(default=None, repr=False)

    @property
    def text(self) -> str:
        """The metric as written."""
        return self.spec.text

    @property
    def higher_is_better(self) -> bool:
        """Direction of the field (``ctc.cer`` is an error: lower is better)."""
        return self.family.fields[self.field]

    @property
    def labels_per_sample(self) -> bool:
        """False when labels are one table for every sample (detection boxes): never cut per row."""
        return self.family.labels_per_sample

    def truth(self, outputs: list[np.ndarray], target: Any) -> Any:
        """The truth: decoded reference outputs (kept while the same arrays come back) or the labels."""
        if isinstance(target, np.ndarray):
            return self.family.truth_from_labels(self.options, target, outputs)
        refs = [np.asarray(t) for t in target]
        cached = self._cache
        if cached is not None and len(cached[0]) == len(refs) and all(a is b for a, b in zip(cached[0], refs,
                                                                                               strict=True)):
            return cached[1]
        decoded = self.family.truth_of(self.options, refs)
        self._cache = (list(target) if all(isinstance(t, np.ndarray) for t in target) else refs, decoded)
        return decoded

    def scores(self, outputs: list[np.ndarray], target: Any, want: str | None = None) -> dict[str, float]:
        """Every field of the family (or at least ``want``) on ``outputs`` against ``target``."""
        got = self.family.decode(self.options, [np.asarray(o) for o in outputs])
        return self.family.compare(self.options, got, self.truth(outputs, target), want)

    def __call__(self, outputs: list[np.ndarray], target: Any) -> float:
        return float(self.scores(outputs, target, self.field)[self.field])

    @property
    def pools_counts(self) -> bool:
        """Whether the field is a ratio of per-sample counts (so it has an interval): not mAP, cosine or SQNR."""
        return self.family.counts is not None and self.field in self.family.pooled_fields

    def interval(self, outputs: list[np.ndarray], target: Any, level: float = 0.95) -> Interval | None:
        """The bootstrap interval of the score over the samples (`qgraph.metrics.interval`); None for a field that
        pools no per-sample counts (mAP, cosine, SQNR), for the reference against itself, or when the family's rows
        are not the samples (a top-1 over ``[S, T, C]`` outputs scores S x T rows)."""
        if not self._has_interval(outputs, target):
            return None
        got = self.family.decode(self.options, [np.asarray(o) for o in outputs])
        return self._spread(outputs, got, self.truth(outputs, target), level)

    def score_with_interval(self, outputs: list[np.ndarray], target: Any, level: float = 0.95
                            ) -> tuple[float, Interval | None]:
        """The score (``metric(outputs, target)``) and its `interval`, the outputs decoded once."""
        got = self.family.decode(self.options, [np.asarray(o) for o in outputs])
        truth = self.truth(outputs, target)
        value = float(self.family.compare(self.options, got, truth, self.field)[self.field])
        spread = self._spread(outputs, got, truth, level) if self._has_interval(outputs, target) else None
        return value, spread

    def _has_interval(self, outputs: list[np.ndarray], target: Any) -> bool:
        same = not isinstance(target, np.ndarray) and all(a is b for a, b in zip(outputs, target, strict=False))
        return self.pools_counts and bool(outputs) and not same  # the reference against itself: nothing to sample

    def _spread(self, outputs: list[np.ndarray], got: Any, truth: Any, level: float) -> Interval | None:
        family = self.family
        assert family.counts is not None and family.pooled is not None
        counts = family.counts(self.options, got, truth)
        if len(counts) != int(np.shape(outputs[0])[0]):
            return None
        return bootstrap(counts, family.pooled, self.field, level, failures=family.failures,
                         higher_is_better=self.higher_is_better)

    def agreement_bound(self, refs: list[np.ndarray], threshold: float) -> tuple[int, float, int | None] | None:
        """What these samples can show: their count, the worse end of the 95 % interval of a model that agrees
        with ``refs`` everywhere, and the samples of this kind that would put it at ``threshold`` (None: these do;
        0: none would). None for a field with no interval (`interval`)."""
        family = self.family
        if not self.pools_counts or family.counts is None or family.pooled is None or not refs:
            return None
        truth = self.truth(refs, refs)  # counts of the truth against itself: a model that agrees everywhere
        counts = family.counts(self.options, truth, truth)
        end, needed = samples_to_show(counts, family.pooled, self.field, threshold, family.failures,
                                      self.higher_is_better)
        return len(counts), end, needed


def builtin_metric(text: str, error: type[QGraphError] = DataError) -> BuiltinMetric:
    """The built-in metric ``text`` names; a wrong family, field or option raises ``error`` saying what exists."""
    spec = parse_spec(text, error)
    family = FAMILIES.get(spec.name)
    if family is None:
        raise error(f"metric {text!r}: no built-in metric {spec.name!r}; built-ins: {', '.join(FAMILIES)} "
                    "(or give a user metric as module:function).")
    fld = spec.field or family.default
    if fld not in family.fields:
        raise error(f"metric {text!r}: {family.name} has no field {fld!r}; its fields: "
                    f"{', '.join(family.fields)}.")
    try:
        options = family.options(**spec.options)
    except ValidationError as exc:
        known = ", ".join(family.options.model_fields)
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise error(f"metric {text!r}: {problems}. Options of {family.name}: {known}.") from None
    return BuiltinMetric(spec, family, fld, options)
