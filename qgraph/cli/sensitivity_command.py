"""``qgraph sensitivity``: the ranked table, JSON, plot, and the automatic search behind ``--target``.

Every output file is written only after all measurements are done, each through a temporary file and an
atomic rename, so an interrupted run (Ctrl-C) leaves no partial output.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from qgraph.analysis.diff.culprits import attribute
from qgraph.analysis.diff.render_culprits import print_culprits
from qgraph.analysis.sensitivity.cost import CostSpec
from qgraph.analysis.sensitivity.options import SearchOptions
from qgraph.analysis.sensitivity.ranking import SensitivityReport
from qgraph.analysis.sensitivity.search import auto_fallback
from qgraph.analysis.sensitivity.stats import matmul_flops
from qgraph.analysis.sensitivity.targets import Target, parse_target, per_sample_labels
from qgraph.cli._app import emit, live_progress
from qgraph.errors import ModelError, RecipeError
from qgraph.io.model_io import load_model, save_model
from qgraph.io.outputs import write_atomic
from qgraph.quant.qdq import has_quantization
from qgraph.quant.reference_weights import ReferenceWeights
from qgraph.runtime.evaluation import Evaluation
from qgraph.runtime.executor import ExecutorSpec, make_executor
from qgraph.runtime.kernels.measure import choose, model_target, target_family
from qgraph.runtime.latency import shipped_latency_table
from qgraph.runtime.output_parts import output_parts_of

#: Ranked nodes measured exactly by default (one full evaluation each).
DEFAULT_EXACT_TOP = 10
#: Progress bar label per stage of `auto_fallback`.
STAGE_LABELS = {"ranking": "ranking (batches)", "exact": "exact top (nodes)", "search": "search (evaluations)",
                "confirmation": "confirmation"}

#: Ranking used when no --target is given.
DEFAULT_RANKING = Target("sqnr", "sqnr", goal=math.inf)


def _fmt(v: float | None, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return format(v, spec)


#: Rows of the table printed in the terminal (the JSON has every node).
TABLE_ROWS = 40


def _change(remedy: str) -> str:
    """What happens to "this node" in the table's words."""
    return {"float": "returned to float", "a16w8": "given 16-bit activations"}.get(
        remedy, "given 16-bit activations and weights")


def render_table(report: SensitivityReport, console: Console, rows: int = TABLE_ROWS, remedy: str = "float") -> None:
    """Print the ranked table: node, op, gain (measured or predicted), local SQNR, output cosine/SQNR of the
    measured rows, input clipping and quantization SQNR (``remedy``: what "this node" became)."""
    change = _change(remedy)
    what = {"cosine": "output cosine", "sqnr": "output SQNR (dB)"}.get(report.target.kind, report.target.metric_spec)
    one_run = report.method != "exact"
    title = (f"nodes ranked from one run: gain in {what} when only this node is {change}, "
             "measured (=) or predicted from local errors (~)" if one_run else
             f"sensitivity = gain in {what} when only this node is {change}")
    table = Table(
        title=title,
        caption="local SQNR: the node's own output error on the float model's inputs; SQNR dB: output SQNR with "
        f"only this node {change} (measured rows); clip %: activation input values beyond the Q range; in SQNR: "
        "its quantization SQNR",
    )
    table.add_column("#", justify="right")
    table.add_column("node", overflow="fold", min_width=18)
    table.add_column("op", overflow="fold", min_width=6)
    for col in ("sensitivity", "local SQNR", "SQNR dB", "clip %", "in SQNR"):
        table.add_column(col, justify="right", no_wrap=True)
    ranked = report.ranked()
    for i, r in enumerate(ranked[:rows], 1):
        clip = None if r.clip_fraction is None else 100.0 * r.clip_fraction
        mark = "" if not one_run else ("=" if r.measured else "~")
        table.add_row(
            str(i),
            r.name,
            r.op,
            mark + _fmt(None if math.isnan(r.sensitivity) else r.sensitivity, "+.3g"),
            _fmt(r.local_sqnr_db, ".1f"),
            _fmt(None if math.isnan(r.sqnr_db) else r.sqnr_db, ".1f"),
            _fmt(clip, ".2g"),
            _fmt(r.input_sqnr_db, ".1f"),
        )
    console.print(table)
    if len(ranked) > rows:
        console.print(f"... {len(ranked) - rows} more node(s) (every node is in --json)", markup=False,
                      highlight=False)
    base = min(report.baseline, key=lambda d: d.cosine, default=None)
    if base is not None:
        measured = sum(r.measured for r in report.rows)
        how = (f"{report.candidates} quantized nodes ranked from one run, {measured} measured exactly"
               if one_run else f"{len(report.rows)} of {report.candidates} quantized nodes measured")
        console.print(
            f"full INT8 vs float: cosine {base.cosine:.6f}, SQNR {_fmt(base.sqnr_db, '.2f')} dB "
            f"(worst output {base.name}); {how} in {report.seconds:.1f} s",
            markup=False,
            highlight=False,
        )
    for note in report.notes:
        emit(console, f"note: {note}")


