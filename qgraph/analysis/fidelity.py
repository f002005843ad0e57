"""The fidelity check at the end of ``qgraph run``: how close the transformed model's outputs are to the float
model's, on a few samples, printed as one line per output (and kept in the ``--report`` JSON as ``check``).

For each graph output (by position), over the samples: SQNR ``10 log10(Σ r² / Σ (c - r)²)`` dB, cosine
``<c, r> / (|c| |r|)``, max abs error and, for class scores ``[N, C]``, top-1 agreement (share of rows whose
arg-max agrees) — the same numbers as the report's ``final`` fidelity row (`qgraph.analysis.report.stage_fidelity`). An
output that a final Concat joins from different tensors (a detector's boxes and class scores,
`qgraph.runtime.output_parts`) gets one more line per part, and ``--min-sqnr`` holds each part to the bound.
NaN/Inf in either model's output makes SQNR and cosine NaN and the line says so: never "no error".

Cost: one run of each model on the samples (the held-out ``--eval-data`` when given, else the first
`CHECK_SAMPLES` calibration samples, labelled as not held out); both models are loaded by onnxruntime from their
files, so no second protobuf copy of the weights is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from qgraph.analysis.report import stage_fidelity
from qgraph.data import DataSource, Feed
from qgraph.quant.qdq import has_qdq
from qgraph.runtime.evaluation import Evaluation
from qgraph.runtime.kernels.measure import KernelChoice, choose, model_target
from qgraph.runtime.output_parts import OutputParts, find_output_parts

#: Calibration samples the check runs on when there is no held-out data.
CHECK_SAMPLES = 8
#: Outputs listed one per line; beyond it the worst ones are listed and the rest summarised.
SHOWN_OUTPUTS = 8
#: Below this output SQNR (dB) the check prints a warning line, with or without ``--min-sqnr``: about 10% relative
#: error, where a model's outputs visibly differ from the float model's (detections move, scores reorder).
POOR_SQNR_DB = 20.0


@dataclass
class OutputCheck:
    """Per-output fidelity of the transformed model against the float model (see module docs)."""

    data: str
    held_out: bool
    #: One row per output: ``output``, ``sqnr_db``, ``cosine``, ``max_abs``, ``relative``, ``top1_agreement``,
    #: ``metric``, ``nonfinite_reference``, ``nonfinite_candidate`` (or ``error`` when a model could not run).
    rows: list[dict[str, Any]] = field(default_factory=list)
    float_metric: float | None = None
    #: What the outputs are compared with: the float model, or the input model when it was already quantized.
    against: str = "the float model"
    # : How the models ran (`qgraph.runtime.kernels.measure.KernelChoice`), and with a target this host is not, the rows
    # of
    #: the same check on this host's deployed kernels (shown, not judged).
    choice: KernelChoice | None = None
    host_rows: list[dict[str, Any]] = field(default_factory=list)

    def failures(self, min_sqnr_db: float) -> list[str]:
        """One phrase per output below ``min_sqnr_db`` or not comparable (NaN/Inf, a model that failed); an output
        scored in parts is judged by its parts (its own SQNR is never below the worst part's)."""
        out = []
        split = {r["part_of"] for r in self.rows if "part_of" in r}
        for r in self.rows:
            if r.get("output") in split:
                continue
            if "error" in r:
                out.append(f"the check failed: {r['error']}")
            elif math.isnan(r["sqnr_db"]):
                out.append(f"output {r['output']!r}: NaN/Inf values, not comparable")
            elif r["sqnr_db"] < min_sqnr_db:
                out.append(f"output {r['output']!r}: SQNR {r['sqnr_db']:.1f} dB")
        return out

    def poor(self) -> str | None:
        """A plain warning when some output (or part) is below `POOR_SQNR_DB` or not comparable, else None."""
        bad = self.failures(POOR_SQNR_DB)
        if not bad:
            return None
        return (f"warning: poor result: {'; '.join(bad)} (below {POOR_SQNR_DB:g} dB, about 10% relative error, "
                f"measured on {'held-out' if self.held_out else 'calibration'} data): the model's outputs differ "
                "visibly from the float model's")

    def lines(self) -> list[str]:
        """What the terminal shows: a header naming the data, then one line per output (worst first beyond
        `SHOWN_OUTPUTS`)."""
        head = f"check against {self.against} on {self.data}:"
        lines = [self.choice.mismatch] if self.choice is not None and self.choice.mismatch else []
        lines += [head, *self._output_lines(self.rows)]
        if self.choice is not None:
            lines.append(f"  measured with {self.choice.kernels.describe()}")
        if self.host_rows and self.choice is not None and self.choice.other is not None:
            lines.append(f"  on {self.choice.other.label()} (not judged):")
            lines += ["  " + line for line in self._output_lines(self.host_rows)]
        for row in self.rows:
            for sat in row.get("saturation", []):
                lines.append(f"  int16 saturation in {sat['node']}: {100 * sat['fraction']:.3g}% of its u8×s8 pair "
                             f"sums (Q/DQ pair {sat['activation']} × weight {sat['weight']})")
        return lines

    def _output_lines(self, all_rows: list[dict[str, Any]]) -> list[str]:
        rows = [r for r in all_rows if "output" in r or "error" in r]
        shown = sorted(rows, key=_badness)[:SHOWN_OUTPUTS] if len(rows) > SHOWN_OUTPUTS else rows
        lines = [f"{'    ' if 'part_of' in r else '  '}{_describe(r, self.float_metric)}" for r in shown]
        rest = [r for r in rows if r not in shown]
        if rest:
            low = min(r["sqnr_db"] for r in rest)
            lines.append(f"  ... {len(rest)} more output(s), all at {low:.1f} dB SQNR or better (--report lists "
                         "every one)")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the ``check`` entry of the ``--report`` JSON)."""
        return {"data": self.data, "held_out": self.held_out, "float_metric": self.float_metric,
                "against": self.against, "outputs": self.rows,
                "kernels": self.choice.to_dict() if self.choice is not None else None,
                "host_deployed_outputs": self.host_rows}


def _badness(row: dict[str, Any]) -> tuple[int, float]:
    """Sort key: failed runs and NaN first, then the lowest SQNR."""
    if "error" in row:
        return (0, 0.0)
    sqnr = row["sqnr_db"]
    return (1, 0.0) if math.isnan(sqnr) else (2, sqnr)


def _describe(row: dict[str, Any], float_metric: float | None) -> str:
    """One output's line."""
    if "error" in row:
        return f"could not run the check: {row['error']}"
    name = row["output"]
    if math.isnan(row["sqnr_db"]):
        return (f"{name}: NaN/Inf in the outputs ({row['nonfinite_candidate']} value(s) in the transformed model, "
                f"{row['nonfinite_reference']} in the float model): not comparable, not a match")
    sqnr = "inf dB (identical)" if row["sqnr_db"] == math.inf else f"{row['sqnr_db']:.1f} dB"
    parts = [f"SQNR {sqnr}", f"cosine {row['cosine']:.5f}", f"max abs error {row['max_abs']:.3g}"]
    if row.get("top1_agreement") is not None:
        parts.append(f"top-1 agreement {row['top1_agreement']:.1%}")
    if row.get("metric") is not None:
        base = f" (float {float_metric:.4g})" if float_metric is not None else ""
        spread = row.get("metric_interval")
        if spread and spread["low"] < spread["high"]:
            base += f", 95% interval {spread['low']:.4g}-{spread['high']:.4g} over {spread['samples']} samples"
        parts.append(f"metric {row['metric']:.4g}{base}")
    return f"{name}: " + ", ".join(parts)


