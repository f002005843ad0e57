"""Run reports (``qgraph run --report FILE``): what every pass did and what it cost in accuracy.

``.json`` writes the data, ``.html`` one self-contained page (no script, no CDN, no URL) with the recipe, a
per-pass table (time, counts, structural diff summary), the per-stage fidelity table (float original → after
each pass → final, on the calibration data when there is some, else on seeded random inputs), the per-layer
error chart of the final model against the original, QDQ coverage, the nodes passes left alone and why, and
fallback decisions when a pass reports them in its details.

Per-pass diffs and per-stage fidelity need the model after each pass: `qgraph.pipeline.runner.Pipeline.run` keeps
them with ``keep_stages=True``. When the result has no stages, the recipe is run again with it (passes are
deterministic), and the report says so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qgraph.analysis.diff.attribution import Attribution
from qgraph.analysis.diff.culprits import attribute
from qgraph.analysis.diff.graphview import changed_regions_html
from qgraph.analysis.diff.html import esc, page, section, table, write_text_atomic
from qgraph.analysis.diff.layers import NumericDiff
from qgraph.analysis.diff.numeric import numeric_diff
from qgraph.analysis.diff.provenance import Skip, float_reasons
from qgraph.analysis.diff.qdq import QdqCoverage, qdq_coverage
from qgraph.analysis.diff.render import coverage_html, dumps, numeric_html
from qgraph.analysis.diff.render_culprits import culprits_html
from qgraph.analysis.diff.structural import structural_diff
from qgraph.analysis.diff.tables import sqnr_cell
from qgraph.analysis.report_summary import culprits_context, first_screen_html
from qgraph.data import Feed
from qgraph.errors import QGraphError
from qgraph.pipeline.pass_result import PassResult
from qgraph.pipeline.recipe import Recipe
from qgraph.pipeline.runner import PipelineResult
from qgraph.pipeline.timing import run_timing
from qgraph.runtime.class_outputs import class_outputs
from qgraph.runtime.compare import ORT_ERRORS, TensorDiff, random_feeds, run
from qgraph.runtime.evaluation import Evaluation, concat, top1_agreement
from qgraph.runtime.kernels.measure import Kernels, deployed, saturation_of
from qgraph.runtime.output_parts import OutputParts, PartDiffs, output_parts_of

#: Samples of the calibration data used for fidelity (random inputs when there is no data).
REPORT_SAMPLES = 8
RANDOM_SAMPLES = 4
_RUNTIME_ERRORS: tuple[type[Exception], ...] = (QGraphError, *ORT_ERRORS)


def write_report(path: Path, recipe: Recipe, result: PipelineResult, evaluation: Evaluation | None = None,
                 check: dict[str, Any] | None = None) -> None:
    """Write the report of ``result`` (produced by ``recipe``): JSON for ``.json``, HTML for ``.html``; measured
    on ``evaluation`` (held-out data, labels, metric) when given, else on the calibration data. ``check`` is the
    end-of-run fidelity check (`qgraph.analysis.fidelity.OutputCheck.to_dict`), kept as is in the JSON."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".json", ".html", ".htm"):
        raise QGraphError(f"--report {path}: unknown report format {suffix or '(none)'}; use .json or .html.")
    report = build_report(recipe, result, evaluation)
    report.check = check
    write_text_atomic(path, dumps(report.to_dict()) if suffix == ".json" else report_html(report))