def write_plot(path: Path, report: SensitivityReport, top: int = 40, remedy: str = "float") -> None:
    """Bar chart of the most sensitive nodes: SVG written directly, PNG through matplotlib."""
    rows = [r for r in report.ranked() if math.isfinite(r.sensitivity)][:top]
    if path.suffix.lower() == ".png":
        _write_png(path, rows, report, remedy)
        return
    bar_h, label_w, plot_w, pad = 18, 260, 420, 10
    height = pad * 2 + 30 + bar_h * max(len(rows), 1)
    peak = max((abs(r.sensitivity) for r in rows), default=1.0) or 1.0
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + plot_w + 3 * pad + 80}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{pad}" y="{pad + 12}" font-size="13">{html.escape(_title(report, remedy))}</text>',
    ]
    for i, r in enumerate(rows):
        y = pad + 30 + i * bar_h
        w = max(1.0, plot_w * abs(r.sensitivity) / peak)
        color = "#d62728" if r.sensitivity > 0 else "#7f7f7f"
        parts.append(f'<text x="{label_w}" y="{y + 12}" text-anchor="end">{html.escape(f"{r.name} ({r.op})")}</text>')
        parts.append(f'<rect x="{label_w + pad}" y="{y + 2}" width="{w:.1f}" height="{bar_h - 4}" fill="{color}"/>')
        parts.append(f'<text x="{label_w + 2 * pad + w:.1f}" y="{y + 12}">{r.sensitivity:+.4g}</text>')
    parts.append("</svg>")
    write_atomic(path, "\n".join(parts) + "\n")


def _title(report: SensitivityReport, remedy: str = "float") -> str:
    what = report.target.metric_spec if report.target.kind == "metric" else f"output {report.target.kind}"
    return f"Gain in {what} when only this node is {_change(remedy)}"


def check_plot_path(path: Path) -> None:
    """Fail before any work when the plot format is unsupported."""
    suffix = path.suffix.lower()
    if suffix not in (".svg", ".png"):
        raise RecipeError(f"--plot {path}: use a .svg or .png file name.")
    if suffix == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise RecipeError(
                f"--plot {path}: PNG plots need matplotlib (pip install matplotlib); "
                "SVG plots need nothing: use a .svg file name."
            ) from None


def _write_png(path: Path, rows: list[Any], report: SensitivityReport, remedy: str) -> None:

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1 + 0.25 * max(len(rows), 1)))
    ax.barh([f"{r.name} ({r.op})" for r in rows][::-1], [r.sensitivity for r in rows][::-1], color="#d62728")
    ax.set_title(_title(report, remedy))
    fig.tight_layout()
    try:
        write_atomic(path, lambda f: fig.savefig(f, format=path.suffix.lstrip(".").lower() or "png"))
    finally:
        plt.close(fig)


