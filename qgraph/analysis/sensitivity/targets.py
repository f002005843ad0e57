"""Accuracy targets for automatic fallback: output cosine, output SQNR, or a user metric with a goal.

Syntax (``--target`` on the command line, ``auto.target`` in a recipe):

- ``cosine:0.99``: the smallest cosine similarity over the model's outputs (each output's samples taken as
  one vector, against the float model) must be at least 0.99;
- ``sqnr:30``: the smallest output SQNR, ``10 log10(sum r² / sum (c - r)²)``, must be at least 30 dB;
- both score each part of an output that a final Concat joins from different tensors (boxes and class scores)
  on its own, the worst part deciding (`qgraph.runtime.output_parts`; the whole output's SQNR is never below the worst
  part's, so this only makes targets stricter);
- a built-in task metric (`qgraph.metrics`, ``docs/metrics.md``) with a goal: ``detection.f1:0.98``,
  ``text_boxes(thresh=0.3):0.99``, ``ctc.cer:0.01`` (the metric's own direction: at most 0.01 for an error rate),
  or with ``>=``/``<=`` and a relative goal as below (``ctc.exact>=float-1%``);
- ``package.module:function>=GOAL`` or ``...<=GOAL`` for a user metric, higher-is-better with ``>=`` and
  lower-is-better with ``<=``. ``GOAL`` is an absolute value (``>=0.97``), an offset from the float model's
  score (``>=float-0.005``) or a percentage of it (``>=float-0.5%`` means at least 99.5% of the float score;
  ``<=float+1%`` at most 101% of it).

The metric is called as ``function(outputs, references) -> float`` where ``outputs[i]`` is the model's
``i``-th output over every evaluation sample, concatenated along axis 0, and ``references`` the float model's
outputs in the same layout. It is also evaluated on the float model (``function(references, references)``)
to get the float score that relative goals refer to. Labels and other side data are the function's business:
a top-1 metric loads its labels at import time and compares them with ``argmax(outputs[0], axis=1)``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from qgraph.data import import_callable, user_code
from qgraph.errors import RecipeError
from qgraph.metrics import BuiltinMetric, Interval, builtin_metric, is_builtin
from qgraph.runtime.compare import TensorDiff

Metric = Callable[[list[np.ndarray], list[np.ndarray]], float]
_GOAL = re.compile(r"^(?P<spec>[^<>=\s]+)\s*(?P<rel>>=|<=)\s*(?P<goal>.+)$")
_BUILTIN_GOAL = re.compile(r"^(?P<spec>[^<>]+?)\s*(?:(?P<rel>>=|<=)|:)\s*(?P<goal>[^<>=:()]+)$")
_RELATIVE = re.compile(r"^float\s*(?P<sign>[+-])\s*(?P<num>[0-9.eE+-]+)\s*(?P<pct>%?)$")


@dataclass(frozen=True)
class Target:
    """A parsed target: what is scored, how the threshold is found, and which direction is better."""

    text: str
    kind: str  # "cosine" | "sqnr" | "metric"
    higher_is_better: bool = True
    goal: float = 0.0  # absolute goal, or the offset/percentage of a relative goal
    relative: str | None = None  # None (absolute), "offset" or "percent"
    metric_spec: str | None = None
    metric: Metric | None = None
    #: cosine/sqnr: score only these graph outputs (empty: every output), e.g. a recurrent model's prediction
    #: without its state.
    outputs: tuple[str, ...] = ()

    @property
    def needs_outputs(self) -> bool:
        """Whether scoring needs the raw outputs (user metrics) rather than the diff statistics."""
        return self.kind == "metric"

    @property
    def unit(self) -> str:
        """Unit of the score for display."""
        return {"cosine": "cosine", "sqnr": "dB"}.get(self.kind, self.metric_spec or "metric")

    def score(
        self, diffs: Sequence[TensorDiff], outputs: list[np.ndarray] | None, refs: list[np.ndarray] | None
    ) -> float:
        """The score of one model from its output diffs (or outputs, for user metrics).

        ``diffs`` are the scored parts of the outputs (`qgraph.runtime.output_parts`: each part of an output a final
        Concat joins, else the whole output; `Measurement.scored`), so a cosine/sqnr score is the minimum over the
        parts of every (selected) output; ``outputs`` selects by graph output, each with all its parts."""
        if self.outputs:
            diffs = [d for d in diffs if d.output in self.outputs]
        if self.kind == "cosine":
            return min((d.cosine for d in diffs), default=1.0)
        if self.kind == "sqnr":
            return min((d.sqnr_db for d in diffs), default=math.inf)
        assert outputs is not None and refs is not None
        return call_metric(self, outputs, refs)

    def threshold(self, float_score: float) -> float:
        """The score a model must reach, given the float model's score."""
        if self.relative == "offset":
            return float_score + self.goal
        if self.relative == "percent":
            return float_score + abs(float_score) * self.goal / 100.0
        return self.goal

    def met(self, score: float, threshold: float) -> bool:
        """Whether ``score`` reaches ``threshold`` (NaN never does)."""
        if math.isnan(score):
            return False
        return score >= threshold if self.higher_is_better else score <= threshold

    def gain(self, score: float, baseline: float) -> float:
        """How much better ``score`` is than ``baseline`` (positive = better), for ranking."""
        if math.isnan(score) or math.isnan(baseline):
            return -math.inf
        if math.isinf(score) and math.isinf(baseline) and (score > 0) == (baseline > 0):
            return 0.0
        return score - baseline if self.higher_is_better else baseline - score

    def interval(self, outputs: list[np.ndarray] | None, refs: list[np.ndarray] | None) -> Interval | None:
        """The bootstrap interval of a built-in metric's score over the evaluation samples
        (`qgraph.metrics.interval`); None for cosine/sqnr targets, user metrics and fields without one (mAP)."""
        if not isinstance(self.metric, BuiltinMetric) or outputs is None or refs is None:
            return None
        return self.metric.interval(outputs, refs)

    def data_limit(self, refs: list[np.ndarray] | None, threshold: float) -> str | None:
        """A sentence when these evaluation samples cannot show the target met: even a model that agrees with the
        reference everywhere has a 95 % interval reaching past ``threshold`` (the rule of three,
        `qgraph.metrics.interval`), with how many samples of this kind could. None when they can, or no interval."""
        if not isinstance(self.metric, BuiltinMetric) or refs is None:
            return None
        shown = self.metric.agreement_bound(refs, threshold)
        if shown is None or shown[2] is None:
            return None
        samples, end, needed = shown
        more = (f"about {needed} samples of this kind would (auto.data)" if needed else
                "no number of samples would: the threshold is the score's best value")
        return (f"on these {samples} samples even a model that agrees with the reference everywhere has a 95% "
                f"interval reaching {end:.4f} (the rule of three), past the threshold {threshold:.6g}: meeting the "
                f"target here does not show that it holds on other samples of this kind; {more}")

    def describe(self) -> str:
        """Human-readable form, e.g. ``cosine >= 0.99``."""
        rel = ">=" if self.higher_is_better else "<="
        name = (self.metric_spec or "metric") if self.kind == "metric" else self.kind
        if self.outputs:
            name += f" of {', '.join(self.outputs)}"
        if self.relative == "offset":
            return f"{name} {rel} float{self.goal:+g}"
        if self.relative == "percent":
            return f"{name} {rel} float{self.goal:+g}%"
        return f"{name} {rel} {self.goal:g}"


