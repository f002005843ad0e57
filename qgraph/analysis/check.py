"""``qgraph check``: validate a chain of models (framework FP32 → ONNX FP32 → INT8 ...) against a reference.

Every stage runs on the same held-out samples and is compared with the first stage (the reference): output SQNR,
cosine, top-1 agreement (classification-shaped outputs) and the user's metric. The *quality* of a stage is its
metric when one is given, else the lower of its top-1 agreement with the reference and its lowest output cosine when
the outputs are class scores (agreement alone would pass a model whose scores collapsed but whose arg-max held),
else its lowest output cosine. Output SQNR and cosine are the lowest over the parts of every output: an output that
a final Concat joins from different tensors (a detector's boxes and class scores) is scored part by part
(`qgraph.runtime.output_parts`; ``whole_outputs`` scores it whole). A stage fails when its quality drops from the
previous stage's by more than ``max_drop`` (``1%``: relative to the previous quality; ``0.01``: absolute), or, with
``max_total_drop``, from the reference's. The first stage can be outputs saved by the training framework
(``--reference-outputs``: an ``.npz`` with one array per output name, one row per sample), so PyTorch → ONNX is checked
without PyTorch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qgraph.errors import DataError, QGraphError, UsageError
from qgraph.io.inputs import array_file_problem, input_file_problem
from qgraph.runtime.class_outputs import class_outputs
from qgraph.runtime.compare import TensorDiff
from qgraph.runtime.evaluation import Evaluation, StageScore, paired, score_stage
from qgraph.runtime.kernels.measure import KernelChoice, Kernels, SaturationCount, choose, model_target, target_family
from qgraph.runtime.output_parts import OutputParts, output_parts_of


@dataclass(frozen=True)
class Drop:
    """An allowed quality drop: relative (``1%``) or absolute (``0.01``)."""

    value: float
    relative: bool

    @classmethod
    def parse(cls, text: str, option: str = "--max-drop", higher_is_better: bool = True) -> Drop:
        """``"1%"`` or ``"0.01"``; negative or non-numeric values are usage errors, and so is a relative drop above
        100% of a quality where higher is better (it would allow a stage that lost everything, NaN included)."""
        raw = text.strip()
        relative = raw.endswith("%")
        try:
            value = float(raw[:-1] if relative else raw)
        except ValueError:
            raise UsageError(f"{option} {text!r}: give a percentage (1%) or an absolute drop (0.01).") from None
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"{option} {text!r}: the allowed drop must be a finite number ≥ 0.")
        if relative and value > 100 and higher_is_better:
            raise UsageError(f"{option} {text!r}: a stage cannot lose more than 100% of its quality, so this limit "
                             "would pass anything; give at most 100% (or an absolute drop).")
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
    #: How the stage was run (None: saved outputs), and the host's deployed numbers when those emulate a target
    #: this host is not (`qgraph.runtime.kernels.measure.KernelChoice`).
    choice: KernelChoice | None = None
    host_score: StageScore | None = None
    #: Layers whose int16 pair sums saturated (emulated AVX2 arithmetic).
    saturation: list[SaturationCount] = field(default_factory=list)
    #: Where the emulation that measured the stage is not the target's arithmetic bit for bit.
    emulation: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        s = self.score
        host = self.host_score
        return {"stage": self.stage, "source": self.source, "sqnr_db": s.sqnr_db, "cosine": s.cosine,
                "top1_agreement": s.top1_agreement, "metric": s.metric, "quality": self.quality,
                "metric_interval": s.metric_interval.to_dict() if s.metric_interval else None,
                "step_drop": self.step_drop, "total_drop": self.total_drop, "ok": self.ok, "why": self.why,
                "error": s.error, "outputs": [_output_dict(d) for d in [*s.outputs, *(p for p in s.parts if p.part)]],
                "kernels": self.choice.to_dict() if self.choice else None,
                "host_deployed": None if host is None else {
                    "sqnr_db": host.sqnr_db, "cosine": host.cosine, "top1_agreement": host.top1_agreement,
                    "metric": host.metric, "error": host.error},
                "saturation": [c.to_dict() for c in self.saturation], "emulation_notes": self.emulation}

    def measured_with(self) -> str:
        """``reference: deployed kernels (x86-vnni, this host)``."""
        return f"{self.stage}: {self.choice.kernels.label() if self.choice else 'saved outputs'}"


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
    #: How each output is scored (`qgraph.runtime.output_parts`), None when not looked for.
    parts: OutputParts | None = None

    def part_lines(self) -> list[str]:
        """One sentence per output scored in parts (or a Concat output kept whole, and why)."""
        return self.parts.decisions() if self.parts is not None else []

    def kernel_lines(self) -> list[str]:
        """What was measured how: one line per distinct way of running, the host-vs-target mismatch first."""
        lines = list(dict.fromkeys(r.choice.mismatch for r in self.rows if r.choice and r.choice.mismatch))
        ways: dict[str, list[str]] = {}
        for r in self.rows:
            if r.choice is not None:
                ways.setdefault(r.choice.kernels.describe(), []).append(r.stage)
        lines += [f"measured ({', '.join(stages)}): {way}" for way, stages in ways.items()]
        return lines

    def host_lines(self) -> list[str]:
        """For a stage gated on an emulated target: what this host's deployed kernels give."""
        out = []
        for r in self.rows:
            h = r.host_score
            if h is None or r.choice is None or r.choice.other is None:
                continue
            if h.error is not None:
                out.append(f"{r.stage} on {r.choice.other.label()}: could not run ({h.error})")
                continue
            bits = [f"SQNR {h.sqnr_db:.1f} dB", f"cosine {h.cosine:.5f}"]
            if h.top1_agreement is not None:
                bits.append(f"top-1 agreement {h.top1_agreement:.4f}")
            if h.metric is not None:
                bits.append(f"metric {h.metric:.4f}")
            out.append(f"{r.stage} on {r.choice.other.label()}: {', '.join(bits)} (not gated: the gate uses "
                       f"{r.choice.kernels.label()})")
        return out

    def saturation_lines(self) -> list[str]:
        """The layers whose int16 pair sums saturated, per stage (the worst first)."""
        lines = [f"{r.stage}: int16 saturation in {c.describe()}" for r in self.rows for c in r.saturation]
        return lines + [f"{r.stage}: emulation not exact at {note}" for r in self.rows for note in r.emulation]

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
    problem = array_file_problem(path, ".npz") if path.is_file() else input_file_problem(path)
    if problem is not None:
        raise DataError(f"--reference-outputs {path}: {problem}.")
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
    kernels: str = "auto",
    target: str | None = None,
) -> CheckResult:
    """Score every stage against the first one and apply the drop limits (see module docs); ``whole_outputs``
    scores an output a final Concat joins as one tensor instead of part by part.

    Each model runs with the kernels `qgraph.runtime.kernels.measure.choose` picks for the CPU it was made for (its
    provenance; ``target`` overrides it for every candidate) under ``--kernels kernels``: a stage made for a CPU
    this host is not is gated on that CPU's arithmetic, emulated, and also measured on this host's deployed
    kernels (shown, not gated)."""
    ref_choice = choose(model_target(reference), kernels)
    names, ref_out, *_ = evaluation.run(reference, ref_choice.kernels)
    parts = output_parts_of(reference, enabled=not whole_outputs)
    stages: list[_Stage] = []
    if reference_outputs is not None:
        rows = ref_out[0].shape[0] if ref_out and ref_out[0].ndim else 1
        base = _saved_outputs(reference_outputs, names, rows)
        stages.append(_Stage("reference outputs", str(reference_outputs), base))
        stages.append(_Stage("ONNX reference", str(reference), ref_out, choice=ref_choice))
    else:
        base = ref_out
        stages.append(_Stage("reference", str(reference), ref_out, choice=ref_choice))
    for i, path in enumerate(candidates, 1):
        choice = choose(target_family(target) if target else model_target(path), kernels)
        stage = _run_stage(f"candidate {i}", path, evaluation, choice.kernels, names)
        stage.choice = choice
        if choice.other is not None:
            stage.host = _run_stage(f"candidate {i}", path, evaluation, choice.other, names)
        stages.append(stage)
    classes = class_outputs(reference)  # top-1 agreement for class scores only
    quality_name = evaluation.metric_spec or (TOP1_AND_COSINE if _classifies(base, names, classes)
                                              else "output cosine")
    result = CheckResult([], evaluation.describe(), quality_name, max_drop, max_total_drop, parts=parts)
    for st in stages:
        row = CheckRow(st.label, st.source, st.score(base, names, evaluation, parts, classes), choice=st.choice,
                       saturation=st.saturation, emulation=st.emulation)
        row.quality = _quality(row.score)
        if st.host is not None:
            row.host_score = st.host.score(base, names, evaluation, parts, classes)
        bad = nonfinite_outputs(names, st.outputs) if st.outputs is not None else None
        if result.rows and not result.rows[0].ok:  # the first stage is unusable: nothing to measure against
            row.ok, row.why = False, f"not compared: {result.rows[0].stage} is unusable"
        elif bad is not None:
            _fail(result, row, f"{bad}: nothing can be measured against these outputs; fix the reference (or its "
                  "data)" if not result.rows else f"{bad}: its outputs are not numbers")
        else:
            _judge(result, row, evaluation.higher_is_better)
        result.rows.append(row)
    return result


