"""Per-node sensitivity: rank every quantized node from one run, measure the top ones exactly on request.

Ranking (`rank_nodes`), O(1) model evaluations: one paired run gives each quantized node's local noise ratio
``η_n`` (its output error when fed the float model's inputs, `qgraph.analysis.sensitivity.probe`), and the additive
noise model (`qgraph.analysis.sensitivity.noise`), calibrated on the INT8 model's measured output error, predicts the
gain of returning any node, or any set of nodes, to float. Rows come in the order the search uses.

Exact measure (``exact_top = k``), one full evaluation per node: for the first ``k`` nodes of that ranking,
sensitivity is the measured gain of the target score with only that node returned to float,
``score(fall_back(M, {n})) - score(M)``, built with the same rewrite as the final model (so error that
downstream quantized layers amplify or mask is counted, as in deployment); those ``k`` rows are re-ranked by
it and placed first. ``exact_top`` at least the number of candidates is the full leave-one-out table
(`sensitivity_report`), linear in the number of candidates.

Candidates are independent: ``jobs > 1`` measures them in that many worker processes, and ``executor``
(`qgraph.runtime.executor`) runs them as Ray tasks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx

from qgraph.analysis.sensitivity.evaluate import Evaluator, Measurement, Progress, concat_outputs, measure_all
from qgraph.analysis.sensitivity.noise import NoiseModel
from qgraph.analysis.sensitivity.probe import StepProgress, local_errors
from qgraph.analysis.sensitivity.stats import range_stats
from qgraph.analysis.sensitivity.targets import Target
from qgraph.errors import PassError
from qgraph.graph import GraphHandle
from qgraph.graph.selectors import NodeSelector, select
from qgraph.quant.dynamic_graph import dynamic_units, unit_aliases
from qgraph.quant.qdq_graph import quantized_nodes
from qgraph.runtime.compare import TensorDiff
from qgraph.runtime.executor import Executor, ExecutorSpec


@dataclass
class NodeSensitivity:
    """One row of the sensitivity table."""

    name: str
    op: str
    sensitivity: float  # target gain (positive = falling back helps): measured when `measured`, else predicted
    score: float  # target score with only this node in float (NaN when not measured)
    cosine: float
    sqnr_db: float
    local_sqnr_db: float | None = None  # -10 log10 η_n: the node's own error on the float model's inputs
    measured: bool = True  # exact (one full evaluation) rather than predicted from the one-run ranking
    clip_fraction: float | None = None  # worst over the node's quantized activation inputs
    input_sqnr_db: float | None = None  # quantization SQNR of its worst activation input
    inputs: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (non-finite floats become strings)."""
        return {k: _json_float(v) for k, v in self.__dict__.items()}


def _json_float(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, list):
        return [{k: _json_float(x) for k, x in d.items()} if isinstance(d, dict) else d for d in v]
    return v


@dataclass
class SensitivityReport:
    """The ranked table plus the scores it is relative to."""

    target: Target
    float_score: float
    int8_score: float
    baseline: list[TensorDiff]  # the INT8 model's diff per scored output part (`Measurement.scored`)
    rows: list[NodeSensitivity]
    candidates: int
    seconds: float
    complete: bool = True
    base_nodes: tuple[str, ...] = ()
    method: str = "exact"  # "exact": every row measured; "one-run": ranked from local errors (+ exact top rows)
    notes: list[str] = field(default_factory=list)
    model: NoiseModel | None = None  # the one-run ranking's predictor (None for the exact table)

    def ranked(self) -> list[NodeSensitivity]:
        """Rows, most sensitive first: in measured order for the exact table, in search order for one-run."""
        if self.method != "exact":
            return list(self.rows)
        return sorted(self.rows, key=lambda r: -r.sensitivity if math.isfinite(r.sensitivity) else math.inf)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "definition": "gain in the target score when only this node is returned to float"
            + ("" if self.method == "exact" else " (predicted from one run unless measured)"),
            "method": self.method,
            "target": self.target.describe(),
            "float_score": _json_float(self.float_score),
            "int8_score": _json_float(self.int8_score),
            "int8_outputs": [{k: _json_float(v) for k, v in d.to_dict().items()} for d in self.baseline],
            "candidates": self.candidates,
            "measured": len(self.rows),
            "complete": self.complete,
            "seconds": round(self.seconds, 3),
            "already_float": list(self.base_nodes),
            "nodes": [r.to_dict() for r in self.ranked()],
        }


