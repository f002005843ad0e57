"""Automatic fallback: rank quantized nodes from one run, then search ranked prefixes in few full evaluations.

Stages (each timed, reported and shown as a progress bar):

1. **baseline**: score the float model (for relative goals) and the INT8 model (one full evaluation). If the
   INT8 model meets the target, stop.
2. **ranking**: one paired run ranks every candidate (`sensitivity.ranking.rank_nodes`), O(1) evaluations; the
   first ``exact_top`` are optionally measured exactly (one evaluation each).
3. **search** on prefixes ``P_m`` (the first ``m`` ranked nodes in float), full evaluations only
   (`qgraph.analysis.sensitivity.prefix`): start at the smallest ``m`` the noise model predicts to meet the target, then
   correct the prediction on the measured prefixes (secant steps), doubling while nothing meets the target and
   bisecting the bracket ``(largest failing, smallest meeting)`` when a correction does not halve it, until
   the smallest meeting prefix is found, ``max_nodes`` or the candidates run out. ``jobs`` prefixes are
   evaluated per round.
4. **confirmation**: the chosen model, built exactly as `qgraph run --patch` builds it, is evaluated once more;
   its score is the one reported.

``max_time`` is checked before every evaluation (an evaluation that would end after it is not started) and
between batches of the ranking run. The result is always the best model evaluated (the smallest prefix that
meets the target, else the highest score), with one sentence saying whether the target was met, what was tried
and how long each stage took; the decision is written as a recipe patch that `qgraph run --patch` applies to the
same QDQ model to reproduce the same graph.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from qgraph.analysis.sensitivity.cost import (
    LatencyModel,
    cost_aware_order,
    latency_summary,
    measure_latency,
    prefix_latency,
)
from qgraph.analysis.sensitivity.evaluate import (
    Evaluator,
    build_model,
    concat_outputs,
    first_sample,
    load_feeds,
    patch_recipe,
    reference_outputs,
    streamed_reference_outputs,
)
from qgraph.analysis.sensitivity.measured_cap import hold_measured_bound
from qgraph.analysis.sensitivity.options import SearchOptions
from qgraph.analysis.sensitivity.prefix import AutoStep, Clock, PrefixSearch
from qgraph.analysis.sensitivity.ranking import SensitivityReport, candidate_nodes, rank_nodes
from qgraph.analysis.sensitivity.targets import Target, parse_target
from qgraph.data import DataSource, model_inputs
from qgraph.errors import ModelError
from qgraph.graph import named_model
from qgraph.io.outputs import write_atomic
from qgraph.metrics import Interval
from qgraph.pipeline.recipe_text import recipe_yaml
from qgraph.quant.dynamic_graph import DYNAMIC_OPS
from qgraph.remedy.apply import body_candidates
from qgraph.runtime.executor import Executor, make_executor


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
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage
    evaluations: int = 0  # full model evaluations (baseline, exact measures, search, confirmation)
    latency: dict[str, float] = field(default_factory=dict)  # modelled (cost table) and measured, see `_latency`
    remedy: str = "float"  # what the chosen nodes became: float, a16w8 (16-bit activations) or a16w16
    float_model: str | None = None  # the float model file the chosen nodes' weights came from (the patch says so)
    #: The chosen model's score interval over the evaluation samples (built-in metrics, `qgraph.metrics.interval`)
    interval: Interval | None = None
    #: Why these samples cannot show the target met, whatever the model (`Target.data_limit`); None: they can
    data_limit: str | None = None

    @property
    def became(self) -> str:
        """What the chosen nodes became, as the message words it."""
        return {"float": "in float", "a16w8": "with 16-bit activations (a16w8)"}.get(
            self.remedy, f"with 16-bit activations and weights ({self.remedy})")

    def message(self) -> str:
        """One paragraph: met or not, scores, nodes, why the search stopped, what was tried and how long."""
        verdict = "target met" if self.target_met else "target NOT met"
        shown = self.nodes if len(self.nodes) <= 8 else [*self.nodes[:8], f"... {len(self.nodes) - 8} more"]
        return (f"{verdict}: {self.target.describe()} (threshold {self.threshold:.6g}); {self.scores()} with "
                f"{len(self.nodes)} node(s) {self.became}{': ' + ', '.join(shown) if shown else ''}. Search stopped: "
                f"{self.stop_reason}.{self.spread()} {self.tried()}{self.latency_sentence()}")

    def spread(self) -> str:
        """How far the chosen model's score could move on other samples of the same kind (' ...' or ''), and
        whether the threshold lies within that: a target met on few samples may not hold on the next ones."""
        iv = self.interval
        if iv is None:
            return ""
        text = f" The score's {iv.describe()}"
        beyond = iv.low < self.threshold if self.target.higher_is_better else iv.high > self.threshold
        if self.target_met and beyond:
            text += (": the threshold lies within it, so on other data of this kind the target may not hold (more "
                     "evaluation samples, auto.data, narrow it)")
        return text + "."

    def scores(self) -> str:
        """``full INT8 20.5 dB, best 44.7 dB``; the float model's own score only for a user metric (against
        itself it is inf dB or cosine 1)."""
        fmt, kind = ("{:.1f} dB" if self.target.kind == "sqnr" else "{:.6g}").format, self.target.kind
        own = f"float {fmt(self.float_score)}, " if kind not in ("sqnr", "cosine") else ""
        return f"{own}full INT8 {fmt(self.int8_score)}, best {fmt(self.score)}"

    def latency_sentence(self) -> str:
        """Modelled and measured latency of the chosen model relative to float, as one sentence ('' if none).
        "Float" is the reference compared with: after ``insert_qdq`` in a recipe, the prepared float model (its
        fusions included), which can be faster than the model file the recipe started from."""
        lat, parts = self.latency, []
        if "modelled_chosen_ratio" in lat:
            parts.append(f"modelled (cost table) {lat['modelled_chosen_ratio']:.2f}x float "
                         f"(full INT8 {lat['modelled_int8_ratio']:.2f}x)")
        if "measured_chosen" in lat:
            parts.append(f"measured {lat['measured_chosen']:.2f}x the float reference (full INT8 "
                         f"{lat['measured_int8']:.2f}x, float {lat['measured_float_ms']:.1f} ms)")
        return f" Latency of the chosen model: {'; '.join(parts)}." if parts else ""

    def tried(self) -> str:
        """What was tried and how long each stage took, in one sentence."""
        parts = [f"baseline {self.stages.get('baseline', 0.0):.1f} s"]
        if self.sensitivity is not None:
            exact = sum(r.measured for r in self.sensitivity.rows) if self.sensitivity.method != "exact" else 0
            parts.append(f"ranking of {self.sensitivity.candidates} node(s) from one run"
                         f"{f' + {exact} exact' if exact else ''} {self.stages.get('ranking', 0.0):.1f} s")
        if self.steps:
            sizes = ", ".join(str(s.size) for s in self.steps)
            parts.append(f"search over ranked prefixes of {sizes} node(s) ({len(self.steps)} evaluation(s)) "
                         f"{self.stages.get('search', 0.0):.1f} s")
        if "confirmation" in self.stages:
            parts.append(f"confirmation {self.stages['confirmation']:.1f} s")
        return f"Tried: {'; '.join(parts)}; {self.evaluations} full evaluation(s) in {self.seconds:.1f} s."

    def recipe(self) -> dict[str, Any] | None:
        """The decision as a one-pass recipe mapping (None when no node needs to go back to float);
        ``Recipe.from_dict`` makes it a `Recipe`."""
        if not self.nodes:
            return None
        return patch_recipe(self.nodes, self.remedy, self.float_model)

    def patch_yaml(self) -> str | None:
        """The recipe patch text (``name`` + ``passes``), commented with the outcome; None if no node."""
        recipe = self.recipe()
        if recipe is None:
            return None
        header = [
            "# float_fallback patch written by qgraph (automatic fallback).",
            f"# {'Target met' if self.target_met else 'Target NOT met'}: {self.target.describe()}; {self.scores()}.",
            "# Apply to the same QDQ model: qgraph run RECIPE MODEL --patch THIS_FILE -o OUT.onnx,",
            "# or paste the float_fallback entry at the end of the recipe's passes.",
        ]
        return "\n".join(header) + "\n" + recipe_yaml(recipe)

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
            "candidates": self.sensitivity.candidates if self.sensitivity is not None else None,
            "stop_reason": self.stop_reason,
            "stages": {k: round(v, 3) for k, v in self.stages.items()},
            "evaluations": self.evaluations,
            "steps": [s.to_dict() for s in self.steps],
            "remedy": self.remedy,
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
            "latency": {k: num(v) for k, v in self.latency.items()},
            "interval": self.interval.to_dict() if self.interval is not None else None,
            "data_limit": self.data_limit,
            "sensitivity": self.sensitivity.to_dict() if self.sensitivity else None,
        }


def auto_fallback(
    reference: onnx.ModelProto,
    qdq: onnx.ModelProto,
    data: str | DataSource,
    target: Target | str,
    options: SearchOptions | None = None,
) -> AutoResult:
    """Find a small set of nodes to keep in float so that ``qdq`` meets ``target`` (see module docs).

    ``reference`` is the float model the outputs are compared with, ``data`` the evaluation data; how the search
    runs is `SearchOptions` (candidates, budgets, executor, cost table, remedy, ...). With ``recurrence`` every
    full evaluation runs streamed, each model fed its own state; the one-run ranking stays per sample (states from
    the data), its prediction corrected on the streamed measurements. Never raises for an unmet target."""
    o = options or SearchOptions()
    pool = make_executor(o.executor, o.jobs)
    try:
        return _auto_fallback(reference, qdq, data, target, o, pool)
    finally:
        if pool is not o.executor:
            pool.close()


def _auto_fallback(reference: onnx.ModelProto, qdq: onnx.ModelProto, data: str | DataSource, target: str | Target,
                   o: SearchOptions, pool: Executor) -> AutoResult:
    """`auto_fallback` with its executor made."""
    run = Clock(time.monotonic(), o.max_time, o.progress)
    tgt = parse_target(target) if isinstance(target, str) else target
    # Named once, as GraphHandle names on load: every variant, candidate and patch uses the names reports show.
    qdq, naming = named_model(qdq)
    _check_pair(reference, qdq)
    batches = load_feeds(data, reference, samples=o.samples, batch_size=1 if o.recurrence else o.batch_size,
                         others=[qdq])
    shapes = {k: tuple(v.shape) for k, v in first_sample(batches[0], reference).items()}
    starts: list[int] = []
    if o.recurrence is None:
        refs_per_batch = reference_outputs(reference, batches, o.kernels)
    else:
        refs_per_batch, starts = streamed_reference_outputs(reference, batches, o.recurrence, o.kernels)
    evaluator = Evaluator(qdq, batches, refs_per_batch, keep_outputs=tgt.needs_outputs, kernels=o.kernels,
                          float_weights=o.float_weights, recurrence=o.recurrence, starts=starts, remedy=o.remedy,
                          parts=o.parts)
    run.refs = concat_outputs(refs_per_batch) if tgt.needs_outputs else None
    float_score = tgt.score([], run.refs, run.refs)
    threshold = tgt.threshold(float_score)
    chosen = list(o.keep_float)
    base = evaluator.measure(chosen)
    run.evaluations, run.eval_seconds = 1, [base.seconds]
    int8_score = run.int8_score = tgt.score(base.scored, base.outputs, run.refs)
    run.stage_end("baseline")
    found, notes = candidate_nodes(evaluator.variant(chosen), o.candidates, dynamic=o.remedy == "float")
    if notice := naming.notice():
        notes.insert(0, f"QDQ model: {notice}")
    inside: list[tuple[str, str]] = []
    if o.in_bodies:
        inside, more = body_candidates(evaluator.variant(chosen), o.candidates)
        notes.extend(more)
    out = AutoResult(evaluator.variant(chosen), list(chosen), tgt, tgt.met(int8_score, threshold), int8_score,
                     threshold, float_score, int8_score, "", None, [], notes, 0.0, shapes, remedy=o.remedy,
                     data_limit=tgt.data_limit(run.refs, threshold))
    if out.target_met and not o.report_only:
        out.interval = tgt.interval(base.outputs, run.refs)
        return _finish(run, out, "the INT8 model already meets the target")
    report = rank_nodes(evaluator, tgt, found, base, base_nodes=chosen, exact_top=o.exact_top,
                        deadline=run.deadline, progress=run.reporter("ranking"), exact_progress=run.reporter("exact"),
                        stats=o.report_only, executor=pool, measured_only=inside)
    run.evaluations += sum(r.measured for r in report.rows)
    out.sensitivity = report
    notes.extend(report.notes)
    run.stage_end("ranking")
    if o.report_only:
        return _finish(run, out, "report only")
    latency = LatencyModel(qdq, o.costs.table, o.costs.preset, shapes) if o.costs is not None else None
    order = _order(report, latency if _rank_by(o.rank_by, qdq, notes) == "latency" else None, chosen)
    cap = len(order) if o.max_nodes is None else max(0, min(len(order), o.max_nodes - len(chosen)))
    slow = _latency_cap(latency, order[:cap], o.max_latency)
    cap = min(cap, slow) if slow is not None else cap
    predicted = report.model.prefix_scores(tgt, order[:cap]) if report.model is not None else []
    search = PrefixSearch(evaluator, tgt, threshold, chosen, order, cap, run, pool)
    size, reason = search.run(predicted, o.max_nodes)
    reason = _modelled_cap_reason(reason, slow, cap, o.max_latency)
    if size and o.max_latency is not None and o.latency_rounds > 0 and latency is not None and run.time_left(2):
        size, reason = hold_measured_bound(size, reason, o.max_latency, o.latency_rounds, reference, evaluator,
                                           chosen, order, lambda: run.time_left(2), notes)
    out.steps = search.steps
    run.stage_end("search")
    if size:
        out.nodes = [*chosen, *order[:size]]
        out.model = build_model(qdq, out.nodes, o.float_weights, o.remedy)
        if run.time_left(1) or size not in search.scores:  # a prefix cut back by timing is not scored yet
            tick = run.reporter("confirmation")
            if tick is not None:
                tick(0, 1)
            confirmed = evaluator.run(out.model, out.nodes)
            run.evaluations += 1
            out.score = tgt.score(confirmed.scored, confirmed.outputs, run.refs)
            out.interval = tgt.interval(confirmed.outputs, run.refs)
            if tick is not None:
                tick(1, 1)
            run.stage_end("confirmation")
        else:
            out.score = search.scores[size]
            notes.append("not confirmed: max_time reached (the score is the search's evaluation of the same nodes)")
    out.target_met = tgt.met(out.score, threshold)
    _latency(out, latency, chosen, o.latency_rounds, reference, evaluator)
    return _finish(run, out, "target met" if out.target_met else reason)


def _modelled_cap_reason(reason: str, slow: int | None, cap: int, max_latency: float | None) -> str:
    """The stop reason, naming ``max_latency`` when the modelled bound is what ended the search."""
    if slow is None or slow != cap or not reason.startswith(("max_nodes", "every candidate")):
        return reason
    return f"max_latency reached: more than {cap} node(s) in float is modelled slower than {max_latency:g}x float"

def _rank_by(asked: str, qdq: onnx.ModelProto, notes: list[str]) -> str:
    """``asked``, except that a model with dynamically quantized MatMuls is ranked by error (the cost table
    prices static Q/DQ boundaries; a dynamic MatMul quantizes its input at run time), with a note saying so."""
    if asked == "latency" and any(n.op_type in DYNAMIC_OPS for n in qdq.graph.node):
        notes.append("dynamically quantized MatMuls: ranked by output error alone (the cost table models static "
                     "Q/DQ boundaries, not run-time quantization)")
        return "error"
    return asked


def _check_pair(reference: onnx.ModelProto, qdq: onnx.ModelProto) -> None:
    """The float and Q/DQ models take the same inputs and give as many outputs (else `ModelError`)."""
    ref_inputs, qdq_inputs = [i.name for i in model_inputs(reference)], [i.name for i in model_inputs(qdq)]
    if sorted(ref_inputs) != sorted(qdq_inputs) or len(reference.graph.output) != len(qdq.graph.output):
        raise ModelError(
            f"the float and QDQ models do not match: inputs {ref_inputs} vs {qdq_inputs}, "
            f"{len(reference.graph.output)} vs {len(qdq.graph.output)} outputs. Give the float model the QDQ "
            "model was made from."
        )


def _latency_cap(latency: LatencyModel | None, order: Sequence[str], limit: float | None) -> int | None:
    """The largest prefix of ``order`` whose modelled latency is at most ``limit`` x the float model's (None: no
    limit or no cost model)."""
    if latency is None or limit is None:
        return None
    bound = limit * latency.all_float()
    times = prefix_latency(latency, order)
    return max((m for m, t in enumerate(times) if t <= bound), default=0)


def _order(report: SensitivityReport, latency: LatencyModel | None, base: Sequence[str]) -> list[str]:
    """The search order: the report's rows (error only), or error bought per added latency."""
    rows = [r.name for r in report.rows]
    if latency is None or report.model is None:
        return rows
    state = latency.snapshot()
    for name in base:
        latency.set_float(name)
    ranked = cost_aware_order(report.model, latency)
    latency.restore(state)
    seen = set(ranked)
    return ranked + [n for n in rows if n not in seen]


def _latency(out: AutoResult, latency: LatencyModel | None, base: Sequence[str], rounds: int,
             reference: onnx.ModelProto, evaluator: Evaluator) -> None:
    """Modelled and (``rounds`` > 0) measured latency of the chosen model, into ``out.latency``."""
    if latency is not None:
        modelled = latency_summary(latency, base, out.nodes)
        # A model whose compute sits in If/Loop bodies has nothing the cost table models: no ratio to report.
        if all(math.isfinite(v) for v in modelled.values()):
            out.latency.update(modelled)
    if rounds > 0 and len(out.nodes) > len(base):
        feed = first_sample(evaluator.batches[0], reference)
        measured = measure_latency({"float": reference, "int8": evaluator.variant(base), "chosen": out.model}, feed,
                                   rounds)
        out.latency.update({f"measured_{k}": v for k, v in measured.items() if k != "float"})
        out.latency["measured_float_ms"] = measured["float_ms"]


def _finish(clock: Clock, out: AutoResult, reason: str) -> AutoResult:
    """Stamp the stop reason, timings and evaluation count on ``out``."""
    out.stop_reason = reason
    out.seconds = time.monotonic() - clock.start
    out.stages = dict(clock.stages)
    out.evaluations = clock.evaluations
    return out