def flops_summary(model: Any, input_shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[int, int]:
    """(MatMul/Gemm FLOPs in INT8, total MatMul/Gemm FLOPs) for one sample."""
    try:
        rows = matmul_flops(model, input_shapes)
    except Exception:  # shape inference can fail on exotic models; the summary is informative only
        return 0, 0
    return sum(r["flops"] for r in rows if r["int8"]), sum(r["flops"] for r in rows)


#: Samples the Q/DQ attribution printed after the ranking runs on (it measures each top pair alone).
ATTRIBUTION_SAMPLES = 32


def _target(target: str | None, metric: str | None, evaluation: Evaluation) -> Target:
    """The target (or ranking) with the evaluation's labels bound into any user metric."""
    def bind(fn: Any) -> Any:
        if evaluation.labels is None:
            return fn
        labels = evaluation.labels
        if not per_sample_labels(fn):  # one table for every sample (detection boxes): never cut per row
            return lambda outputs, _refs: fn(outputs, labels)
        return lambda outputs, _refs: fn(outputs, labels[: len(outputs[0]) if outputs and len(outputs[0]) else None])

    if target is not None:
        t = parse_target(target)
        return replace(t, metric=bind(t.metric)) if t.metric is not None else t
    if evaluation.metric is not None:
        return Target(metric or "metric", "metric", evaluation.higher_is_better, math.inf if
                      evaluation.higher_is_better else -math.inf, None, metric, bind(evaluation.metric))
    return DEFAULT_RANKING


def _check_options(target: str | None, output: Path | None, patch: Path | None, remedy: str, cost: str) -> None:
    """Refuse option combinations that cannot work (and a target that does not parse), before anything is
    loaded."""
    if target is not None:
        parse_target(target, load=False)
    if (output is not None or patch is not None) and target is None:
        raise RecipeError("-o/--output and --patch write the result of the automatic search: give --target too.")
    if remedy != "float" and cost == "latency":
        raise RecipeError(f"--to {remedy} with --cost latency: the cost table has float and int8 costs only; use "
                          "--cost error.")


def _qdq_model(path: Path) -> Any:
    """The quantized model at ``path`` (Q/DQ, or dynamically quantized MatMuls); a float model is refused (the
    float model given twice or swapped)."""
    qdq = load_model(path)
    if not has_quantization(qdq):
        raise ModelError(f"{path}: no QuantizeLinear/DequantizeLinear and no integer op in it: give the quantized "
                         "model second (the float model is the first argument).")
    return qdq


def _stage_progress(console: Console, quiet: bool) -> tuple[Progress, Callable[[str, int, int | None], None]]:
    """A progress display with one task per search stage, and the callback that feeds it."""
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), TimeRemainingColumn(),
                        console=console, disable=not live_progress(console, quiet))
    tasks: dict[str, Any] = {}

    def on_progress(stage: str, done: int, total: int | None) -> None:
        if stage not in tasks:
            tasks[stage] = progress.add_task(STAGE_LABELS.get(stage, stage), total=total)
        progress.update(tasks[stage], completed=done, total=total)

    return progress, on_progress


