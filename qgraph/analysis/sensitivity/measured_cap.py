"""``max_latency`` held as measured: the search's prefix cut back until onnxruntime times it within the bound.

The search bounds the *modelled* latency (the cost table prices each node alone). On a real model the float nodes
and their Q/DQ boundaries can cost more than the table says: on YOLOv8n the 144 nodes chosen under
``max_latency: 0.9`` were modelled at 0.63x float and timed at 0.85-0.97x. So after the search, when the chosen
prefix is timed over the bound, the largest prefix that is timed within it is found by bisection over the prefix
length (more nodes in float never make a model faster by much, so the timing is treated as monotone in the length;
a few timings of a few seconds each, never one per node).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import onnx

from qgraph.analysis.sensitivity.cost import measure_latency
from qgraph.analysis.sensitivity.evaluate import Evaluator, first_sample

__all__ = ["MeasuredCap", "cap_by_measurement", "hold_measured_bound"]


@dataclass
class MeasuredCap:
    """The prefix length kept and every timing taken: ``(length, ratio to float)`` in the order taken."""

    size: int
    bound: float
    timings: list[tuple[int, float]] = field(default_factory=list)

    @property
    def trimmed(self) -> bool:
        """Whether the chosen prefix was cut back (its first timing was over the bound)."""
        return bool(self.timings) and self.timings[0][1] > self.bound

    def reason(self, searched: int) -> str:
        """The search's stop reason when it was cut back from ``searched`` nodes."""
        shown = ", ".join(f"{n} node(s) {r:.2f}x" for n, r in self.timings)
        return (f"max_latency reached as measured: {searched} node(s) in float met the search's modelled bound but "
                f"onnxruntime timed them over {self.bound:g}x float on this machine; kept the {self.size} whose "
                f"timing is within it (timed: {shown})")


def cap_by_measurement(size: int, bound: float, timed: Callable[[int], float], resolution: int | None = None,
                       has_time: Callable[[], bool] = lambda: True) -> MeasuredCap:
    """The largest prefix length ``m <= size`` whose ``timed(m)`` (latency relative to float) is at most ``bound``.

    ``timed(size)`` is taken first; within the bound, nothing changes. Otherwise bisection between 0 (the INT8
    model, taken to be within the bound) and ``size``, stopping when the interval is ``resolution`` long (default:
    ``size // 32``, at least 1: about five timings) or ``has_time()`` says the budget is spent; the lower end is
    kept, so what is kept was timed within the bound (or is the INT8 model)."""
    cap = MeasuredCap(size, bound)
    if size <= 0:
        return cap
    first = timed(size)
    cap.timings.append((size, first))
    if first <= bound:
        return cap
    lo, hi = 0, size
    step = max(1, resolution if resolution is not None else size // 32)
    while hi - lo > step and has_time():
        mid = (lo + hi) // 2
        ratio = timed(mid)
        cap.timings.append((mid, ratio))
        lo, hi = (mid, hi) if ratio <= bound else (lo, mid)
    cap.size = lo
    return cap


def hold_measured_bound(size: int, reason: str, bound: float, rounds: int, reference: onnx.ModelProto,
                        evaluator: Evaluator, base: Sequence[str], order: Sequence[str],
                        has_time: Callable[[], bool], notes: list[str]) -> tuple[int, str]:
    """The search's ``(size, stop reason)`` with the prefix cut back until it is timed within ``bound`` (each
    timing ``rounds`` rounds against ``reference`` on the first evaluation sample); a cut is also a note."""
    feed = first_sample(evaluator.batches[0], reference)

    def timed(m: int) -> float:  # ``base`` and the first ``m`` nodes of ``order`` in float, against float
        chosen = evaluator.variant([*base, *order[:m]])
        return measure_latency({"float": reference, "chosen": chosen}, feed, rounds)["chosen"]

    capped = cap_by_measurement(size, bound, timed, has_time=has_time)
    if not capped.trimmed:
        return size, reason
    notes.append(capped.reason(size))
    return capped.size, capped.reason(size)
