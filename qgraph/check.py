"""``qgraph check``: validate a chain of models (framework FP32 → ONNX FP32 → INT8 ...) against a reference.

Every stage runs on the same held-out samples and is compared with the first stage (the reference): output
SQNR, cosine, top-1 agreement (classification-shaped outputs) and the user's metric. The *quality* of a stage is
its metric when one is given, else its top-1 agreement with the reference when the outputs are class scores,
else its lowest output cosine. Output SQNR and cosine are the lowest over the parts of every output: an output
that a final Concat joins from different tensors (a detector's boxes and class scores) is scored part by part
(`qgraph.output_parts`; ``whole_outputs`` scores it whole). A stage fails when its quality drops from the
previous stage's by more than ``max_drop`` (``1%``: relative to the previous quality; ``0.01``: absolute), or,
with ``max_total_drop``, from the reference's. The first stage can be outputs saved by the training framework
(``--reference-outputs``: an ``.npz`` with one array per output name, one row per sample), so PyTorch → ONNX is
checked without PyTorch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qgraph.compare import TensorDiff
from qgraph.errors import DataError, QGraphError, UsageError
from qgraph.evaluation import Evaluation, StageScore, score_stage
from qgraph.output_parts import OutputParts, output_parts_of


@dataclass(frozen=True)
class Drop:
    """An allowed quality drop: relative (``1%``) or absolute (``0.01``)."""

    value: float
    relative: bool

    @classmethod
    def parse(cls, text: str, option: str = "--max-drop") -> Drop:
        """``"1%"`` or ``"0.01"``; negative or non-numeric values are usage errors."""
        raw = text.strip()
        relative = raw.endswith("%")
        try:
            value = float(raw[:-1] if relative else raw)
        except ValueError:
            raise UsageError(f"{option} {text!r}: give a percentage (1%) or an absolute drop (0.01).") from None
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"{option} {text!r}: the allowed drop must be a finite number ≥ 0.")
        return cls(value, relative)

    def measure(self, before: float, after: float, higher_is_better: bool) -> float:
        """The drop from ``before`` to ``after`` in this drop's unit (percent or absolute; NaN counts as inf)."""
        if math.isnan(before) or math.isnan(after):
            return math.inf
        lost = before - after if higher_is_better else after - before
        if not self.relative:
            return lost
        return 100.0 * lost / abs(before) if before else (0.0 if lost <= 0 else math.inf)

    def __str__(self) -> str:
        return f"{self.value:g}%" if self.relative else f"{self.value:g}"


@dataclass
class CheckRow:
    """One stage of the chain."""

    stage: str
    source: str
    score: StageScore
    quality: float = math.nan
    step_drop: float | None = None
    total_drop: float | None = None
    ok: bool = True
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        s = self.score
        return {"stage": self.stage, "source": self.source, "sqnr_db": s.sqnr_db, "cosine": s.cosine,
                "top1_agreement": s.top1_agreement, "metric": s.metric, "quality": self.quality,
                "step_drop": self.step_drop, "total_drop": self.total_drop, "ok": self.ok, "why": self.why,
                "error": s.error, "outputs": [_output_dict(d) for d in [*s.outputs, *(p for p in s.parts if p.part)]]}


def _output_dict(d: TensorDiff) -> dict[str, Any]:
    """An output's (or an output part's, with ``part_of``) numbers in the JSON."""
    out = {"name": d.name, "sqnr_db": d.sqnr_db, "cosine": d.cosine, "max_abs": d.max_abs}
    return {**out, "part_of": d.part.output, "part": d.part.to_dict()} if d.part is not None else out


@dataclass
class CheckResult:
    """The chain's table and verdict."""

    rows: list[CheckRow]
    data: str
    quality_name: str
    max_drop: Drop
    max_total_drop: Drop | None = None
    failures: list[str] = field(default_factory=list)
    #: How each output is scored (`qgraph.output_parts`), None when not looked for.
    parts: OutputParts | None = None

    def part_lines(self) -> list[str]:
        """One sentence per output scored in parts (or a Concat output kept whole, and why)."""
        return self.parts.decisions() if self.parts is not None else []

    @property
    def passed(self) -> bool:
        """True when no stage failed."""
        return not self.failures

    def verdict(self) -> str:
        """One sentence: pass, or which stages failed and by how much."""
        if self.passed:
            return (f"PASS: every step keeps {self.quality_name} within {self.max_drop} of the previous stage "
                    f"({len(self.rows)} stages).")
        return "FAIL: " + "; ".join(self.failures) + "."

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"data": self.data, "quality": self.quality_name, "max_drop": str(self.max_drop),
                "max_total_drop": str(self.max_total_drop) if self.max_total_drop else None,
                "passed": self.passed, "verdict": self.verdict(), "stages": [r.to_dict() for r in self.rows],
                "output_parts": self.parts.to_dict() if self.parts is not None else [],
                "output_parts_decisions": self.part_lines()}


