"""``qgraph check``: the validation chain as a CI gate (framework outputs → ONNX FP32 → INT8 ...)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

import qgraph.cli._app as _app
from qgraph.cli._app import (
    KernelsOption,
    QGraphCommand,
    TargetCpuOption,
    app,
    check_kernel_options,
    data_path,
    say,
    spec_file,
)

LabelsOption = Annotated[
    str | None, typer.Option("--labels", help="Labels: FILE.npy, FILE.npz or FILE.npz:KEY (default: a 'labels' "
                             "array in the --eval-data .npz, if any).")]
MetricOption = Annotated[
    str | None, typer.Option("--metric", help="A built-in task metric (detection.f1, detection.map50, text_boxes, "
                             "ctc.exact, ctc.cer, top1, topk(k=5), cosine(split=4), sqnr; options in parentheses; "
                             "docs/metrics.md) or module:function / path/file.py:function, called as "
                             "f(outputs, labels or reference outputs) -> float.")]
LowerOption = Annotated[bool, typer.Option("--lower-is-better", help="The metric is an error (lower is better).")]


@app.command(cls=QGraphCommand)
def check(
    reference: Annotated[Path, typer.Argument(help="Reference ONNX model (FP32).")],
    candidates: Annotated[list[Path] | None, typer.Argument(help="Later stages, in chain order (e.g. the INT8).",
                                                            metavar="CANDIDATE")] = None,
    data: Annotated[str, typer.Option("--data", "--eval-data", help="Held-out data (.npz, folder, "
                                      "module:function).")] = "",
    labels: LabelsOption = None,
    metric: MetricOption = None,
    lower_is_better: LowerOption = False,
    max_drop: Annotated[str, typer.Option("--max-drop", help="Largest quality drop allowed per step: '1%' "
                                          "(relative) or '0.01' (absolute).")] = "1%",
    max_total_drop: Annotated[str | None, typer.Option("--max-total-drop", help="... and from the first stage "
                                                       "to any later one.")] = None,
    reference_outputs: Annotated[Path | None, typer.Option("--reference-outputs", help="Outputs saved by the "
                                 "training framework (.npz, one array per output name, one row per sample): the "
                                 "first stage of the chain.")] = None,
    samples: Annotated[int | None, typer.Option("--samples", min=1, help="Use at most N samples.")] = None,
    json_out: Annotated[str | None, typer.Option("--json", help="Write JSON to FILE ('-': stdout only).")] = None,
    whole_outputs: Annotated[bool, typer.Option("--whole-outputs", help="Score an output that a final Concat joins "
                             "from different tensors (a detector's boxes and class scores) as one tensor; default: "
                             "each part on its own, the worst part deciding.")] = False,
    kernels: KernelsOption = "auto",
    target_cpu: TargetCpuOption = None,
) -> None:
    """Check a chain of models on held-out data: every stage against the first, exit 1 when a step loses more
    than --max-drop of the quality (the metric; else top-1 agreement; else output cosine, the lowest over the
    parts of an output a final Concat joins)."""
    from qgraph.analysis.check import Drop, check_chain
    from qgraph.analysis.diff.render import dumps
    from qgraph.errors import UsageError, VerificationError
    from qgraph.io.model_io import load_model
    from qgraph.io.outputs import check_outputs, write_atomic
    from qgraph.runtime.evaluation import Evaluation

    if not data:
        raise UsageError("qgraph check needs --data: the held-out samples every stage runs on.")
    check_kernel_options(kernels, target_cpu)
    stages = list(candidates or [])
    if not stages and reference_outputs is None:
        raise UsageError("qgraph check needs at least two stages: REFERENCE CANDIDATE..., or REFERENCE with "
                         "--reference-outputs.")
    drop = Drop.parse(max_drop, higher_is_better=not lower_is_better)
    total = (Drop.parse(max_total_drop, "--max-total-drop", higher_is_better=not lower_is_better)
             if max_total_drop is not None else None)
    json_file = None if json_out in (None, "-") else json_out
    check_outputs({"--json": json_file}, inputs=[reference, *stages, data_path(data), reference_outputs,
                                                 spec_file(labels), spec_file(metric)])
    from qgraph.io.inputs import input_file_problem

    for p in stages:
        problem = input_file_problem(p)
        if problem is not None:
            raise UsageError(f"model {p}: {problem}.")
        if not p.is_file():
            raise UsageError(f"{p}: no such model file.")
    ev = Evaluation.open(load_model(reference), data, labels=labels, metric=metric, samples=samples,
                         higher_is_better=not lower_is_better)
    result = check_chain(reference, stages, ev, max_drop=drop, max_total_drop=total,
                         reference_outputs=reference_outputs, whole_outputs=whole_outputs, kernels=kernels,
                         target=target_cpu)
    if json_out == "-":
        sys.stdout.write(dumps(result.to_dict()))
    else:
        for line in result.kernel_lines():
            _app.out.print(line, markup=False, highlight=False, soft_wrap=True)
        _print(result)
        for line in [*result.host_lines(), *result.saturation_lines()]:
            _app.out.print(line, markup=False, highlight=False, soft_wrap=True)
        for line in result.part_lines():
            say(line)
        if json_file:
            say(f"wrote {write_atomic(json_file, dumps(result.to_dict()))}")
    if not result.passed:
        raise VerificationError(result.verdict())
    say(result.verdict())


def _verdict(row: object) -> str:
    """The verdict cell: ok, FAIL, or not compared (the first stage was unusable)."""
    from qgraph.analysis.check import CheckRow

    assert isinstance(row, CheckRow)
    return "ok" if row.ok else "not compared" if row.why.startswith("not compared") else "FAIL"


def _print(result: object) -> None:
    from qgraph.analysis.check import CheckResult
    from qgraph.analysis.diff.html import cell
    from qgraph.analysis.diff.tables import rich_table

    assert isinstance(result, CheckResult)
    unit = "%" if result.max_drop.relative else ""
    total_unit = "%" if (result.max_total_drop or result.max_drop).relative else ""  # the total's own unit
    scored = any(r.score.metric is not None for r in result.rows)
    rows = []
    for r in result.rows:
        s = r.score
        ci = s.metric_interval  # a point interval (the reference against itself) is not shown
        spread = f" ({ci.low:.4g}-{ci.high:.4g})" if ci and ci.low < ci.high else ""
        quality = [cell(s.metric) + spread] if scored else []
        rows.append([r.stage, r.source, cell(s.sqnr_db, exact_note=r is not result.rows[0]), cell(s.cosine),
                     cell(s.top1_agreement), *quality, "-" if r.step_drop is None else f"{r.step_drop:.3g}{unit}",
                     "-" if r.total_drop is None else f"{r.total_drop:.3g}{total_unit}", _verdict(r)])
    intervals = any(r.score.metric_interval for r in result.rows)
    metric_head = "metric (95% interval)" if intervals else "metric"
    head = ["stage", "source", "SQNR dB", "cosine", "top-1 agr.", *([metric_head] if scored else []), "step drop",
            "total drop", "verdict"]
    _app.out.print(rich_table(f"validation chain on {result.data} (quality: {result.quality_name}; drops against "
                              "the previous stage and the first)", head, rows))
    parts = [[r.stage, p.name, cell(p.sqnr_db), cell(p.cosine), cell(p.max_abs)] for r in result.rows[1:]
             for p in r.score.parts if p.part is not None]
    if parts:
        _app.out.print(rich_table("output parts (each part of an output a final Concat joins, against the first "
                                  "stage; the stage's SQNR and cosine are the worst part's)",
                                  ["stage", "output part", "SQNR dB", "cosine", "max abs"], parts))
