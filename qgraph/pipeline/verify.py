"""Numeric verification of float-preserving passes (``--verify``), judged against the model's own float32 noise.

A float-preserving pass (BatchNorm fusion, activation fusion, constant folding...) computes the same math in a
different order, so its output differs from the original's by float32 rounding. How large that rounding gets
depends on the model: a deep detector with large activations drifts by a few 1e-5 relative under *any*
reordering, including onnxruntime's own graph optimizations. A fixed tolerance below that level blames correct
passes, so the tolerance of each output ``o`` is

    tol_o = max(tol_user, K * floor_o)        K = NOISE_FLOOR_FACTOR = 4

where ``floor_o = max|y_all - y_none| / max|y_none|`` is the relative difference of output ``o`` between the
*original* model run by onnxruntime with every graph optimization (``ORT_ENABLE_ALL``: fusions, constant folding,
NCHWc layouts) and with none (``ORT_DISABLE_ALL``), on the same verification inputs: reassociation noise of the
same math, measured once (one extra pair of runs). A pass fails when ``max|after - before| > tol_o * max|before|``
for some output. K = 4 leaves room for a pass that reorders somewhat more than onnxruntime does, while a real
error (a weight off by 1e-3 relative moves the outputs by ~1e-3) stays far above it.

The floor depends on the CPU and the onnxruntime build (kernels differ), so it decides only whether a run passes,
never what it writes: it is shown in the run summary and the report, not in the output model's provenance.
Non-float outputs (indices, masks) keep the user's tolerance, and a floor above ``MAX_NOISE_FLOOR`` (an output
that is unstable under reordering, e.g. a near-tie argmax) is capped there and said so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx
import onnxruntime as ort

from qgraph.data import Feed
from qgraph.errors import QGraphError, VerificationError
from qgraph.quant.qdq import has_qdq
from qgraph.runtime.compare import ORT_ERRORS, TensorDiff, compare_models, make_session

if TYPE_CHECKING:
    from qgraph.runtime.kernels.measure import Kernels

#: The tolerance of an output is at least this many times its measured float32 noise floor.
NOISE_FLOOR_FACTOR = 4.0
#: Floors above this (relative) are capped: beyond it an output is unstable, not merely rounded.
MAX_NOISE_FLOOR = 1e-3
_ORT_ERRORS: tuple[type[Exception], ...] = (QGraphError, *ORT_ERRORS)


@dataclass(frozen=True)
class VerifyTolerance:
    """The tolerance ``--verify`` applies: the user's, raised per output to ``factor`` x the noise floor."""

    #: The tolerance asked for (``--tolerance`` / ``verify_tolerance``).
    requested: float
    #: Relative noise floor of each output (by position); empty when it was not measured.
    floors: tuple[float, ...] = ()
    factor: float = NOISE_FLOOR_FACTOR
    #: Why the floor is missing or capped (one sentence), if it is.
    note: str | None = None

    def for_output(self, position: int) -> float:
        """``max(requested, factor * floor)`` of the output at ``position``."""
        floor = self.floors[position] if position < len(self.floors) else 0.0
        return max(self.requested, self.factor * floor)

    @property
    def floor(self) -> float:
        """The largest noise floor over the outputs (0 when not measured)."""
        return max(self.floors, default=0.0)

    @property
    def raised(self) -> bool:
        """Whether the noise floor raised the tolerance of some output above the requested one."""
        return self.factor * self.floor > self.requested

    def describe(self) -> str:
        """One sentence: the tolerance used and where it comes from."""
        if not self.raised:
            text = (f"verify tolerance {self.requested:g} (this model's float32 noise floor {self.floor:.2g} x "
                    f"{self.factor:g} is below it)")
        else:
            text = (f"verify tolerance raised from {self.requested:g} to {self.factor * self.floor:.2g}: "
                    f"{self.factor:g} x this model's float32 noise floor {self.floor:.2g} (onnxruntime all "
                    "optimizations vs none on the verify inputs; host-dependent)")
        return f"{text}; {self.note}" if self.note else text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"requested": self.requested, "floors": list(self.floors), "factor": self.factor,
                "raised": self.raised, "used": [self.for_output(i) for i in range(len(self.floors))],
                "note": self.note}


