"""Automatic fallback: rank quantized nodes from one run, then search ranked prefixes in few full evaluations.

Stages (each timed, reported and shown as a progress bar):

1. **baseline**: score the float model (for relative goals) and the INT8 model (one full evaluation). If the
   INT8 model meets the target, stop.
2. **ranking**: one paired run ranks every candidate (`sensitivity.ranking.rank_nodes`), O(1) evaluations; the
   first ``exact_top`` are optionally measured exactly (one evaluation each).
3. **search** on prefixes ``P_m`` (the first ``m`` ranked nodes in float), full evaluations only:
   start at the smallest ``m`` the noise model predicts to meet the target (1 for user metrics), double ``m``
   (greedy in ranked batches) until a prefix meets the target or ``max_nodes`` / the candidates run out, then
   bisect between the largest prefix that failed and the smallest that met. ``jobs`` prefixes are evaluated
   per round. About ``2 log2(m*) + 1`` evaluations for a first meeting prefix ``m*``.
4. **confirmation**: the chosen model, built exactly as `qgraph run --patch` builds it, is evaluated once more;
   its score is the one reported.

``max_time`` is checked before every evaluation (an evaluation that would end after it is not started) and
between batches of the ranking run. The result is always the best model evaluated (the smallest prefix that
meets the target, else the highest score), with one sentence saying whether the target was met, what was tried
and how long each stage took; the decision is written as a recipe patch that `qgraph run --patch` applies to the
same QDQ model to reproduce the same graph.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from qgraph import ModelError, NodeSelector, Pipeline, Recipe, get_pass
from qgraph.data import DataSource, model_inputs
from qgraph.outputs import write_atomic
from qgraph.sensitivity.evaluate import (
    Evaluator,
    concat_outputs,
    load_feeds,
    measure_all,
    reference_outputs,
)
from qgraph.sensitivity.probe import StepProgress
from qgraph.sensitivity.ranking import SensitivityReport, candidate_nodes, rank_nodes
from qgraph.sensitivity.targets import Target, parse_target

PATCH_RECIPE_NAME = "float-fallback"


#: Progress of one stage: ``(stage, done, total or None)``; stages are "ranking", "exact", "search", "confirmation".
StageProgress = Callable[[str, int, int | None], None]


@dataclass
class AutoStep:
    """One full evaluation of the search: the first ``size`` ranked nodes in float, its score, target met."""

    size: int
    score: float
    met: bool
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "size": self.size,
            "score": self.score if math.isfinite(self.score) else str(self.score),
            "met": self.met,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class AutoResult:
    """The best model found, the nodes it keeps in float, and how it compares with the target."""

    model: onnx.ModelProto
    nodes: list[str]
    target: Target
    target_met: bool
    score: float
    threshold: float
    float_score: float
    int8_score: float
    stop_reason: str
    sensitivity: SensitivityReport | None
    steps: list[AutoStep] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # of one evaluation sample
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage
    evaluations: int = 0  # full model evaluations (baseline, exact measures, search, confirmation)

    def message(self) -> str:
        """One paragraph: met or not, scores, nodes, why the search stopped, what was tried and how long."""
        verdict = "target met" if self.target_met else "target NOT met"
        shown = self.nodes if len(self.nodes) <= 8 else [*self.nodes[:8], f"... {len(self.nodes) - 8} more"]
        return (
            f"{verdict}: {self.target.describe()} (threshold {self.threshold:.6g}); float {self.float_score:.6g}, "
            f"full INT8 {self.int8_score:.6g}, best {self.score:.6g} with {len(self.nodes)} node(s) in float"
            f"{': ' + ', '.join(shown) if shown else ''}. Search stopped: {self.stop_reason}. {self.tried()}"
        )

    def tried(self) -> str:
        """What was tried and how long each stage took, in one sentence."""
        parts = [f"baseline {self.stages.get('baseline', 0.0):.1f} s"]
        if self.sensitivity is not None:
            exact = sum(r.measured for r in self.sensitivity.rows) if self.sensitivity.method != "exact" else 0
            parts.append(f"ranking of {self.sensitivity.candidates} node(s) from one run"
                         f"{f' + {exact} exact' if exact else ''} {self.stages.get('ranking', 0.0):.1f} s")
        if self.steps:
            sizes = ", ".join(str(s.size) for s in self.steps)
            parts.append(f"search over ranked prefixes of {sizes} node(s) ({len(self.steps)} evaluation(s)) "
                         f"{self.stages.get('search', 0.0):.1f} s")
        if "confirmation" in self.stages:
            parts.append(f"confirmation {self.stages['confirmation']:.1f} s")
        return f"Tried: {'; '.join(parts)}; {self.evaluations} full evaluation(s) in {self.seconds:.1f} s."

    def recipe(self) -> Recipe | None:
        """The decision as a one-pass recipe (None when no node needs to go back to float)."""
        if not self.nodes:
            return None
        return _patch_recipe(self.nodes)

    def patch_yaml(self) -> str | None:
        """The recipe patch text (``name`` + ``passes``), commented with the outcome; None if no node."""
        recipe = self.recipe()
        if recipe is None:
            return None
        header = [
            "# float_fallback patch written by qgraph (automatic fallback).",
            f"# {'Target met' if self.target_met else 'Target NOT met'}: {self.target.describe()}; "
            f"best score {self.score:.6g} (float {self.float_score:.6g}, full INT8 {self.int8_score:.6g}).",
            "# Apply to the same QDQ model: qgraph run RECIPE MODEL --patch THIS_FILE -o OUT.onnx,",
            "# or paste the float_fallback entry at the end of the recipe's passes.",
        ]
        return "\n".join(header) + "\n" + recipe.to_yaml()

    def write_patch(self, path: str | Path) -> bool:
        """Write `patch_yaml` atomically; False (nothing written) when no node needs to go back to float."""
        text = self.patch_yaml()
        if text is None:
            return False
        write_atomic(path, text)
        return True

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (with the sensitivity table)."""

        def num(v: float) -> Any:
            return v if math.isfinite(v) else str(v)

        return {
            "target": self.target.describe(),
            "target_met": self.target_met,
            "threshold": num(self.threshold),
            "score": num(self.score),
            "float_score": num(self.float_score),
            "int8_score": num(self.int8_score),
            "nodes": self.nodes,
            "stop_reason": self.stop_reason,
            "stages": {k: round(v, 3) for k, v in self.stages.items()},
            "evaluations": self.evaluations,
            "steps": [s.to_dict() for s in self.steps],
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
            "sensitivity": self.sensitivity.to_dict() if self.sensitivity else None,
        }


