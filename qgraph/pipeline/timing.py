"""What each pass of a run costs, against the float model's calibration time.

Accuracy techniques (equalization, SmoothQuant, bias correction, rounding optimization, range tuning, fallback
search) cost time on top of the one pass over the calibration data that static quantization needs anyway; the
budget a demanding user can accept is a small multiple of it (issue #13: at most 10x). The quantizing pass reports
how long its data pass took (`PassResult.calibration_seconds`); `run_timing` puts every pass's time (the
quantizing pass's without its data pass) against that, and `Timing.line` is what the run summary and the report
print.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from qgraph.pipeline.pass_result import PassResult

#: The multiple of the calibration time a pass may take before the summary flags it.
BUDGET = 10.0
#: Passes under this multiple are counted, not named, in the summary line.
NEGLIGIBLE = 0.05
#: Passes named in the summary line at most.
SHOWN = 5


class _Record(Protocol):
    name: str
    seconds: float
    result: PassResult


@dataclass(frozen=True)
class PassTime:
    """One pass's seconds (the quantizing pass's without its data pass) and their multiple of the calibration."""

    name: str
    seconds: float
    ratio: float


@dataclass(frozen=True)
class Timing:
    """The calibration's seconds, which pass made it, and every pass against it (slowest first)."""

    calibration_seconds: float
    calibrated_by: str
    passes: tuple[PassTime, ...]

    @property
    def over_budget(self) -> list[PassTime]:
        """Passes that took more than `BUDGET` times the calibration."""
        return [p for p in self.passes if p.ratio > BUDGET]

    def line(self) -> str:
        """One sentence for the run summary and the report."""
        shown = [p for p in self.passes if p.ratio >= NEGLIGIBLE][:SHOWN]
        rest = len(self.passes) - len(shown)
        names = ", ".join(f"{p.name} {p.seconds:.1f} s ({p.ratio:.1f}x)" for p in shown) or "none"
        more = f" (+{rest} more, each {self.passes[len(shown)].ratio:.2f}x or less)" if rest else ""
        over = self.over_budget
        verdict = (f"over {BUDGET:g}x: {', '.join(p.name for p in over)}" if over
                   else f"every pass within {BUDGET:g}x")
        return (f"time against calibration ({self.calibration_seconds:.1f} s: the float model over the calibration "
                f"data, in {self.calibrated_by}): {names}{more}; {verdict}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"calibration_seconds": self.calibration_seconds, "calibrated_by": self.calibrated_by,
                "budget_x": BUDGET,
                "passes": [{"pass": p.name, "seconds": p.seconds, "x_calibration": p.ratio} for p in self.passes]}


def run_timing(records: Sequence[_Record]) -> Timing | None:
    """Every pass's time against the first calibration of the run (None when no pass calibrated from data)."""
    cal = next((r for r in records if r.result.calibration_seconds), None)
    if cal is None or not cal.result.calibration_seconds:
        return None
    base = float(cal.result.calibration_seconds)
    times = []
    for r in records:
        own = max(r.seconds - base, 0.0) if r is cal else r.seconds
        label = f"{r.name} (besides calibrating)" if r is cal else r.name
        times.append(PassTime(label, own, own / base))
    return Timing(base, cal.name, tuple(sorted(times, key=lambda p: -p.seconds)))