def measure_tolerance(model: onnx.ModelProto, feeds: Sequence[Feed], requested: float) -> VerifyTolerance:
    """The `VerifyTolerance` for ``model``: its per-output noise floor measured on ``feeds`` (see module docs).

    When onnxruntime cannot optimize or run the model, the floor is left unmeasured (the requested tolerance
    applies; verification itself then reports a model that cannot run)."""
    try:
        plain = make_session(model)
        optimized = make_session(model, optimization=ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
        diffs = compare_models(plain, optimized, feeds)
        kinds = [o.type for o in plain.get_outputs()]
    except _ORT_ERRORS as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        return VerifyTolerance(requested, note=f"noise floor not measured ({reason})")
    floors: list[float] = []
    capped: list[str] = []
    for d, kind in zip(diffs, kinds, strict=True):
        floating = "float" in kind or "double" in kind
        floor = d.relative if floating and d.finite else 0.0  # NaN/Inf: verification itself says so
        if floor > MAX_NOISE_FLOOR:
            capped.append(d.name)
            floor = MAX_NOISE_FLOOR
        floors.append(floor)
    note = (f"noise floor capped at {MAX_NOISE_FLOOR:g} for output(s) {', '.join(capped)}: they change by more "
            "under float reordering alone" if capped else None)
    return VerifyTolerance(requested, tuple(floors), note=note)


def check_pass(name: str, index: int, before: onnx.ModelProto, after: onnx.ModelProto, feeds: Sequence[Feed],
               tolerance: VerifyTolerance, kernels: Kernels | None = None) -> list[TensorDiff]:
    """Compare ``after`` (the model after pass #``index`` ``name``) with ``before`` on ``feeds``; raise
    `VerificationError` when an output is not finite or differs beyond its tolerance (``tolerance.for_output``).
    A quantized ``before`` (a pass after quantization) runs with ``kernels`` (the target CPU's arithmetic,
    `qgraph.runtime.kernels`): the pass must keep what deploys, fused integer kernels included."""
    if kernels is not None and has_qdq(before):
        diffs = compare_models(kernels.session(before), kernels.session(after), feeds)
    else:
        diffs = compare_models(before, after, feeds)
    broken = [d for d in diffs if not d.finite]
    if broken:
        before_bad = [d for d in broken if d.nonfinite_reference]
        whose = ("the model before it already produces NaN/Inf on the verification inputs, so results cannot be "
                 "compared: fix the model or the data" if before_bad else
                 "this is a bug in the pass or an unsupported pattern (e.g. a BatchNorm with negative variance "
                 "folded into weights): exclude the affected nodes or fix the model")
        raise VerificationError(f"pass #{index} {name!r}: {'; '.join(d.problem() or '' for d in broken)}; {whose}.")
    over = [(d.relative / tolerance.for_output(i), i, d) for i, d in enumerate(diffs)
            if d.max_abs > tolerance.for_output(i) * max(d.scale, 1e-12)]
    if over:
        _, i, worst = max(over, key=lambda t: t[0])
        floor = tolerance.floors[i] if i < len(tolerance.floors) else 0.0
        raise VerificationError(
            f"pass #{index} {name!r} changed the model's results: output {worst.name!r} differs by max abs "
            f"{worst.max_abs:.3g} (scale {worst.scale:.3g}, relative {worst.relative:.3g} > tolerance "
            f"{tolerance.for_output(i):.3g} = max(--tolerance {tolerance.requested:g}, {tolerance.factor:g} x this "
            f"model's float32 noise floor {floor:.3g})). This is a bug in the pass or an unsupported pattern: "
            "exclude the affected nodes or report it; if a difference this size is acceptable float rounding for "
            "your model, raise --tolerance (verify_tolerance in Python)."
        )
    return diffs