def run_command(
    model_float: Path,
    model_qdq: Path,
    data: str,
    *,
    json_path: Path | None,
    plot: Path | None,
    jobs: int,
    target: str | None,
    patch: Path | None,
    output: Path | None,
    max_nodes: int | None,
    max_time: float | None,
    samples: int | None,
    quiet: bool,
    out: Console,
    console: Console,
    labels: str | None = None,
    metric: str | None = None,
    exact_top: int = DEFAULT_EXACT_TOP,
    executor: ExecutorSpec | None = None,
    cost: str = "error",
    latency_preset: str | None = None,
    remedy: str = "float",
    whole_outputs: bool = False,
    kernels: str = "auto",
    target_cpu: str | None = None,
) -> int:
    """The body of ``qgraph sensitivity``; returns the exit code (1 when a target is not met).

    Nodes inside If/Loop bodies are candidates too. ``cost``: the search order, as ``float_fallback``'s
    ``auto.cost`` (latency: `cost_spec`'s table); ``remedy``:
    what chosen nodes become, as its ``to`` (float; a16w8: 16-bit activations; a16w16: 16-bit weights too). For
    float and a16w16 the chosen nodes' weights come from the float model where they match the QDQ model's codes
    (`qgraph.quant.reference_weights`; else the dequantized codes), and the patch names it in ``float_weights``.

    ``metric`` (with optional ``labels``) ranks by the user's metric when no ``target`` is given; with labels,
    every metric (also one named in ``target``) is called as ``metric(outputs, labels)``. A cosine/sqnr target (and
    the default ranking) scores each part of an output a final Concat joins (`qgraph.runtime.output_parts`), unless
    ``whole_outputs``. Every evaluation runs with the kernels for the CPU the QDQ model was made for
    (``target_cpu`` overrides its provenance; `qgraph.runtime.kernels.measure.choose` under ``kernels``)."""
    _check_options(target, output, patch, remedy, cost)
    if plot is not None:
        check_plot_path(plot)
    reference, qdq = load_model(model_float), _qdq_model(model_qdq)
    evaluation = Evaluation.open(reference, data, labels=labels, metric=metric, samples=samples)
    tgt = _target(target, metric, evaluation)
    parts = output_parts_of(reference, enabled=not whole_outputs) if tgt.kind != "metric" else None
    for line in parts.decisions() if parts is not None else []:
        emit(console, line)
    choice = choose(target_family(target_cpu) if target_cpu else model_target(qdq), kernels)
    for text in (choice.mismatch, f"measured with {choice.kernels.describe()}"):
        if text:
            emit(console, text)
    progress, on_progress = _stage_progress(console, quiet)
    run = make_executor(executor, jobs)  # one executor (one Ray connection) for every measurement of the run
    with run, progress:
        result = auto_fallback(reference, qdq, data, tgt, SearchOptions(
            max_nodes=max_nodes, max_time=max_time, jobs=jobs, samples=samples, report_only=target is None,
            progress=on_progress, exact_top=exact_top, executor=run,
            costs=cost_spec(latency_preset) if cost == "latency" else None, rank_by=cost, remedy=remedy,
            float_weights=ReferenceWeights(reference, checked=True) if remedy != "a16w8" else None, in_bodies=True,
            parts=parts, kernels=choice.kernels,
        ))
    if remedy != "a16w8":  # the patch restores (float) or re-quantizes (a16w16) from the same float weights
        result.float_model = str(Path(model_float).resolve())
    emit(console, f"evaluated on {evaluation.describe()}")
    if result.sensitivity is not None:
        render_table(result.sensitivity, out, remedy=remedy)
    attribution = attribute(reference, qdq, evaluation.feeds[:ATTRIBUTION_SAMPLES], whole_outputs=whole_outputs)
    print_culprits(out, attribution, top=5)
    for note in result.notes:
        emit(console, f"note: {note}")
    if result.data_limit is not None:
        emit(console, f"note: {result.data_limit}")
    # Everything is measured: write the outputs now (each atomically).
    if json_path is not None:
        payload = (
            result.to_dict() if target is not None else (result.sensitivity.to_dict() if result.sensitivity else {})
        )
        payload = {**payload, "data": evaluation.describe(), "kernels": choice.to_dict(),
                   "culprits": [c.to_dict() for c in attribution.culprits],
                   "output_parts": parts.to_dict() if parts is not None else []}
        write_atomic(json_path, json.dumps(payload, indent=2, default=str) + "\n")
    if plot is not None and result.sensitivity is not None:
        write_plot(plot, result.sensitivity, remedy=remedy)
    if target is None:
        return 0
    int8_flops, total_flops = flops_summary(result.model, result.input_shapes)
    if output is not None:
        save_model(result.model, output)
    wrote_patch = result.write_patch(patch) if patch is not None else False
    emit(console, result.message())
    if total_flops:
        console.print(
            f"MatMul/Gemm FLOPs in INT8: {int8_flops}/{total_flops} ({100.0 * int8_flops / total_flops:.1f}%)",
            markup=False,
            highlight=False,
        )
    if output is not None:
        emit(console, f"wrote {output} (best model found)")
    if patch is not None:
        console.print(
            f"wrote {patch}" if wrote_patch else f"no node chosen ({result.stop_reason}): {patch} not written",
            markup=False,
            highlight=False,
        )
    if result.nodes:  # the decision, as a recipe patch, on stdout
        out.print(result.patch_yaml() or "", markup=False, highlight=False, end="", soft_wrap=True)
    return 0 if result.target_met else 1


def cost_spec(preset: str | None = None) -> CostSpec:
    """The latency cost table qgraph ships (`qgraph.runtime.latency.SHIPPED_TABLE`) with ``preset``, or the table's
    only preset when ``preset`` is None."""
    table = shipped_latency_table()
    if preset is None and len(table.presets) == 1:
        preset = next(iter(table.presets))
    if preset not in table.presets:
        raise RecipeError(f"--latency-preset: the cost table has no preset {preset!r} (it has "
                          f"{sorted(table.presets)}); pick one of them or use --cost error.")
    return CostSpec(table, preset)
