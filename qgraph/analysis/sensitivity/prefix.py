"""The prefix search of automatic fallback: its clock (deadline, stage timings, progress) and the search itself.

`PrefixSearch` evaluates ``P_m``, the first ``m`` ranked nodes in float, with full evaluations only. Proposals:
the noise model's predicted output noise ``η̂(m)`` is corrected on two measured prefixes by a line
``η(m) ≈ a · η̂(m) + c`` (``c``: noise no fallback removes, such as the error of weights stored as integers), and
the smallest ``m`` whose corrected prediction meets the target is tried next (a secant step). Without a prefix
that meets the target yet, an unusable correction means doubling; once one meets, a step that does not halve
the bracket ``(largest failing, smallest meeting)`` is followed by a bisection step. After the first
(predicted) step, a step never more than doubles the largest failing prefix, and the search stops when the
smallest meeting prefix ``m*`` is known to within ``m*/16`` nodes (one node for ``m* < 32``): ``O(log m*)``
evaluations in the worst case, two or three when the prediction is good.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from qgraph.analysis.sensitivity.evaluate import Evaluator, measure_all
from qgraph.analysis.sensitivity.probe import StepProgress
from qgraph.analysis.sensitivity.targets import Target
from qgraph.runtime.executor import Executor

#: The search stops when the smallest meeting prefix is known to within 1/TOLERANCE of its size (or one node).
TOLERANCE = 16

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


class Clock:
    """Deadline, per-stage timings, evaluation count and progress of one automatic fallback."""

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
        """Record the time since the previous stage ended as stage ``name``."""
        now = time.monotonic()
        self.stages[name] = now - self.mark
        self.mark = now

    def reporter(self, stage: str) -> StepProgress | None:
        """The ``(done, total)`` progress callback of ``stage`` (None when nobody listens)."""
        report = self.progress
        return None if report is None else (lambda done, total: report(stage, done, total))

    def time_left(self, evaluations: int) -> bool:
        """Whether ``evaluations`` more full evaluations (at the mean duration so far) end before the deadline."""
        if self.deadline is None:
            return True
        mean = sum(self.eval_seconds) / len(self.eval_seconds) if self.eval_seconds else 0.0
        return time.monotonic() + evaluations * mean <= self.deadline


class PrefixSearch:
    """Corrected-prediction (secant) steps, doubling and bisection over ranked prefix sizes (see module docs)."""

    def __init__(self, evaluator: Evaluator, target: Target, threshold: float, base: Sequence[str],
                 order: Sequence[str], cap: int, run: Clock, executor: Executor) -> None:
        self.evaluator, self.target, self.threshold = evaluator, target, threshold
        self.base, self.order, self.cap, self.clock = tuple(base), list(order), cap, run
        self.executor, self.jobs = executor, max(1, executor.workers)
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
        measured = measure_all(self.evaluator, sets, deadline=self.clock.deadline, executor=self.executor)
        for m, meas in zip(todo, measured, strict=False):
            score = self.target.score(meas.scored, meas.outputs, self.clock.refs)
            self.scores[m] = score
            self.steps.append(AutoStep(m, score, self.target.met(score, self.threshold), meas.seconds))
            self.clock.eval_seconds.append(meas.seconds)
            self.clock.evaluations += 1
            if report is not None:
                # total: the worst case of doubling then bisection (an estimate the bar's ETA can use)
                report(len(self.steps), max(len(self.steps), 2 * max(1, self.cap).bit_length()))
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
        top = (self.cap if lo == 0 else min(self.cap, 2 * lo)) if hi is None else hi - 1  # at most doubling
        m = next((k for k in range(lo + 1, top + 1) if pred[k] <= need), top)
        return max(lo + 1, min(m, top))

    def run(self, predicted: list[float], max_nodes: int | None) -> tuple[int, str]:
        """The chosen prefix size (0: none) and why the search stopped."""
        if self.cap == 0:
            return 0, f"max_nodes ({max_nodes}) reached" if max_nodes is not None else "no candidate to fall back"
        lo, hi = 0, None
        secant, width = True, self.cap + 1
        while hi is None or hi - lo > max(1, hi // TOLERANCE):
            if hi is None and lo >= self.cap:
                return self._best(), (f"max_nodes ({max_nodes}) reached" if self.cap < len(self.order)
                                      else "every candidate is in float" if self.evaluator.remedy == "float"
                                      else "every candidate has 16-bit activations")
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