def parse_target(text: str, *, load: bool = True, metric: Metric | None = None) -> Target:
    """Parse ``text`` (see module docs); with ``load`` import the user metric now (errors name the fix)."""
    raw = text.strip()
    kind, _, rest = raw.partition(":")
    if kind in ("cosine", "sqnr") and rest and not any(c in rest for c in "<>="):
        goal = _finite(rest, raw)
        if kind == "cosine" and not -1.0 <= goal <= 1.0:
            raise _bad(raw, "a cosine goal lies in [-1, 1]")
        return Target(raw, kind, goal=goal)
    b = _BUILTIN_GOAL.match(raw)
    if b is not None and is_builtin(b["spec"]):
        return _builtin_target(raw, b["spec"].strip(), b["rel"], b["goal"].strip())
    m = _GOAL.match(raw)
    if m is None or ":" not in m["spec"]:
        raise _bad(raw, "expected cosine:GOAL, sqnr:GOAL_DB or module:function>=GOAL / <=GOAL")
    goal, relative = _goal(raw, m["goal"].strip())
    fn = metric if metric is not None else (load_metric(m["spec"]) if load else None)
    return Target(raw, "metric", m["rel"] == ">=", goal, relative, m["spec"], fn)


def _builtin_target(raw: str, spec: str, rel: str | None, goal_text: str) -> Target:
    """A target on a built-in metric: ``NAME:GOAL`` takes the metric's direction; ``>=``/``<=`` must agree."""
    fn = builtin_metric(spec, RecipeError)
    if rel is not None and (rel == ">=") != fn.higher_is_better:
        better = "higher" if fn.higher_is_better else "lower"
        raise _bad(raw, f"{spec} is {better}-is-better: write {'>=' if fn.higher_is_better else '<='} "
                   f"(or {spec}:GOAL)")
    goal, relative = _goal(raw, goal_text)
    return Target(raw, "metric", fn.higher_is_better, goal, relative, spec, fn)