def _saved_outputs(path: Path, names: list[str], rows: int) -> list[np.ndarray]:
    """Outputs saved by the training framework: one array per output name (a lone array for one output)."""
    if not path.is_file():
        raise DataError(f"--reference-outputs {path}: no such file.")
    with np.load(path, allow_pickle=False) as data:
        keys = list(data.files)
        if len(names) == 1 and len(keys) == 1:
            arrays = [np.asarray(data[keys[0]])]
        else:
            missing = [n for n in names if n not in keys]
            if missing:
                raise DataError(f"--reference-outputs {path}: no array for output(s) {missing} (it has {keys}); "
                                "save one array per model output, named as the ONNX outputs.")
            arrays = [np.asarray(data[n]) for n in names]
    for n, a in zip(names, arrays, strict=True):
        if a.ndim == 0 or a.shape[0] < rows:
            raise DataError(f"--reference-outputs {path}: {n} has {a.shape[0] if a.ndim else 0} row(s), the "
                            f"evaluation data {rows} sample row(s); save one row per sample.")
    return [a[:rows] for a in arrays]


def check_chain(
    reference: Path,
    candidates: list[Path],
    evaluation: Evaluation,
    *,
    max_drop: Drop,
    max_total_drop: Drop | None = None,
    reference_outputs: Path | None = None,
    whole_outputs: bool = False,
) -> CheckResult:
    """Score every stage against the first one and apply the drop limits (see module docs); ``whole_outputs``
    scores an output a final Concat joins as one tensor instead of part by part."""
    names, ref_out = evaluation.outputs(reference)
    parts = output_parts_of(reference, enabled=not whole_outputs)
    stages: list[tuple[str, str, list[np.ndarray] | None, str | None]] = []
    if reference_outputs is not None:
        rows = ref_out[0].shape[0] if ref_out and ref_out[0].ndim else 1
        base = _saved_outputs(reference_outputs, names, rows)
        stages.append(("reference outputs", str(reference_outputs), base, None))
        stages.append(("ONNX reference", str(reference), ref_out, None))
    else:
        base = ref_out
        stages.append(("reference", str(reference), ref_out, None))
    for i, path in enumerate(candidates, 1):
        try:
            got: list[np.ndarray] | None = evaluation.outputs(path)[1]
            err = None
        except QGraphError:
            raise
        except Exception as exc:  # onnxruntime cannot load or run it: a failed stage, not a crash
            got, err = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        stages.append((f"candidate {i}", str(path), got, err))
    quality_name = evaluation.metric_spec or ("top-1 agreement" if _classifies(base) else "output cosine")
    result = CheckResult([], evaluation.describe(), quality_name, max_drop, max_total_drop, parts=parts)
    for label, source, outs, err in stages:
        score = StageScore(label, error=err) if outs is None else score_stage(label, base, names, outs, evaluation,
                                                                               parts)
        row = CheckRow(label, source, score, quality=_quality(score))
        _judge(result, row, evaluation.higher_is_better)
        result.rows.append(row)
    return result


def _classifies(outputs: list[np.ndarray]) -> bool:
    from qgraph.evaluation import top1_agreement

    return bool(outputs) and top1_agreement(outputs[0], outputs[0]) is not None


def _quality(score: StageScore) -> float:
    if score.error is not None:
        return math.nan
    if score.metric is not None:
        return score.metric
    agreement = score.top1_agreement
    return agreement if agreement is not None else score.cosine


def _judge(result: CheckResult, row: CheckRow, higher_is_better: bool) -> None:
    if row.score.error is not None:
        row.ok, row.why = False, row.score.error
        result.failures.append(f"{row.stage} ({row.source}) failed to run: {row.score.error}")
        return
    if not result.rows:
        return
    prev = next((r for r in reversed(result.rows) if r.score.error is None), result.rows[0])
    row.step_drop = result.max_drop.measure(prev.quality, row.quality, higher_is_better)
    row.total_drop = (result.max_total_drop or result.max_drop).measure(result.rows[0].quality, row.quality,
                                                                       higher_is_better)
    unit = "%" if result.max_drop.relative else ""
    if row.step_drop > result.max_drop.value:
        row.ok, row.why = False, f"drops {row.step_drop:.3g}{unit} from {prev.stage} (allowed {result.max_drop})"
        result.failures.append(f"{row.stage} ({row.source}) {row.why}")
    elif result.max_total_drop is not None and row.total_drop > result.max_total_drop.value:
        row.ok = False
        row.why = f"drops {row.total_drop:.3g} in total (allowed {result.max_total_drop})"
        result.failures.append(f"{row.stage} ({row.source}) {row.why}")
