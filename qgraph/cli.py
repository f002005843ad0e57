"""The ``qgraph`` command line.

Exit codes: 0 ok; 1 a run failed (a pass refused, verification failed); 2 bad input (recipe, model, data),
printed as one paragraph without a traceback unless ``--debug``; 130 interrupted (no partial output is left:
every output is written atomically).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
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

from qgraph import __version__
from qgraph.errors import QGraphError

app = typer.Typer(
    name="qgraph",
    help="Declarative ONNX graph transformations: float model → deployable INT8 model, checked at every step.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console(stderr=True)
out = Console()
_STATE: dict[str, bool] = {"debug": False}


def _version(value: bool) -> None:
    if value:
        out.print(f"qgraph {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for input errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    _STATE["debug"] = debug


@app.command()
def run(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")],
    model: Annotated[Path, typer.Argument(help="Input ONNX model (never modified).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output ONNX model.")],
    calibration_data: Annotated[
        str | None, typer.Option("--calibration-data", help=".npz, folder of .npz/.npy, or module:function.")
    ] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Check float-preserving passes numerically.")] = False,
    tolerance: Annotated[float, typer.Option(help="Verify tolerance: max abs err <= tol * max|output|.")] = 1e-5,
    report: Annotated[Path | None, typer.Option("--report", help="Write a report (.json or .html).")] = None,
    patch: Annotated[
        list[Path] | None, typer.Option("--patch", help="Recipe patch(es) to append (e.g. from fallback).")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")] = False,
) -> None:
    """Run RECIPE on MODEL and write the transformed model to OUTPUT."""
    from qgraph.pipeline import PipelineEvent
    from qgraph.recipe import Recipe

    rec = Recipe.from_yaml(recipe)
    for p in patch or []:
        rec = apply_patch(rec, p)
    pipeline = rec.pipeline()
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=quiet,
    )
    task = progress.add_task(rec.name, total=len(pipeline.passes))
    steps: dict[str, Any] = {}  # sub-task per long step of a pass (calibration), with its own bar and ETA

    def on_event(ev: PipelineEvent) -> None:
        if ev.kind == "pass_start":
            progress.update(task, description=f"{rec.name}: {ev.pass_name}")
        elif ev.kind == "pass_progress" and ev.task is not None:
            key = f"{ev.pass_name}: {ev.task}"
            if key not in steps:
                steps[key] = progress.add_task(f"  {key}", total=ev.of)
            progress.update(steps[key], completed=ev.done, total=ev.of)
        elif ev.kind == "pass_end" and ev.result is not None:
            r = ev.result
            for key in [k for k in steps if k.startswith(f"{ev.pass_name}: ")]:
                progress.remove_task(steps.pop(key))
            progress.advance(task)
            progress.console.print(
                f"  [green]✓[/] {ev.pass_name}: matched {r.matched}, rewritten {r.rewritten}, "
                f"skipped {len(r.skipped)}, +{r.nodes_added}/-{r.nodes_removed} nodes "
                f"[dim]({ev.seconds:.2f}s, peak {ev.peak_rss_mb:.0f} MB)[/]"
            )
        elif ev.kind == "verify" and ev.verify:
            worst = max(ev.verify, key=lambda d: d.relative)
            progress.console.print(f"    verified: worst output {worst.name} relative error {worst.relative:.2e}")

    with progress:
        result = pipeline.run(model, calibration_data=calibration_data, verify=verify,
                              verify_tolerance=tolerance, on_event=on_event, keep_stages=report is not None)
    result.save(output)
    if report is not None:
        from qgraph.report import write_report

        write_report(report, rec, result)
    console.print(f"wrote {output}")


def apply_patch(recipe: Any, patch_path: Path) -> Any:
    """Append the passes of a recipe patch (YAML with a ``passes:`` list, ``name`` optional) to ``recipe``."""
    from ruamel.yaml import YAML

    from qgraph.errors import RecipeError
    from qgraph.recipe import Recipe

    if not patch_path.exists():
        raise RecipeError(f"patch file not found: {patch_path}")
    data = YAML(typ="rt").load(patch_path.read_text(encoding="utf-8"))
    if isinstance(data, dict) and "name" not in data:
        data["name"] = "patch"
    patch_recipe = Recipe.from_dict(data, str(patch_path)) if isinstance(data, dict) else None
    if patch_recipe is None:
        raise RecipeError(f"{patch_path}: a patch is a mapping with a `passes:` list.")
    return Recipe(
        recipe.name,
        [*recipe.passes, *patch_recipe.passes],
        description=recipe.description,
        target=recipe.target,
        calibration=recipe.calibration,
        source=recipe.source,
    )


@app.command()
def lower(
    model: Annotated[Path, typer.Argument(help="Input ONNX model (never modified).")],
    opset: Annotated[int, typer.Option("--opset", help="Target opset (lower or higher than the model's).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output ONNX model.")],
    verify: Annotated[bool, typer.Option("--verify", help="Compare outputs with the input model in ORT.")] = False,
) -> None:
    """Rewrite MODEL so it is valid at --opset and computes the same results (lowering or raising)."""
    from qgraph.model_io import load_model
    from qgraph.pass_api import get_pass
    from qgraph.pipeline import Pipeline

    source = load_model(model)
    current = next((o.version for o in source.opset_import if o.domain in ("", "ai.onnx")), opset)
    name = "lower_opset" if opset <= current else "raise_opset"
    result = Pipeline([get_pass(name)(opset=opset)], name=f"{name}-{opset}").run(model, verify=verify)
    for note in result.records[0].result.notes:
        console.print(note)
    result.save(output)
    console.print(f"wrote {output}")


@app.command()
def calibrate(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file (its preparation passes run first).")],
    model: Annotated[Path, typer.Argument(help="Float ONNX model.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Ranges JSON file to write.")],
    calibration_data: Annotated[
        str | None, typer.Option("--calibration-data", help=".npz, folder of .npz/.npy, or module:function.")
    ] = None,
    method: Annotated[
        str | None, typer.Option(help="minmax | percentile | entropy | mse (default: the recipe's).")
    ] = None,
) -> None:
    """Measure activation ranges of the graph RECIPE quantizes and write them to a reusable ranges file."""
    from qgraph.calibrate.command import calibrate_recipe
    from qgraph.recipe import Recipe

    rec = Recipe.from_yaml(recipe)
    with Progress(SpinnerColumn(), TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TextColumn("batches"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task("calibrate", total=None)

        def on_progress(done: int, total: int | None) -> None:
            progress.update(task, completed=done, total=total)

        seen: list[Any] = []
        path = calibrate_recipe(rec, model, calibration_data, output, method=method, progress=on_progress,
                                on_result=seen.append)
    _print_fragile(seen[0] if seen else {})
    console.print(f"wrote {path}")


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
        out.print(table)


@app.command()
def validate(recipes: Annotated[list[Path], typer.Argument(help="Recipe files to check.")]) -> None:
    """Validate recipes; print every problem with file:line:column and a suggestion."""
    from qgraph.recipe import Recipe, RecipeValidationError

    failed = 0
    for path in recipes:
        try:
            rec = Recipe.from_yaml(path)
        except RecipeValidationError as exc:
            failed += 1
            for issue in exc.issues:
                out.print(str(issue), markup=False, highlight=False, soft_wrap=True)
            continue
        out.print(f"{path}: ok ({len(rec.passes)} passes: {', '.join(p.name for p in rec.passes)})",
                  markup=False, highlight=False)
    if failed:
        raise typer.Exit(2)


@app.command()
def schema(
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write to a file.")] = None,
) -> None:
    """Print the JSON Schema of recipes (for yaml-language-server / editor completion)."""
    from qgraph.recipe import recipe_json_schema

    text = json.dumps(recipe_json_schema(), indent=2)
    if output is not None:
        output.write_text(text + "\n", encoding="utf-8")
    else:
        sys.stdout.write(text + "\n")


@app.command("passes")
def list_passes() -> None:
    """List the available passes with one-line docs and their options."""
    from qgraph.pass_api import discover

    table = Table(title="qgraph passes")
    table.add_column("pass", style="bold")
    table.add_column("float-preserving")
    table.add_column("summary")
    table.add_column("options")
    for name, cls in discover().items():
        opts = ", ".join(
            f"{f.alias or k}={f.default!r}" if not f.is_required() else f"{f.alias or k} (required)"
            for k, f in cls.config_class.model_fields.items()
        )
        table.add_row(name, "yes" if cls.preserves_float else "no", cls.summary(), opts)
    out.print(table)


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="ONNX model.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    opset: Annotated[int | None, typer.Option(help="Check ops against this target opset.")] = None,
    target: Annotated[str | None, typer.Option(help="Check int8 support on a target preset.")] = None,
    inputs: Annotated[
        str | None, typer.Option("--inputs", help="Data for activation ranges (.npz, folder, module:function).")
    ] = None,
    samples: Annotated[int, typer.Option(help="Samples read from --inputs.")] = 8,
    top: Annotated[int, typer.Option(help="Rows per analysis table.")] = 10,
) -> None:
    """Summarize a model (opset, IR, ops, I/O, weights, subgraphs, external data) and analyse it: QDQ coverage,
    foldable BatchNorms, ops unsupported at --opset or on --target, extreme ranges, int16 saturation risk."""
    from qgraph.diff.render import dumps, print_analysis
    from qgraph.inspect import inspect_model

    info = inspect_model(model, opset=opset, target=target, inputs=inputs, samples=samples)
    if as_json:
        sys.stdout.write(dumps(info))
        return
    out.print(f"[bold]{model}[/]  IR {info['ir_version']}  opsets {info['opsets']}  "
              f"{info['nodes']} nodes  {info['initializer_bytes'] / 1e6:.2f} MB weights")
    io_table = Table(title="inputs / outputs")
    for col in ("kind", "name", "dtype", "shape"):
        io_table.add_column(col)
    for kind in ("inputs", "outputs"):
        for t in info[kind]:
            io_table.add_row(kind[:-1], t["name"], t["dtype"], str(t["shape"]))
    out.print(io_table)
    ops = Table(title="op histogram")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, count in Counter(info["ops"]).most_common():
        ops.add_row(op, str(count))
    out.print(ops)
    if info["subgraphs"]:
        out.print(f"subgraphs: {info['subgraphs']}")
    if info["external_data"]:
        out.print(f"external data files: {info['external_data']}")
    print_analysis(out, info["analysis"], top)


@app.command()
def diff(
    a: Annotated[Path, typer.Argument(help="Reference model (before).")],
    b: Annotated[Path, typer.Argument(help="Candidate model (after).")],
    inputs: Annotated[
        str | None,
        typer.Option("--inputs", help="Data for the numeric diff (.npz, folder, module:function, or 'random')."),
    ] = None,
    samples: Annotated[int, typer.Option(help="Samples used by the numeric diff.")] = 8,
    json_out: Annotated[str | None, typer.Option("--json", help="Write JSON to FILE ('-': stdout only).")] = None,
    html: Annotated[Path | None, typer.Option("--html", help="Write a self-contained HTML page.")] = None,
    top: Annotated[int, typer.Option(help="Rows in ranked tables.")] = 10,
) -> None:
    """Diff two models: nodes, ops, weights, opsets, QDQ coverage; with --inputs, layer-by-layer error and the
    layer where it first jumps."""
    from qgraph.diff import diff_files
    from qgraph.diff.html import write_text_atomic
    from qgraph.diff.render import diff_html, diff_json, dumps, print_numeric, print_structural

    structural, numeric = diff_files(a, b, inputs=inputs, samples=samples)
    if json_out == "-":
        sys.stdout.write(dumps(diff_json(structural, numeric, top)))
    else:
        print_structural(out, structural, top)
        if numeric is not None:
            print_numeric(out, numeric, top)
        if json_out:
            console.print(f"wrote {write_text_atomic(json_out, dumps(diff_json(structural, numeric, top)))}")
    if html is not None:
        console.print(f"wrote {write_text_atomic(html, diff_html(structural, numeric, top))}")


@app.command()
def sensitivity(
    model_float: Annotated[Path, typer.Argument(help="Float ONNX model (the reference).")],
    model_qdq: Annotated[Path, typer.Argument(help="QDQ model of it (from qgraph or any other tool).")],
    data: Annotated[str, typer.Option("--data", help="Evaluation data: .npz, folder, or module:function.")],
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the table (and search) as JSON.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a bar chart (.svg, or .png).")] = None,
    jobs: Annotated[int, typer.Option("--jobs", min=1, help="Worker processes measuring nodes.")] = 1,
    target: Annotated[
        str | None, typer.Option("--target", help="Fall back until met: cosine:0.99 | sqnr:30 | mod:fn>=float-1%.")
    ] = None,
    patch: Annotated[Path | None, typer.Option("--patch", help="Write the decision as a recipe patch.")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the best model found.")] = None,
    max_nodes: Annotated[int | None, typer.Option("--max-nodes", help="Keep at most N nodes in float.")] = None,
    max_time: Annotated[float | None, typer.Option("--max-time", help="Search budget in seconds.")] = None,
    samples: Annotated[int | None, typer.Option("--samples", help="Use at most N samples of --data.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")] = False,
) -> None:
    """Rank quantized nodes by how much returning each one alone to float helps; with --target, fall back
    the most sensitive nodes until the target is met (exit 1 when it cannot be: the best model is still written)."""
    from qgraph.passes.float_fallback.report import run_command

    code = run_command(model_float, model_qdq, data, json_path=json_path, plot=plot, jobs=jobs, target=target,
                       patch=patch, output=output, max_nodes=max_nodes, max_time=max_time, samples=samples,
                       quiet=quiet, out=out, console=console)
    if code:
        raise typer.Exit(code)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, mapping qgraph errors to exit codes without tracebacks."""
    try:
        code = app(args=argv, standalone_mode=False)
    except QGraphError as exc:
        if _STATE["debug"]:
            raise
        console.print("[bold red]error:[/]", end=" ")
        console.print(exc.message, markup=False, highlight=False, soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:
        console.print("interrupted: no output was written.")
        return 130
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        return 130
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            return 2
        raise
    return int(code) if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