def build_model(qdq: onnx.ModelProto, nodes: Sequence[str]) -> onnx.ModelProto:
    """``qdq`` with ``nodes`` in float, built exactly as `qgraph run PATCH qdq` would build it."""
    if not nodes:
        return qdq
    recipe = _patch_recipe(nodes)
    return Pipeline(recipe.passes, recipe=recipe).run(qdq).model


def _patch_recipe(nodes: Sequence[str]) -> Recipe:
    # The float_fallback pass is reached through the registry, as any plug-in would be.
    fallback = get_pass("float_fallback")
    return Recipe(PATCH_RECIPE_NAME, [fallback(nodes=NodeSelector(names=tuple(nodes)))])


def auto_fallback(
    reference: onnx.ModelProto,
    qdq: onnx.ModelProto,
    data: str | DataSource,
    target: Target | str,
    *,
    candidates: NodeSelector | None = None,
    keep_float: Sequence[str] = (),
    max_nodes: int | None = None,
    max_time: float | None = None,
    jobs: int = 1,
    samples: int | None = None,
    batch_size: int = 32,
    optimization: str = "all",
    progress: StageProgress | None = None,
    report_only: bool = False,
    exact_top: int = 0,
) -> AutoResult:
    """Find a small set of nodes to keep in float so that ``qdq`` meets ``target`` (see module docs).

    ``reference`` is the float model the outputs are compared with, ``data`` the evaluation data,
    ``keep_float`` nodes that are in float regardless (counted in ``max_nodes``), ``exact_top`` how many of the
    ranked nodes to measure exactly. With ``report_only`` the ranking is made and no search. Never raises for
    an unmet target: check ``target_met``.
    """
    run = _Run(time.monotonic(), max_time, progress)
    tgt = parse_target(target) if isinstance(target, str) else target
    ref_inputs, qdq_inputs = [i.name for i in model_inputs(reference)], [i.name for i in model_inputs(qdq)]
    if sorted(ref_inputs) != sorted(qdq_inputs) or len(reference.graph.output) != len(qdq.graph.output):
        raise ModelError(
            f"the float and QDQ models do not match: inputs {ref_inputs} vs {qdq_inputs}, "
            f"{len(reference.graph.output)} vs {len(qdq.graph.output)} outputs. Give the float model the QDQ "
            "model was made from."
        )
    batches = load_feeds(data, reference, samples=samples, batch_size=batch_size, others=[qdq])
    shapes = {k: (1, *v.shape[1:]) if v.ndim else () for k, v in batches[0].items()}
    refs_per_batch = reference_outputs(reference, batches, optimization)
    evaluator = Evaluator(qdq, batches, refs_per_batch, keep_outputs=tgt.needs_outputs, optimization=optimization)
    run.refs = concat_outputs(refs_per_batch) if tgt.needs_outputs else None
    float_score = tgt.score([], run.refs, run.refs)
    threshold = tgt.threshold(float_score)
    chosen = list(keep_float)
    base = evaluator.measure(chosen)
    run.evaluations, run.eval_seconds = 1, [base.seconds]
    int8_score = run.int8_score = tgt.score(base.diffs, base.outputs, run.refs)
    run.stage_end("baseline")
    found, notes = candidate_nodes(evaluator.variant(chosen), candidates)
    out = AutoResult(build_model(qdq, chosen), list(chosen), tgt, tgt.met(int8_score, threshold), int8_score,
                     threshold, float_score, int8_score, "", None, [], notes, 0.0, shapes)
    if out.target_met and not report_only:
        return run.finish(out, "the INT8 model already meets the target")
    report = rank_nodes(evaluator, tgt, found, base, base_nodes=chosen, exact_top=exact_top, jobs=jobs,
                        deadline=run.deadline, progress=run.reporter("ranking"), exact_progress=run.reporter("exact"),
                        stats=report_only)
    run.evaluations += sum(r.measured for r in report.rows)
    out.sensitivity = report
    notes.extend(report.notes)
    run.stage_end("ranking")
    if report_only:
        return run.finish(out, "report only")
    order = [r.name for r in report.rows]
    cap = len(order) if max_nodes is None else max(0, min(len(order), max_nodes - len(chosen)))
    predicted = report.model.prefix_scores(tgt, order[:cap]) if report.model is not None else []
    search = _PrefixSearch(evaluator, tgt, threshold, chosen, order, cap, run, jobs)
    size, reason = search.run(predicted, max_nodes)
    out.steps = search.steps
    run.stage_end("search")
    if size:
        out.nodes = [*chosen, *order[:size]]
        out.model = build_model(qdq, out.nodes)
        if run.time_left(1):
            confirmed = evaluator.run(out.model, out.nodes)
            run.evaluations += 1
            out.score = tgt.score(confirmed.diffs, confirmed.outputs, run.refs)
            run.stage_end("confirmation")
        else:
            out.score = search.scores[size]
            notes.append("not confirmed: max_time reached (the score is the search's evaluation of the same nodes)")
    out.target_met = tgt.met(out.score, threshold)
    return run.finish(out, "target met" if out.target_met else reason)


