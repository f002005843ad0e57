"""Data-driven commands: ``calibrate`` (ranges files) and ``sensitivity`` (per-node ranking, auto fallback)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

import qgraph.cli._app as _app
from qgraph.cli._app import (
    AddressOption,
    ExecutorOption,
    KernelsOption,
    QGraphCommand,
    TargetCpuOption,
    app,
    check_kernel_options,
    data_path,
    executor_spec,
    need_positive,
    say,
    spec_file,
)
from qgraph.cli.check import LabelsOption, MetricOption
from qgraph.errors import UsageError
from qgraph.io.outputs import check_output, check_outputs

#: Calibration methods `qgraph calibrate --method` accepts.
METHODS = ("minmax", "percentile", "entropy", "mse", "auto")


@app.command(cls=QGraphCommand)
def calibrate(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file (its preparation passes run first).")],
    model: Annotated[Path, typer.Argument(help="Float ONNX model.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Ranges JSON file to write.")],
    calibration_data: Annotated[
        str | None, typer.Option("--calibration-data", help=".npz, folder of .npz/.npy, or module:function.")
    ] = None,
    method: Annotated[str | None, typer.Option(help="minmax | percentile | entropy | mse | auto "
                                                      "(default: the recipe's).")
                      ] = None,
    samples: Annotated[int | None, typer.Option("--samples", min=1, help="Read at most N samples "
                                                "(default: the recipe's calibration.samples, 1024 unless set).")
                       ] = None,
) -> None:
    """Measure activation ranges of the graph RECIPE quantizes and write them to a reusable ranges file."""
    from qgraph.cli.calibrate_command import calibrate_recipe
    from qgraph.pipeline.recipe import Recipe

    if method is not None and method not in METHODS:
        raise UsageError(f"--method {method!r}: choose one of {', '.join(METHODS)}.")
    check_output(output, inputs=[recipe, model, data_path(calibration_data)])
    rec = Recipe.from_yaml(recipe)
    if calibration_data is None and rec.calibration.data:  # the recipe names its data: a file this run reads too
        check_output(output, inputs=[recipe, model, data_path(rec.calibration.data)])
    with Progress(SpinnerColumn(), TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TextColumn("batches"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=_app.console,
                  disable=not _app.live_progress(_app.console)) as progress:
        task = progress.add_task("calibrate", total=None)

        def on_progress(done: int, total: int | None) -> None:
            progress.update(task, completed=done, total=total)

        seen: list[Any] = []
        path = calibrate_recipe(rec, model, calibration_data, output, method=method, progress=on_progress,
                                on_result=seen.append, samples=samples)
    _print_fragile(seen[0] if seen else {})
    _print_auto(seen[0] if seen else {})
    say(f"wrote {path}")


def _print_auto(calibrations: Any) -> None:
    """``--method auto``: tensors per winning method, and the tensors where the choice mattered most with every
    candidate's expected error (relative to minmax's)."""
    from qgraph.calibrate.summary import auto_table

    counts, rows = auto_table(calibrations)
    if not rows:
        return
    _app.out.print("method auto chose: " + ", ".join(f"{m} {k}" for m, k in counts.items()))
    names = list(rows[0].errors)
    table = Table(title="calibration: where auto's choice mattered most (each candidate's error / minmax's; "
                  "pP = percentile:P)", title_justify="left")
    table.add_column("tensor", overflow="fold", min_width=24)
    table.add_column("chosen", no_wrap=True)
    table.add_column("gain dB", justify="right", no_wrap=True)
    for n in names:
        table.add_column(_short(n), justify="right", no_wrap=True)
    for r in rows:
        base = r.errors["minmax"] or 1.0
        table.add_row(r.tensor, _short(r.winner), f"{r.gain_db:+.1f}", *(f"{r.errors[n] / base:.2g}" for n in names))
    _app.out.print(table)


def _short(method: str) -> str:
    """``percentile:99.99`` -> ``p99.99`` (table headers)."""
    return method.replace("percentile:", "p")


def _print_fragile(calibrations: Any) -> None:
    """Where calibration is fragile: the tensors clipping most values and those with the largest outlier ratio."""
    from qgraph.calibrate.summary import most_fragile

    worst = most_fragile(calibrations, top=5)
    for kind, title in (("most_clipped", "most values clipped"), ("largest_outlier_ratio", "largest max|x| / p99.99")):
        rows = worst[kind]
        if not rows:
            continue
        table = Table(title=f"calibration: {title}", title_justify="left")
        table.add_column("tensor", overflow="fold")  # names are what users search for: never truncated
        for col in ("range", "observed", "clipped", "outlier ratio"):
            table.add_column(col, justify="right", no_wrap=True)
        for r in rows:
            ratio = "" if r.outlier_ratio is None else f"{r.outlier_ratio:.3g}"
            table.add_row(r.tensor, f"[{r.range_min:.4g}, {r.range_max:.4g}]",
                          f"[{r.observed_min:.4g}, {r.observed_max:.4g}]", f"{100 * r.clip_fraction:.3g}%", ratio)
        _app.out.print(table)


@app.command(cls=QGraphCommand)
def sensitivity(
    model_float: Annotated[Path, typer.Argument(help="Float ONNX model (the reference).", metavar="FLOAT")],
    model_qdq: Annotated[Path, typer.Argument(help="QDQ model of it (from qgraph or any other tool).", metavar="QDQ")],
    data: Annotated[str, typer.Option("--data", "--eval-data", help="Held-out evaluation data: .npz, folder, or "
                                      "module:function.")],
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the table (and search) as JSON.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a bar chart (.svg, or .png).")] = None,
    jobs: Annotated[int | None, typer.Option("--jobs", min=1, help="Nodes measured at once: local worker "
                                             "processes (default 1) or Ray tasks (default: the cluster's CPUs).")
                    ] = None,
    executor: ExecutorOption = "local",
    address: AddressOption = None,
    target: Annotated[
        str | None, typer.Option("--target", help="Fall back until met: cosine:0.99 | sqnr:30 | "
                                 "detection.f1:0.98 (a built-in task metric) | mod:fn>=float-1%.")
    ] = None,
    patch: Annotated[Path | None, typer.Option("--patch", help="Write the decision as a recipe patch.")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the best model found.")] = None,
    max_nodes: Annotated[int | None, typer.Option("--max-nodes", min=0, help="Change at most N nodes "
                                                                              "(float, or 16-bit: --to a16w8/a16w16).")
                         ] = None,
    max_time: Annotated[float | None, typer.Option("--max-time", help="Search budget in seconds.")] = None,
    samples: Annotated[int | None, typer.Option("--samples", min=1, help="Use at most N samples of --data.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")] = False,
    labels: LabelsOption = None,
    metric: MetricOption = None,
    exact_top: Annotated[int, typer.Option("--exact-top", min=0, help="Measure the first K ranked nodes exactly "
                                           "(one full evaluation each).")] = 10,
    cost: Annotated[Literal["latency", "error"], typer.Option("--cost",
                                      help="Order of the fallback search (as float_fallback's auto.cost): error "
                                      "= by output error alone; latency = by output error bought per added "
                                      "latency (insert_qdq's cost table).")] = "error",
    latency_preset: Annotated[str | None, typer.Option("--latency-preset", help="Preset of the cost table for "
                                                       "--cost latency (default: the table's only one).")
                              ] = None,
    to: Annotated[Literal["float", "a16w8", "a16w16"], typer.Option(
        "--to", help="What the chosen nodes become (as float_fallback's `to`): float; a16w8 = 16-bit activations, "
        "weights unchanged (NPUs); a16w16 = 16-bit weights too, from MODEL_FLOAT's weights.")] = "float",
    whole_outputs: Annotated[bool, typer.Option("--whole-outputs", help="Score an output that a final Concat joins "
                             "from different tensors (a detector's boxes and class scores) as one tensor; default: "
                             "each part on its own, the worst part deciding (cosine/sqnr targets and the "
                             "ranking).")] = False,
    kernels: KernelsOption = "auto",
    target_cpu: TargetCpuOption = None,
) -> None:
    """Rank every quantized node from one run by the error it introduces (the first --exact-top measured
    exactly: gain when only that node returns to float); with --target, fall back ranked prefixes until the
    target is met (exit 1 when it cannot be: the best model is still written)."""
    from qgraph.cli.sensitivity_command import run_command

    need_positive(max_time, "--max-time")
    check_kernel_options(kernels, target_cpu)
    spec = executor_spec(executor, address, jobs)
    check_outputs({"--json": json_path, "--plot": plot, "--patch": patch, "-o": output},
                  inputs=[model_float, model_qdq, data_path(data), spec_file(labels), spec_file(metric)],
                  models=["-o"])
    code = run_command(model_float, model_qdq, data, json_path=json_path, plot=plot, jobs=jobs or 1, target=target,
                       patch=patch, output=output, max_nodes=max_nodes, max_time=max_time, samples=samples,
                       quiet=quiet, out=_app.out, console=_app.console, labels=labels, metric=metric,
                       exact_top=exact_top, executor=spec, cost=cost, latency_preset=latency_preset, remedy=to,
                       whole_outputs=whole_outputs, kernels=kernels, target_cpu=target_cpu)
    if code:
        raise typer.Exit(code)