def _fail(result: CheckResult, row: CheckRow, why: str) -> None:
    row.ok, row.why = False, why
    result.failures.append(f"{row.stage} ({row.source}): {why}")


@dataclass
class _Stage:
    """One stage's outputs (or why it could not run), how they were computed, and the host's second opinion."""

    label: str
    source: str
    outputs: list[np.ndarray] | None
    error: str | None = None
    choice: KernelChoice | None = None
    saturation: list[SaturationCount] = field(default_factory=list)
    emulation: list[str] = field(default_factory=list)
    host: _Stage | None = None

    def score(self, base: list[np.ndarray], names: list[str], evaluation: Evaluation,
              parts: OutputParts | None, classes: dict[str, int]) -> StageScore:
        if self.outputs is None:
            return StageScore(self.label, error=self.error)
        return score_stage(self.label, base, names, self.outputs, evaluation, parts, classes)


def _run_stage(label: str, path: Path, evaluation: Evaluation, kernels: Kernels, names: list[str]) -> _Stage:
    """Run one candidate; its outputs are returned in the order of the reference's ``names`` (paired by name: two
    models whose outputs are listed in another order are still compared output by output)."""
    try:
        got_names, got, saturation, emulation = evaluation.run(path, kernels)
    except QGraphError:
        raise
    except Exception as exc:  # onnxruntime cannot load or run it: a failed stage, not a crash
        return _Stage(label, str(path), None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    ordered = paired(names, got_names, got)
    if isinstance(ordered, str):
        return _Stage(label, str(path), None, ordered)
    return _Stage(label, str(path), ordered, saturation=saturation, emulation=emulation)


def nonfinite_outputs(names: list[str], outputs: list[np.ndarray]) -> str | None:
    """``NaN/Inf in output y (8 of 16 values)`` for every float output holding non-finite values; None if none."""
    bad = []
    for name, value in zip(names, outputs, strict=True):
        arr = np.asarray(value)
        if arr.dtype.kind in "fc" and arr.size:
            count = int(arr.size - np.count_nonzero(np.isfinite(arr)))
            if count:
                bad.append(f"{name} ({count} of {arr.size} values)")
    return f"NaN/Inf in output {', '.join(bad)}" if bad else None


def _classifies(outputs: list[np.ndarray], names: list[str], classes: dict[str, int]) -> bool:
    """Whether the first output is class scores (`qgraph.runtime.class_outputs`)."""
    from qgraph.runtime.evaluation import top1_agreement

    need = classes.get(names[0]) if names else None
    return bool(outputs) and need is not None and top1_agreement(outputs[0], outputs[0], need) is not None


#: The quality of class scores checked without a metric.
TOP1_AND_COSINE = "top-1 agreement and output cosine (the lower)"


def _quality(score: StageScore) -> float:
    if score.error is not None:
        return math.nan
    if score.metric is not None:
        return score.metric
    agreement = score.top1_agreement
    return min(agreement, score.cosine) if agreement is not None else score.cosine


def _within_interval(row: CheckRow, before: float) -> str:
    """A failing drop that the stage's sampling interval covers is said to be so: the data cannot tell it from
    chance (the gate still fails; more evaluation samples decide)."""
    interval = row.score.metric_interval
    if interval is None or not interval.low <= before <= interval.high:
        return ""
    return (f"; the earlier score {before:.4g} lies within this stage's {interval.describe()}: more evaluation "
            "samples would tell whether the drop is real")


def _judge(result: CheckResult, row: CheckRow, higher_is_better: bool) -> None:
    if row.score.error is not None:
        row.ok, row.why = False, row.score.error
        result.failures.append(f"{row.stage} ({row.source}) failed to run: {row.score.error}")
        return
    if row.score.metric is not None and not math.isfinite(row.score.metric):
        whose = "the reference's" if not result.rows else f"{row.stage}'s"
        _fail(result, row, f"the metric {result.quality_name} returned {row.score.metric} on {whose} outputs: no "
              "drop can be measured; make the metric return a finite number")
        return
    if not result.rows:
        if not math.isfinite(row.quality):
            _fail(result, row, f"its {result.quality_name} against itself is {row.quality}: nothing can be measured "
                  "against it")
        return
    prev = next((r for r in reversed(result.rows) if r.score.error is None), result.rows[0])
    row.step_drop = result.max_drop.measure(prev.quality, row.quality, higher_is_better)
    row.total_drop = (result.max_total_drop or result.max_drop).measure(result.rows[0].quality, row.quality,
                                                                       higher_is_better)
    unit = "%" if result.max_drop.relative else ""
    if row.step_drop > result.max_drop.value:
        row.ok, row.why = False, f"drops {row.step_drop:.3g}{unit} from {prev.stage} (allowed {result.max_drop})"
        row.why += _within_interval(row, prev.quality)
        result.failures.append(f"{row.stage} ({row.source}) {row.why}")
    elif result.max_total_drop is not None and row.total_drop > result.max_total_drop.value:
        row.ok = False
        total_unit = "%" if result.max_total_drop.relative else ""
        row.why = f"drops {row.total_drop:.3g}{total_unit} in total (allowed {result.max_total_drop})"
        row.why += _within_interval(row, result.rows[0].quality)
        result.failures.append(f"{row.stage} ({row.source}) {row.why}")