def first_samples(data: DataSource, n: int = CHECK_SAMPLES) -> list[Feed]:
    """The first ``n`` samples of ``data`` (read lazily: the rest is never loaded)."""
    feeds: list[Feed] = []
    for feed in data:
        feeds.append(feed)
        if len(feeds) >= n:
            break
    return feeds


def check_fidelity(reference: onnx.ModelProto | str | Path, candidate: onnx.ModelProto | str | Path,
                   data: DataSource | None, evaluation: Evaluation | None = None,
                   choice: KernelChoice | None = None) -> OutputCheck | None:
    """``candidate``'s outputs against ``reference``'s on ``evaluation``'s samples, else on the first
    `CHECK_SAMPLES` of ``data`` (the calibration data: labelled not held out); None without samples. The candidate
    runs with ``choice`` (default: the kernels for the CPU its provenance names, `qgraph.runtime.kernels.measure`), and
    on this host's deployed kernels too when those emulate another CPU."""
    if evaluation is not None:
        feeds, desc, held_out = evaluation.feeds, evaluation.describe(), evaluation.held_out
    else:
        feeds = first_samples(data) if data is not None else []
        if not feeds:
            return None
        desc = (f"{len(feeds)} sample(s) of {data.description if data is not None else 'data'} — calibration "
                "data (not held-out; give --eval-data for held-out numbers)")
        held_out = False
    scored = evaluation is not None and evaluation.metric is not None
    stages: list[tuple[str, onnx.ModelProto | str | Path]] = [("final", candidate)]
    if scored:  # the float model's own score, for comparison (one more run, only with a metric)
        stages.insert(0, ("float", reference))
    quantized, parts = _structure(reference)
    choice = choice or choose(model_target(candidate))
    ref_kernels = choose(model_target(reference), choice.kernels.mode if choice.other is None else "auto").kernels
    rows = stage_fidelity(reference, stages, feeds, evaluation, parts, choice.kernels, ref_kernels)
    float_metric = next((r.get("metric") for r in rows if r["stage"] == "float"), None)
    final = [{k: v for k, v in r.items() if k != "stage"} for r in rows if r["stage"] == "final"]
    host_rows: list[dict[str, Any]] = []
    if choice.other is not None:
        host = stage_fidelity(reference, [("final", candidate)], feeds, evaluation, parts, choice.other, ref_kernels)
        host_rows = [{k: v for k, v in r.items() if k != "stage"} for r in host]
    against = "the float model"
    if quantized:
        against = ("the input model, itself quantized (compare with the float model: qgraph diff FLOAT OUTPUT "
                   "--eval-data DATA)")
    return OutputCheck(desc, held_out, final, float_metric, against, choice, host_rows)


def _structure(model: onnx.ModelProto | str | Path) -> tuple[bool, OutputParts]:
    """Whether ``model`` holds Q/DQ nodes, and its outputs' parts (a path is read once, without its external data,
    and released before any session is built)."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    return has_qdq(proto), find_output_parts(proto)