# ----------------------------------------------------------------------------- the report
def candidate_nodes(
    qdq: onnx.ModelProto, restrict: NodeSelector | None = None, dynamic: bool = True
) -> tuple[list[tuple[str, str]], list[str]]:
    """``(name, op)`` of every quantized node (optionally within ``restrict``), by the names `GraphHandle` gives,
    and notes; dynamically quantized MatMuls too unless ``dynamic`` is False (a 16-bit remedy has no form for them:
    a note says how many are left out)."""
    handle = GraphHandle(qdq)
    nodes = quantized_nodes(handle)
    units = dynamic_units(handle)  # dynamically quantized MatMuls, by the MatMul's name (`qgraph.remedy.dynamic`)
    notes: list[str] = []
    if units and not dynamic:
        notes.append(f"{len(units)} dynamically quantized MatMul(s) are not candidates: they have no 16-bit form "
                     "(to: float returns them to float)")
        units = []
    if restrict is not None:
        sel = select(handle, restrict, unit_aliases(units))
        if sel.unmatched:
            raise PassError(
                f"float_fallback: candidate selector ({restrict.describe()}): "
                + "; ".join(sel.unmatched)
                + ". Fix the names/patterns (see `qgraph inspect`)."
            )
        inside = {id(n) for n in sel.nodes}
        nodes = [n for n in nodes if id(n) in inside]
        units = [u for u in units if id(u.anchor) in inside]
    # Every node has a unique name once loaded (`qgraph.graph.naming`: unnamed ones ``<OpType>(<first output>)``,
    # repeats ``name#2``): the name shown here is the one `float_fallback`'s ``nodes.names`` selects.
    return [(n.name, n.op) for n in nodes] + [(u.name, u.op) for u in units], notes


def sensitivity_report(
    evaluator: Evaluator,
    target: Target,
    candidates: Sequence[tuple[str, str]],
    *,
    base_nodes: Sequence[str] = (),
    jobs: int = 1,
    deadline: float | None = None,
    progress: Progress | None = None,
    stats: bool = True,
    baseline: Measurement | None = None,
    executor: ExecutorSpec | Executor | None = None,
) -> SensitivityReport:
    """Measure every candidate (leave-one-out from the INT8 model with ``base_nodes`` already in float;
    ``baseline`` is that model's measurement when already made)."""
    start = time.perf_counter()
    base = tuple(base_nodes)
    refs = concat_outputs(evaluator.reference) if target.needs_outputs else None
    float_score = target.score([], refs, refs)  # cosine 1, SQNR inf, or the metric on the float outputs
    base_m = baseline if baseline is not None else evaluator.measure(base)
    int8_score = target.score(base_m.scored, base_m.outputs, refs)
    todo = [(*base, name) for name, _ in candidates]
    measured = measure_all(evaluator, todo, jobs=jobs, deadline=deadline, progress=progress, executor=executor)
    by_name = {m.nodes[-1]: m for m in measured}
    ops = dict(candidates)
    extra = range_stats(evaluator.variant(base), evaluator.batches, list(by_name)) if stats else {}
    rows = []
    for name, _ in candidates:
        m = by_name.get(name)
        if m is None:
            continue
        score = target.score(m.scored, m.outputs, refs)
        st = extra.get(name, {})
        rows.append(
            NodeSensitivity(
                name,
                ops[name],
                target.gain(score, int8_score),
                score,
                min(d.cosine for d in m.scored),
                min(d.sqnr_db for d in m.scored),
                clip_fraction=st.get("clip_fraction"),
                input_sqnr_db=st.get("input_sqnr_db"),
                inputs=st.get("inputs", []),
            )
        )
    return SensitivityReport(
        target,
        float_score,
        int8_score,
        base_m.scored,
        rows,
        len(candidates),
        time.perf_counter() - start,
        len(rows) == len(candidates),
        base,
    )