def _goal(raw: str, goal_text: str) -> tuple[float, str | None]:
    """An absolute goal, or the offset / percentage of ``float±X`` / ``float±X%``."""
    rel_m = _RELATIVE.match(goal_text)
    if rel_m is not None:
        sign = -1.0 if rel_m["sign"] == "-" else 1.0
        return sign * _finite(rel_m["num"], raw), "percent" if rel_m["pct"] else "offset"
    return _finite(goal_text, raw, "neither a number nor float±X / float±X%"), None


def _finite(text: str, raw: str, expected: str = "not a number") -> float:
    """The goal number in ``text``; NaN and inf are refused (a search towards NaN would run to the end and meet
    nothing)."""
    try:
        value = float(text)
    except ValueError:
        raise _bad(raw, f"{text!r} is {expected}") from None
    if not math.isfinite(value):
        raise _bad(raw, f"the goal {text!r} is not a finite number")
    return value


def _bad(text: str, why: str) -> RecipeError:
    return RecipeError(
        f"invalid target {text!r}: {why}. Examples: cosine:0.99, sqnr:30, detection.f1:0.98 (a built-in task "
        "metric, docs/metrics.md), mypkg.metrics:top1>=float-0.5% (a user metric within 0.5% of the float model)."
    )


def load_metric(spec: str) -> Metric:
    """The built-in metric ``spec`` names, else import ``module:function`` (the current directory is importable,
    as for data sources)."""
    if is_builtin(spec):
        return builtin_metric(spec, RecipeError)
    return import_callable(spec, RecipeError, "target metric")


def per_sample_labels(metric: Metric | None) -> bool:
    """Whether ``metric`` takes one label per sample (cut to the scored rows) rather than one table (detection)."""
    return not isinstance(metric, BuiltinMetric) or metric.labels_per_sample


def call_metric(target: Target, outputs: list[np.ndarray], refs: list[np.ndarray]) -> float:
    """Evaluate the user metric, turning its failures into a `RecipeError` naming it."""
    fn = target.metric if target.metric is not None else load_metric(target.metric_spec or "")
    with user_code(f"target metric {target.metric_spec!r}", "the metric", RecipeError, should="It is called as "
                   "function(outputs, references) with one array per model output (samples concatenated on axis 0) "
                   "and returns a float."):
        value = float(fn(outputs, refs))
    return value