@dataclass
class RunReport:
    """What a report shows; `to_dict` is the JSON report, `report_html` renders it."""

    recipe: dict[str, str]
    data: str
    passes: list[dict[str, Any]]
    coverage: QdqCoverage
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    fidelity: list[dict[str, Any]] = field(default_factory=list)
    layers: NumericDiff | None = None
    skipped: list[dict[str, str]] = field(default_factory=list)
    fallback: list[dict[str, Any]] = field(default_factory=list)
    #: What every pass decided (raised opsets, fallbacks, host-dependent choices) and selector criteria that
    #: matched nothing: {"pass", "kind": "decision" | "matched nothing", "text"}.
    decisions: list[dict[str, str]] = field(default_factory=list)
    #: Q/DQ pairs ranked by the output error they cause, against the float model the quantizing pass received.
    attribution: Attribution | None = None
    graph_view: str = ""  # the changed regions as inline SVG (HTML only)
    #: The fidelity check ``qgraph run`` printed (`qgraph.analysis.fidelity`), None when it did not run.
    check: dict[str, Any] | None = None
    #: Every pass's time against the calibration's (`qgraph.pipeline.timing`), None when no pass calibrated from data.
    timing: dict[str, Any] | None = None
    #: How the fidelity was measured (`qgraph.runtime.kernels.measure.KernelChoice.to_dict`).
    kernels: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``culprits``: the Q/DQ pairs, best first)."""
        att = self.attribution
        return {
            "recipe": self.recipe, "data": self.data, "notes": self.notes, "summary": self.summary,
            "culprits": [c.to_dict() for c in att.culprits] if att is not None else [],
            "attribution": {k: v for k, v in att.to_dict().items() if k != "culprits"} if att is not None else None,
            "passes": self.passes, "fidelity": self.fidelity,
            "layers": self.layers.to_dict() if self.layers is not None else None,
            "coverage": self.coverage.to_dict(), "skipped": self.skipped, "fallback": self.fallback,
            "decisions": self.decisions, "check": self.check, "timing": self.timing, "kernels": self.kernels,
        }


def _measured(report: RunReport) -> str:
    """``Measured with ...`` (the kernels every stage ran with), empty when unknown."""
    k = report.kernels
    if not k:
        return ""
    text = f"Measured with {k['kernels']['description']}."
    return f"{k['mismatch']}. {text}" if k.get("mismatch") else text


def _feeds(result: PipelineResult, model: onnx.ModelProto) -> tuple[list[Feed], str]:
    data = result.calibration_data
    desc = "(the calibration data: not held out; give --eval-data for held-out numbers)"
    if data is not None:
        feeds: list[Feed] = []
        for feed in data:
            feeds.append(feed)
            if len(feeds) >= REPORT_SAMPLES:
                break
        if feeds:
            return feeds, f"{len(feeds)} sample(s) of {data.description} {desc}"
    return random_feeds(model, RANDOM_SAMPLES), f"{RANDOM_SAMPLES} seeded random input(s) (no data given)"


def _stages(recipe: Recipe, result: PipelineResult) -> tuple[list[onnx.ModelProto], list[str]]:
    if len(result.stages) == len(result.records):
        return result.stages, []
    if result.input_model is None:
        return [], ["the pipeline result carries neither stages nor its input model: no per-stage data."]
    rerun = recipe.pipeline().run(result.input_model, calibration_data=result.calibration_data, keep_stages=True)
    return rerun.stages, ["stages recomputed by running the recipe again (run the pipeline with keep_stages=True "
                          "to avoid it)."]


def stage_fidelity(reference: onnx.ModelProto | str | Path,
                   stages: Sequence[tuple[str, onnx.ModelProto | str | Path]],
                   feeds: list[Feed], evaluation: Evaluation | None = None,
                   parts: OutputParts | None = None, kernels: Kernels | None = None,
                   reference_kernels: Kernels | None = None) -> list[dict[str, Any]]:
    """Per stage and output (by position): SQNR, cosine, max abs, relative error, top-1 agreement, and the count
    of NaN/Inf values in the reference and the stage (models in memory or as files); after an output that a final
    Concat joins, one row per part (``part_of``: the output; `qgraph.runtime.output_parts`, found in ``reference``
    unless ``parts`` are given).

    The reference outputs are computed once; each stage's outputs are folded into accumulators sample by sample.
    A stage onnxruntime cannot load or run gets a row with its error instead. Stages run with ``kernels``, the
    reference with ``reference_kernels`` (both default to this host's deployed kernels: `qgraph.runtime.kernels`); a row
    of an emulated AVX2 stage lists the layers that saturated (``saturation``).
    """
    layout = parts if parts is not None else output_parts_of(reference)
    classes = class_outputs(reference)  # top-1 agreement for class scores only
    ref_sess = (reference_kernels or deployed()).session(reference)
    names = [o.name for o in ref_sess.get_outputs()]
    refs = [run(ref_sess, f) for f in feeds]
    metric_of = evaluation.metric_and_interval if evaluation is not None and evaluation.metric is not None else None
    ref_all = [concat([r[n] for r in refs]) for n in names] if metric_of else []
    rows: list[dict[str, Any]] = []
    for label, model in stages:
        accs = PartDiffs(layout, names)
        top1 = [[0, 0] for _ in names]
        got_all: list[list[np.ndarray]] = [[] for _ in names]
        try:
            sess = (kernels or deployed()).session(model, count=True)
            cand = [o.name for o in sess.get_outputs()]
            if len(cand) != len(names):
                raise QGraphError(f"the stage has {len(cand)} outputs, the original {len(names)}")
            for feed, ref in zip(feeds, refs, strict=True):
                got = run(sess, feed)
                accs.add([ref[n] for n in names], [got[c] for c in cand])
                for i, (name, other) in enumerate(zip(names, cand, strict=True)):
                    if metric_of:
                        got_all[i].append(got[other])
                    need = classes.get(name)
                    agree = top1_agreement(np.asarray(ref[name]), np.asarray(got[other]), need) if need else None
                    if agree is not None:
                        count = int(np.shape(ref[name])[0])
                        top1[i] = [top1[i][0] + round(agree * count), top1[i][1] + count]
        except _RUNTIME_ERRORS as exc:
            rows.append({"stage": label, "output": "", "error": str(exc).splitlines()[0][:300]})
            continue
        scores = metric_of([concat(g) for g in got_all], ref_all) if metric_of else (None, None)
        first = len(rows)
        for (d, cut), (hits, total) in zip(accs.by_output(), top1, strict=True):
            rows.append(_fidelity_row(label, d, hits / total if total else None, scores))
            rows += [_fidelity_row(label, p, None, scores) for p in cut]
        saturated = [c.to_dict() for c in saturation_of(sess)]
        if saturated and len(rows) > first:  # on the stage's first row: the layers, not an output's
            rows[first]["saturation"] = saturated
    return rows


def _fidelity_row(stage: str, d: TensorDiff, top1: float | None, scores: tuple[float | None, Any]) -> dict[str, Any]:
    """One row of `stage_fidelity` (a part's row names its output in ``part_of``); ``scores``: metric, interval."""
    row = {"stage": stage, "output": d.name, "sqnr_db": d.sqnr_db, "cosine": d.cosine, "max_abs": d.max_abs,
           "relative": d.relative, "top1_agreement": top1, "metric": scores[0], "metric_interval": scores[1],
           "nonfinite_reference": d.nonfinite_reference, "nonfinite_candidate": d.nonfinite_candidate}
    if d.part is not None:
        row["part_of"] = d.part.output
    return row


def build_report(recipe: Recipe, result: PipelineResult, evaluation: Evaluation | None = None) -> RunReport:
    """Compute everything the report shows (see module docs)."""
    source = result.input_model
    stages, notes = _stages(recipe, result)
    if evaluation is not None:
        feeds, feeds_desc = evaluation.feeds, evaluation.describe()
    else:
        feeds, feeds_desc = _feeds(result, source if source is not None else result.model)
    passes: list[dict[str, Any]] = []
    previous = source
    for i, rec in enumerate(result.records):
        row: dict[str, Any] = {
            "index": i, "pass": rec.name, "config": rec.config, "seconds": rec.seconds,
            "peak_rss_mb": rec.peak_rss_mb, "preserves_float": rec.preserves_float,
            "nodes_before": rec.nodes_before, "nodes_after": rec.nodes_after, **rec.result.to_dict(),
            "verify_worst_relative": max((d.relative for d in rec.verify), default=None) if rec.verify else None,
            "verify_tolerance": _verify_tolerance(result, rec.verify),
            **({"nested": [n.to_dict() for n in rec.nested]} if rec.nested else {}),
        }
        if i < len(stages) and previous is not None:
            sd = structural_diff(previous, stages[i])
            row["structural"] = sd.summary()
            row["structural_short"] = sd.short()
            previous = stages[i]
        passes.append(row)
    reasons = float_reasons([*(Skip(r.name, r.quantizes, s.node, s.reason, True) for r in result.records
                                 for s in r.result.kept_float),
                             *(Skip(r.name, r.quantizes, s.node, s.reason) for r in result.records
                               for s in r.result.skipped)])
    report = RunReport(
        recipe={"name": recipe.name, "yaml": recipe.to_yaml(), "sha256": recipe.sha256()},
        data=feeds_desc,
        passes=passes,
        coverage=qdq_coverage(result.model, reasons),
        notes=notes,
        skipped=[{"pass": r.name, "node": s.node, "reason": s.reason} for r in result.records
                 for s in r.result.skipped],
        fallback=[{"pass": r.name, "details": r.result.details_dict(), "notes": r.result.notes}
                  for r in result.records if _is_fallback(r.name, r.result.details_dict())],
        decisions=[{"pass": r.name, "kind": kind, "text": text} for r in result.records
                   for kind, text in _decisions(r.result)],
    )
    tol = result.verify_tolerance
    if tol is not None and (tol.raised or tol.note):  # host-dependent: shown here, never in the model
        report.decisions.insert(0, {"pass": "--verify", "kind": "host-dependent", "text": tol.describe()})
    report.decisions[:0] = [{"pass": "load", "kind": "decision", "text": t} for t in result.load_decisions]
    timing = run_timing(result.records, result.float_inference)
    if timing is not None:
        report.timing = timing.to_dict()
        report.decisions.append({"pass": "run", "kind": "timing", "text": timing.line()})
    if source is None:
        report.notes.append("no input model in the result: no fidelity or per-layer data.")
        return report
    report.summary = structural_diff(source, result.model).summary()
    labelled = [("float original", source)]
    labelled += [(f"after #{i} {r.name}", stages[i]) for i, r in enumerate(result.records) if i < len(stages)]
    labelled.append(("final", result.model))
    choice = result.kernel_choice
    report.fidelity = stage_fidelity(source, labelled, feeds, evaluation,
                                     kernels=choice.kernels if choice is not None else None)
    if choice is not None:
        report.kernels = choice.to_dict()
        if choice.mismatch:
            report.decisions.insert(0, {"pass": "measure", "kind": "host-dependent", "text": choice.mismatch})
    try:
        report.layers = numeric_diff(source, result.model, feeds)
    except _RUNTIME_ERRORS as exc:
        report.notes.append(f"per-layer diff failed: {str(exc).splitlines()[0][:300]}")
    float_model = _last_float_stage(source, stages)
    if float_model is not result.model and qdq_coverage(result.model).dequantize_nodes:
        try:
            report.attribution = attribute(float_model, result.model, feeds)
        except _RUNTIME_ERRORS as exc:
            report.notes.append(f"Q/DQ attribution failed: {str(exc).splitlines()[0][:300]}")
    report.graph_view = changed_regions_html(source, result.model, report.layers)
    return report


def _verify_tolerance(result: PipelineResult, diffs: Sequence[TensorDiff] | None) -> float | None:
    """The tolerance ``--verify`` held the pass's worst output (by relative error) to, None when not verified."""
    tol = result.verify_tolerance
    if tol is None or not diffs:
        return None
    worst = max(range(len(diffs)), key=lambda i: diffs[i].relative)
    return tol.for_output(worst)


def _last_float_stage(source: onnx.ModelProto, stages: Sequence[onnx.ModelProto]) -> onnx.ModelProto:
    """The model the first quantizing pass received (its float weights are the ones that were quantized)."""
    previous = source
    for stage in stages:
        if qdq_coverage(stage).dequantize_nodes:
            return previous
        previous = stage
    return previous


def _decisions(result: PassResult) -> list[tuple[str, str]]:
    """A pass's decisions as (kind, text): those needing attention first (`PassResult.decide`), then the others,
    then its selector criteria that matched nothing."""
    flagged = set(result.attention)
    return [*(("attention", t) for t in result.attention), *(("decision", t) for t in result.decisions
                                                              if t not in flagged),
            *(("matched nothing", t) for t in result.unmatched)]


def _is_fallback(name: str, details: dict[str, Any]) -> bool:
    return "fallback" in name or any("fallback" in str(k) for k in details)


# --------------------------------------------------------------------------------------------- HTML
def _details_html(value: Any) -> str:
    if isinstance(value, dict) and value:
        return table(["key", "value"], [[k, _flat(v)] for k, v in value.items()])
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        keys = list(dict.fromkeys(k for v in value for k in v))
        return table(keys, [[_flat(v.get(k, "")) for k in keys] for v in value])
    return f"<pre>{esc(json.dumps(value, indent=2, default=str))}</pre>"


def _flat(v: Any) -> Any:
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=str)[:2000]
    return v


def report_html(report: RunReport) -> str:
    """The report page (tables with stable ids: ``passes``, ``fidelity``, ``outputs``, ``layer-chart``...)."""
    s = report.summary or {}
    counts = report.coverage.counts()
    kpis = [("passes", len(report.passes)),
            ("nodes", f"{s.get('nodes_before', '?')} → {s.get('nodes_after', '?')}"),
            ("int8 nodes", f"{counts['int8']} / {len(report.coverage.nodes)}"),
            ("total time", f"{sum(p['seconds'] for p in report.passes):.2f} s")]
    final = [r["sqnr_db"] for r in report.fidelity if r["stage"] == "final" and "sqnr_db" in r]
    if final:
        kpis.append(("final output SQNR", f"{min(final):.1f} dB"))
    head = "".join(f'<div class="kpi"><b>{esc(v)}</b>{esc(k)}</div>' for k, v in kpis)
    notes = "".join(f'<p class="muted">{esc(n)}</p>' for n in report.notes)
    pass_rows = [[p["index"], p["pass"], f"{p['seconds']:.3f}", f"{p['peak_rss_mb']:.0f}", p["matched"], p["rewritten"],
                  len(p["skipped"]), f"{p['nodes_before']} → {p['nodes_after']}", p.get("structural_short", "-"),
                  p["verify_worst_relative"], p.get("verify_tolerance")] for p in report.passes]
    fid_rows: list[list[Any]] = []
    fid_cls: list[str] = []
    for r in report.fidelity:
        if "error" in r:
            fid_rows.append([r["stage"], "-", "error", r["error"], "", "", "", ""])
            fid_cls.append("bad")
            continue
        top1 = "-" if r["top1_agreement"] is None else f"{r['top1_agreement']:.1%}"
        fid_rows.append([r["stage"], r["output"], sqnr_cell(r["sqnr_db"]), r["cosine"], r["max_abs"], r["relative"],
                         top1, r.get("metric")])
        fid_cls.append("")
    sections = [
        head + notes,
        section("Recipe", f'<pre id="recipe">{esc(report.recipe["yaml"])}</pre>'
                f'<p class="muted">sha256 {esc(report.recipe["sha256"])}</p>', "recipe-section"),
        section("Passes", table(["#", "pass", "seconds", "peak RSS MB", "matched", "rewritten", "skipped", "nodes",
                                 "structural diff", "verify (worst relative)", "verify tolerance"], pass_rows,
                                table_id="passes"),
                "passes-section"),
        section("Fidelity per stage", f"<p>Each stage against the float original on {esc(report.data)}. "
                f"{esc(_measured(report))}</p>"
                + table(["stage", "output", "SQNR dB", "cosine", "max abs", "relative", "top-1 agreement", "metric"],
                        fid_rows, table_id="fidelity", row_classes=fid_cls), "fidelity-section"),
    ]
    if report.attribution is not None:
        sections.insert(1, culprits_html(report.attribution, context=culprits_context(report.data)))
    sections.insert(0, first_screen_html(report.check, report.fidelity, report.attribution))
    if report.graph_view:
        sections.append(section("Changed regions of the graph", report.graph_view, "graph-section"))
    if report.layers is not None:
        sections.append(numeric_html(report.layers))
    sections.append(section("QDQ coverage (final model)", coverage_html(None, report.coverage), "coverage-section"))
    fb = "".join(f"<h3>{esc(f['pass'])}</h3>" + _details_html(f["details"])
                 + "".join(f"<p>{esc(n)}</p>" for n in f["notes"]) for f in report.fallback)
    sections.append(section("Fallback decisions", fb or '<p class="muted">no fallback pass in this recipe.</p>',
                            "fallback-section"))
    sections.append(section("Decisions and selectors that matched nothing", table(
        ["pass", "kind", "what"], [[d["pass"], d["kind"], d["text"]] for d in report.decisions],
        table_id="decisions") if report.decisions else '<p class="muted">no pass made a decision worth noting.</p>',
        "decisions-section"))
    sections.append(section("Nodes left alone", table(["pass", "node", "reason"], [[k["pass"], k["node"], k["reason"]]
                                                      for k in report.skipped], table_id="skipped") if report.skipped
                            else '<p class="muted">none: no pass skipped a node it matched.</p>', "skipped-section"))
    details = "".join(f"<details><summary>#{p['index']} {esc(p['pass'])}</summary>{_details_html(p['details'])}"
                      f"<pre>{esc(json.dumps(p['config'], indent=2))}</pre></details>" for p in report.passes)
    sections.append(section("Pass details", details, "details-section"))
    return page(f"qgraph report: {report.recipe['name']}", sections, subtitle=report.data)