class _Run:
    """Clock, deadline, per-stage timings and progress of one automatic fallback."""

    def __init__(self, start: float, max_time: float | None, progress: StageProgress | None) -> None:
        self.start = self.mark = start
        self.max_time = max_time
        self.deadline = start + max_time if max_time is not None else None
        self.progress = progress
        self.stages: dict[str, float] = {}
        self.evaluations = 0
        self.eval_seconds: list[float] = []
        self.refs: list[Any] | None = None
        self.int8_score = math.nan

    def stage_end(self, name: str) -> None:
        now = time.monotonic()
        self.stages[name] = now - self.mark
        self.mark = now

    def reporter(self, stage: str) -> StepProgress | None:
        report = self.progress
        return None if report is None else (lambda done, total: report(stage, done, total))

    def time_left(self, evaluations: int) -> bool:
        """Whether ``evaluations`` more full evaluations (at the mean duration so far) end before the deadline."""
        if self.deadline is None:
            return True
        mean = sum(self.eval_seconds) / len(self.eval_seconds) if self.eval_seconds else 0.0
        return time.monotonic() + evaluations * mean <= self.deadline

    def finish(self, out: AutoResult, reason: str) -> AutoResult:
        out.stop_reason = reason
        out.seconds = time.monotonic() - self.start
        out.stages = dict(self.stages)
        out.evaluations = self.evaluations
        return out


