"""Automatic fallback: rank quantized nodes by sensitivity, then fall them back greedily until the target holds.

1. Score the float model (for relative goals) and the INT8 model. If the INT8 model meets the target, stop.
2. Measure every candidate's sensitivity (`sensitivity.sensitivity_report`, one session per candidate,
   optionally in worker processes).
3. Most sensitive first, add each node to the fallen-back set and evaluate the cumulative model (one session
   per step); keep the node if the score improves, drop it otherwise. Stop when the target is met, when
   ``max_nodes`` nodes are in float, when ``max_time`` seconds have passed, or when candidates run out.

Total cost: at most ``2 × candidates + 2`` sessions, linear in the number of candidates. The result is always
the best model seen (fewest nodes among equal scores), with whether the target was met and why the search
stopped; the decision is written as a recipe patch that `qgraph run --patch` applies to the same QDQ model to
reproduce the same graph.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from qgraph import ModelError, NodeSelector, Pipeline, Recipe, get_pass
from qgraph.data import DataSource, model_inputs
from qgraph.executor import Executor, ExecutorSpec
from qgraph.outputs import write_atomic
from qgraph.sensitivity.evaluate import Evaluator, Progress, concat_outputs, load_feeds, reference_outputs
from qgraph.sensitivity.ranking import SensitivityReport, candidate_nodes, sensitivity_report
from qgraph.sensitivity.targets import Target, parse_target

PATCH_RECIPE_NAME = "float-fallback"


@dataclass
class AutoStep:
    """One greedy step: the node tried, the score with it, and whether it was kept."""

    node: str
    score: float
    kept: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "node": self.node,
            "score": self.score if math.isfinite(self.score) else str(self.score),
            "kept": self.kept,
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

    def message(self) -> str:
        """One paragraph: met or not, scores, nodes, why the search stopped."""
        verdict = "target met" if self.target_met else "target NOT met"
        return (
            f"{verdict}: {self.target.describe()} (threshold {self.threshold:.6g}); float {self.float_score:.6g}, "
            f"full INT8 {self.int8_score:.6g}, best {self.score:.6g} with {len(self.nodes)} node(s) in float"
            f"{': ' + ', '.join(self.nodes) if self.nodes else ''}. Search stopped: {self.stop_reason}."
        )

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
    progress: Progress | None = None,
    report_only: bool = False,
    executor: ExecutorSpec | Executor | None = None,
) -> AutoResult:
    """Find a small set of nodes to keep in float so that ``qdq`` meets ``target`` (see module docs).

    ``reference`` is the float model the outputs are compared with, ``data`` the evaluation data,
    ``keep_float`` nodes that are in float regardless (counted in ``max_nodes``), ``executor`` where the
candidates are measured (`qgraph.executor`; default: ``jobs`` local processes). With ``report_only`` the
    sensitivity table is measured and no search is made. Never raises for an unmet target: check
    ``target_met``.
    """
    start = time.monotonic()
    deadline = start + max_time if max_time is not None else None
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
    refs = concat_outputs(refs_per_batch) if tgt.needs_outputs else None
    float_score = tgt.score([], refs, refs)
    threshold = tgt.threshold(float_score)
    chosen = list(keep_float)
    base = evaluator.measure(chosen)
    int8_score = best = tgt.score(base.diffs, base.outputs, refs)
    found, notes = candidate_nodes(evaluator.variant(chosen), candidates)

    def result(reason: str, report: SensitivityReport | None, steps: list[AutoStep]) -> AutoResult:
        return AutoResult(
            build_model(qdq, chosen),
            list(chosen),
            tgt,
            tgt.met(best, threshold),
            best,
            threshold,
            float_score,
            int8_score,
            reason,
            report,
            steps,
            notes,
            time.monotonic() - start,
            shapes,
        )

    if tgt.met(best, threshold) and not report_only:
        return result("the INT8 model already meets the target", None, [])
    report = sensitivity_report(
        evaluator, tgt, found, base_nodes=chosen, jobs=jobs, deadline=deadline, progress=progress, executor=executor
    )
    if not report.complete:
        notes.append(
            f"max_time reached during sensitivity: {len(report.rows)} of {report.candidates} candidates measured"
        )
    if report_only:
        return result("report only", report, [])
    steps: list[AutoStep] = []
    reason = "no candidate left to fall back"
    for row in report.ranked():
        if tgt.met(best, threshold):
            break
        if max_nodes is not None and len(chosen) >= max_nodes:
            reason = f"max_nodes ({max_nodes}) reached"
            break
        if deadline is not None and time.monotonic() > deadline:
            reason = f"max_time ({max_time:g} s) reached"
            break
        trial = [*chosen, row.name]
        m = evaluator.measure(trial)
        score = tgt.score(m.diffs, m.outputs, refs)
        kept = tgt.gain(score, best) > 0
        steps.append(AutoStep(row.name, score, kept))
        if kept:
            chosen, best = trial, score
    if tgt.met(best, threshold):
        reason = "target met"
    elif deadline is not None and time.monotonic() > deadline and "max_" not in reason:
        reason = f"max_time ({max_time:g} s) reached"
    return result(reason, report, steps)
