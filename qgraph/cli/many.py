"""``qgraph run RECIPE MODEL... --out-dir DIR``: one recipe over many models, each model a task, and a summary."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

import qgraph.cli._app as _app
from qgraph.cli._app import DataLayout, data_path, need_positive, say
from qgraph.pipeline.batch import BatchJob, ModelOutcome, plan_outputs, run_many
from qgraph.runtime.executor import ExecutorSpec

_STYLE = {"ok": "green", "goal not met": "yellow", "failed": "bold red"}


def run_many_command(
    recipe: Path,
    models: Sequence[Path],
    out_dir: Path,
    *,
    patches: Sequence[Path],
    spec: ExecutorSpec,
    calibration_data: str | None,
    samples: int | None,
    data_layout: DataLayout,
    verify: bool,
    tolerance: float,
    quiet: bool,
) -> int:
    """Check every input and output, run the models on the executor ``spec`` describes, print the summary.

    Returns 0 when every model was written and met the recipe's goals, else 1 (the others are still written)."""
    from qgraph.pipeline.recipe import Recipe

    need_positive(tolerance, "--tolerance")
    data = None if calibration_data is None or "{stem}" in calibration_data else data_path(calibration_data)
    outputs = plan_outputs(list(models), out_dir, [recipe, data, *patches])
    rec = Recipe.from_yaml(recipe)
    for p in patches:
        rec = rec.apply_patch(p)
    if calibration_data is None and rec.calibration.data:  # the recipe names its data: a file every run reads
        plan_outputs(list(models), out_dir, [recipe, data_path(rec.calibration.data), *patches])
    rec.pipeline()  # a recipe whose passes cannot be built fails here, once, not once per model
    job = BatchJob(rec, calibration_data, samples, data_layout, verify, tolerance)
    progress = Progress(
        TextColumn(f"[bold]{rec.name}"), BarColumn(), MofNCompleteColumn(), TextColumn("models"),
        TimeElapsedColumn(), TimeRemainingColumn(), console=_app.console,
        disable=not _app.live_progress(_app.console, quiet),
    )
    task = progress.add_task("models", total=len(models))
    with spec.create() as executor, progress:
        say(f"running {len(models)} models on {_describe(spec, executor.workers)}")
        outcomes = run_many(job, models, outputs, executor,
                            progress=lambda done, total: progress.update(task, completed=done, total=total))
    _app.out.print(summary_table(outcomes, rec.name, models, outputs))
    failed = [o for o in outcomes if o.status != "ok"]
    written = sum(o.written for o in outcomes)
    say(f"{written} of {len(outcomes)} models written to {out_dir}"
        + (f"; {len(failed)} failed or missed a goal: exit 1." if failed else "."))
    return 1 if failed else 0


def _describe(spec: ExecutorSpec, workers: int) -> str:
    where = "this machine" if spec.kind == "local" else f"Ray ({spec.address or 'local'})"
    return f"{where}, {workers} at once"


def summary_table(outcomes: Sequence[ModelOutcome], name: str, models: Sequence[Path] | None = None,
                  outputs: Sequence[Path] | None = None) -> Table:
    """One row per model: model, status, passes run, seconds, output written, and the error sentence (paths as
    the user gave them when ``models``/``outputs`` are given, else as the workers saw them)."""
    table = Table(title=f"{name}: {len(outcomes)} models")
    table.add_column("model", overflow="fold")
    table.add_column("status", no_wrap=True)
    table.add_column("passes", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("output", overflow="fold")
    table.add_column("error", overflow="fold")
    shown = [(str(m), str(p)) for m, p in zip(models, outputs, strict=True)] if models and outputs else None
    for i, o in enumerate(outcomes):
        model, output = shown[i] if shown else (o.model, o.output)
        table.add_row(
            Text(model),
            Text(o.status, style=_STYLE[o.status]),
            f"{o.passes_done}/{o.passes_total}",
            f"{o.seconds:.1f}s",
            Text(output if o.written else "-"),
            Text(o.error),
        )
    return table