def rank_nodes(
    evaluator: Evaluator,
    target: Target,
    candidates: Sequence[tuple[str, str]],
    baseline: Measurement,
    *,
    base_nodes: Sequence[str] = (),
    exact_top: int = 0,
    jobs: int = 1,
    deadline: float | None = None,
    progress: StepProgress | None = None,
    exact_progress: StepProgress | None = None,
    stats: bool = False,
    executor: ExecutorSpec | Executor | None = None,
    measured_only: Sequence[tuple[str, str]] = (),
) -> SensitivityReport:
    """One-run ranking of ``candidates`` (see module docs), the first ``exact_top`` measured exactly.

    ``baseline`` is the measurement of the INT8 model with ``base_nodes`` in float. ``measured_only`` are
    candidates the one-run probe cannot see (nodes inside If/Loop bodies: onnxruntime returns no tensor from
    there): each is measured exactly, one evaluation, and placed in the order by its measured gain."""
    start = time.perf_counter()
    base = tuple(base_nodes)
    refs = concat_outputs(evaluator.reference) if target.needs_outputs else None
    float_score = target.score([], refs, refs)
    int8_score = target.score(baseline.scored, baseline.outputs, refs)
    qdq = evaluator.variant(base)
    errors, skipped, done = local_errors(qdq, evaluator.batches, [n for n, _ in candidates],
                                         progress=progress,
                                         deadline=deadline, parts=evaluator.parts)
    del qdq
    model = NoiseModel(errors, baseline.scored)
    ops = dict(candidates)
    order = model.order() + [n for n, _ in candidates if n in skipped]
    notes = [f"{len(skipped)} node(s) have no local measure and are ranked last: "
             + "; ".join(f"{n}: {why}" for n, why in list(skipped.items())[:3])] if skipped else []
    if candidates and done < len(evaluator.batches):
        notes.append(f"max_time reached during ranking: {done} of {len(evaluator.batches)} batches used")
    rows = []
    for name in order:
        e = errors.get(name)
        rows.append(NodeSensitivity(name, ops[name], model.gain_alone(target, name) if e else math.nan, math.nan,
                                    math.nan, math.nan, e.sqnr_db if e else None, measured=False))
    k = min(exact_top, len(rows))
    if k:
        exact = sensitivity_report(evaluator, target, [(r.name, r.op) for r in rows[:k]], base_nodes=base,
                                   jobs=jobs, deadline=deadline, progress=exact_progress, stats=False,
                                   baseline=baseline, executor=executor)
        by_name = {r.name: r for r in exact.rows}
        for r in exact.rows:
            r.local_sqnr_db = next(x.local_sqnr_db for x in rows[:k] if x.name == r.name)
        top = sorted(exact.rows, key=lambda r: -r.sensitivity if math.isfinite(r.sensitivity) else math.inf)
        rows = top + [r for r in rows if r.name not in by_name]
        if not exact.complete:
            notes.append(f"max_time reached during the exact measure: {len(exact.rows)} of {k} measured")
    if measured_only:
        inside = sensitivity_report(evaluator, target, measured_only, base_nodes=base, jobs=jobs, deadline=deadline,
                                    progress=exact_progress, stats=False, baseline=baseline, executor=executor)
        rows = sorted([*rows, *inside.rows],
                      key=lambda r: -r.sensitivity if math.isfinite(r.sensitivity) else math.inf)
        notes.append(f"{len(inside.rows)} of {len(measured_only)} node(s) inside If/Loop bodies measured exactly "
                     "(one evaluation each) and ranked by their measured gain")
    if stats:  # clipping and input SQNR of every node's activation inputs: one more run, reduced in-graph
        extra = range_stats(evaluator.variant(base), evaluator.batches, [r.name for r in rows])
        for r in rows:
            st = extra.get(r.name, {})
            r.clip_fraction, r.input_sqnr_db = st.get("clip_fraction"), st.get("input_sqnr_db")
            r.inputs = st.get("inputs", [])
    return SensitivityReport(target, float_score, int8_score, baseline.scored, rows,
                             len(candidates) + len(measured_only), time.perf_counter() - start,
                             done == len(evaluator.batches), base, "one-run", notes, model)