class _PrefixSearch:
    """Corrected-prediction (secant) steps, doubling and bisection over ranked prefix sizes (see module docs)."""

    def __init__(self, evaluator: Evaluator, target: Target, threshold: float, base: Sequence[str],
                 order: Sequence[str], cap: int, run: _Run, jobs: int) -> None:
        self.evaluator, self.target, self.threshold = evaluator, target, threshold
        self.base, self.order, self.cap, self.clock, self.jobs = tuple(base), list(order), cap, run, jobs
        self.scores: dict[int, float] = {0: run.int8_score}
        self.steps: list[AutoStep] = []

    def _met(self, size: int) -> bool:
        return self.target.met(self.scores[size], self.threshold)

    def _evaluate(self, sizes: list[int]) -> bool:
        """Evaluate the prefixes of ``sizes`` not seen yet; False when out of time before any of them."""
        todo = sorted({m for m in sizes if m not in self.scores and 0 < m <= self.cap})
        if not todo:
            return True
        if not self.clock.time_left(-(-len(todo) // self.jobs)):
            return False
        report = self.clock.reporter("search")
        sets = [(*self.base, *self.order[:m]) for m in todo]
        measured = measure_all(self.evaluator, sets, jobs=self.jobs, deadline=self.clock.deadline)
        for m, meas in zip(todo, measured, strict=False):
            score = self.target.score(meas.diffs, meas.outputs, self.clock.refs)
            self.scores[m] = score
            self.steps.append(AutoStep(m, score, self.target.met(score, self.threshold), meas.seconds))
            self.clock.eval_seconds.append(meas.seconds)
            self.clock.evaluations += 1
            if report is not None:
                report(len(self.steps), None)
        return len(measured) == len(todo)

    def _eta(self, score: float) -> float:
        """Output noise ratio behind a score (SQNR or cosine); NaN for user metrics."""
        if self.target.kind == "sqnr":
            return 0.0 if score == math.inf else 10.0 ** (-score / 10.0)
        if self.target.kind == "cosine":
            return 1.0 / (score * score) - 1.0 if score > 0 else math.inf
        return math.nan

    def _propose(self, lo: int, hi: int | None, predicted: list[float], secant: bool) -> int:
        """Next prefix size: the noise model's prediction corrected on two measured prefixes, else
        doubling (no prefix met yet) or bisection."""
        fallback = min(self.cap, max(1, 2 * lo)) if hi is None else (lo + hi) // 2
        if not secant or len(predicted) <= self.cap or self.target.kind == "metric":
            return fallback
        pred = [self._eta(p) for p in predicted]
        m1, m2 = (lo, hi) if hi is not None else (0, lo)
        e1, e2 = self._eta(self.scores[m1]), self._eta(self.scores[m2])
        if m1 == m2 or pred[m1] == pred[m2]:
            a, c = (e1 / pred[m1] if pred[m1] > 0 else 1.0), 0.0
        else:  # measured = a · predicted + c through both points (c: noise no fallback removes)
            a = (e1 - e2) / (pred[m1] - pred[m2])
            c = e1 - a * pred[m1]
        if not (a > 0 and math.isfinite(a) and math.isfinite(c)):
            return fallback
        need = (self._eta(self.threshold) - c) / a
        top = self.cap if hi is None else hi - 1
        m = next((k for k in range(lo + 1, top + 1) if pred[k] <= need), top)
        return max(lo + 1, min(m, top))

    def run(self, predicted: list[float], max_nodes: int | None) -> tuple[int, str]:
        """The chosen prefix size (0: none) and why the search stopped."""
        if self.cap == 0:
            return 0, f"max_nodes ({max_nodes}) reached" if max_nodes is not None else "no candidate to fall back"
        lo, hi = 0, None
        secant, width = True, self.cap + 1
        while hi is None or hi - lo > 1:
            if hi is None and lo >= self.cap:
                return self._best(), (f"max_nodes ({max_nodes}) reached" if self.cap < len(self.order)
                                      else "every candidate is in float")
            first = self._propose(lo, hi, predicted, secant)
            if not self._evaluate([first, *self._spread(lo, hi, first)]):
                return self._best(), f"max_time ({self.clock.max_time:g} s) reached"
            met = sorted(m for m in self.scores if m and self._met(m))
            hi = met[0] if met else None
            lo = max((m for m in self.scores if not self._met(m) and (hi is None or m < hi)), default=0)
            new_width = (hi if hi is not None else self.cap + 1) - lo
            secant = new_width <= width // 2 or hi is None  # the correction keeps halving the bracket, else bisect
            width = new_width
        return self._best(), "target met"

    def _spread(self, lo: int, hi: int | None, first: int) -> list[int]:
        """With ``jobs`` > 1, the other prefixes evaluated in the same round: doubling or evenly in the bracket."""
        if self.jobs <= 1:
            return []
        if hi is None:
            return [min(self.cap, first << k) for k in range(1, self.jobs)]
        step = (hi - lo) / self.jobs
        return [lo + max(1, round(step * k)) for k in range(1, self.jobs)]

    def _best(self) -> int:
        met = [m for m in self.scores if m and self._met(m)]
        if met:
            return min(met)
        best = max(self.scores, key=lambda m: (self.target.gain(self.scores[m], self.scores[0]), -m))
        return best if self.target.gain(self.scores[best], self.scores[0]) > 0 else 0
