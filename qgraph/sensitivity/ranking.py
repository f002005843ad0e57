"""Per-node sensitivity: how much the model output improves when only that node is returned to float.

Definition. For each quantized node ``n`` of the QDQ model ``M``, sensitivity is the gain in the target score
(output cosine, output SQNR in dB, or the user metric) of ``M`` with only ``n`` fallen back, over ``M`` itself:
``score(fall_back(M, {n})) - score(M)``.

Why "only this node returned to float" and not "only this node quantized":

- it measures exactly the move the greedy search makes. The search starts from the deployed INT8 model and
  falls nodes back one at a time, so the first-order estimate of a step's benefit is that node's
  leave-one-out gain, measured *with every other node quantized*: error that a node's quantization causes
  and downstream quantized layers amplify (or mask) is counted, as it is in deployment;
- it is built with the same rewrite the final model is built with (`qdq_edit.fall_back`), so a node is
  ranked by what falling it back really changes on this QDQ model, including pairs it shares with quantized
  neighbours (which stay), and it works on any QDQ model. "Only this node quantized" would need a float model
  whose nodes map onto the QDQ nodes and would measure each node in a float context it never runs in;
- in the usual regime where quantization noises add up, both definitions rank the same nodes first, so
  nothing is lost for ranking.

Cost: one onnxruntime session per candidate (built once, then every evaluation batch goes through it), plus
one for the float reference and one for the INT8 baseline: linear in the number of candidates. Candidates
are independent, so ``jobs > 1`` measures them in that many worker processes, and ``executor`` (`qgraph.executor`)
runs them as Ray tasks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx

from qgraph import GraphHandle, NodeSelector, PassError, select
from qgraph.compare import TensorDiff
from qgraph.executor import Executor, ExecutorSpec
from qgraph.fallback import quantized_nodes
from qgraph.sensitivity.evaluate import Evaluator, Progress, concat_outputs, measure_all
from qgraph.sensitivity.stats import range_stats
from qgraph.sensitivity.targets import Target


@dataclass
class NodeSensitivity:
    """One row of the sensitivity table."""

    name: str
    op: str
    sensitivity: float  # target gain (positive = falling back helps)
    score: float  # target score with only this node in float
    cosine: float
    sqnr_db: float
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
    baseline: list[TensorDiff]
    rows: list[NodeSensitivity]
    candidates: int
    seconds: float
    complete: bool = True
    base_nodes: tuple[str, ...] = ()

    def ranked(self) -> list[NodeSensitivity]:
        """Rows, most sensitive first (ties in graph order)."""
        return sorted(self.rows, key=lambda r: -r.sensitivity if math.isfinite(r.sensitivity) else math.inf)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "definition": "gain in the target score when only this node is returned to float",
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
    qdq: onnx.ModelProto, restrict: NodeSelector | None = None
) -> tuple[list[tuple[str, str]], list[str]]:
    """``(name, op)`` of every quantized, uniquely named node (optionally within ``restrict``), and notes."""
    handle = GraphHandle(qdq)
    nodes = quantized_nodes(handle)
    notes: list[str] = []
    if restrict is not None:
        sel = select(handle, restrict)
        if sel.unmatched:
            raise PassError(
                f"float_fallback: candidate selector ({restrict.describe()}): "
                + "; ".join(sel.unmatched)
                + ". Fix the names/patterns (see `qgraph inspect`)."
            )
        inside = {id(n) for n in sel.nodes}
        nodes = [n for n in nodes if id(n) in inside]
    counts: dict[str, int] = {}
    for n in handle.index.nodes:
        counts[n.name] = counts.get(n.name, 0) + 1
    unusable = [n for n in nodes if not n.name or counts[n.name] > 1]
    if unusable:
        notes.append(
            f"{len(unusable)} quantized node(s) without a unique name cannot be fallen back by name "
            f"and were not considered: {', '.join(repr(n.name) for n in unusable[:5])}"
        )
    return [(n.name, n.op) for n in nodes if n not in unusable], notes


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
    executor: ExecutorSpec | Executor | None = None,
) -> SensitivityReport:
    """Measure every candidate (leave-one-out from the INT8 model with ``base_nodes`` already in float)."""
    start = time.perf_counter()
    base = tuple(base_nodes)
    refs = concat_outputs(evaluator.reference) if target.needs_outputs else None
    float_score = target.score([], refs, refs)  # cosine 1, SQNR inf, or the metric on the float outputs
    base_m = evaluator.measure(base)
    int8_score = target.score(base_m.diffs, base_m.outputs, refs)
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
        score = target.score(m.diffs, m.outputs, refs)
        st = extra.get(name, {})
        rows.append(
            NodeSensitivity(
                name,
                ops[name],
                target.gain(score, int8_score),
                score,
                min(d.cosine for d in m.diffs),
                min(d.sqnr_db for d in m.diffs),
                st.get("clip_fraction"),
                st.get("input_sqnr_db"),
                st.get("inputs", []),
            )
        )
    return SensitivityReport(
        target,
        float_score,
        int8_score,
        base_m.diffs,
        rows,
        len(candidates),
        time.perf_counter() - start,
        len(rows) == len(candidates),
        base,
    )
