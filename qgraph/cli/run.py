"""``qgraph run``: a recipe on a model, with progress, a summary of every decision, and the outputs checked first."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import qgraph.cli._app as _app
from qgraph.cli._app import (
    AddressOption,
    DataLayout,
    ExecutorOption,
    QGraphCommand,
    app,
    data_path,
    emit,
    executor_spec,
    need_positive,
    say,
    spec_file,
)
from qgraph.cli.check import LabelsOption, MetricOption

if TYPE_CHECKING:
    from qgraph.analysis.fidelity import OutputCheck
    from qgraph.pipeline.pass_result import PassResult
    from qgraph.pipeline.runner import PipelineEvent, PipelineResult
    from qgraph.runtime.evaluation import Evaluation

#: Items of each kind (skipped nodes, unmatched criteria, decisions) shown per pass in the terminal.
SHOWN_PER_PASS = 3


@app.command(cls=QGraphCommand)
def run(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")],
    models: Annotated[list[Path], typer.Argument(help="Input ONNX model(s) (never modified); several need "
                                                 "--out-dir.", show_default=False, metavar="MODEL")],
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Output ONNX model (one MODEL).")] = None,
    calibration_data: Annotated[
        str | None, typer.Option("--calibration-data", help=".npz, folder of .npz/.npy, or module:function.")
    ] = None,
    samples: Annotated[
        int | None, typer.Option("--samples", min=1, help="Read at most N calibration samples (default: the "
                                 "recipe's calibration.samples, 1024 unless set).")
    ] = None,
    data_layout: Annotated[
        DataLayout, typer.Option("--data-layout", help="How arrays in an .npz map to samples: auto, samples "
                                 "(axis 0 indexes samples) or batched (each row is a batch of one).")
    ] = "auto",
    verify: Annotated[bool, typer.Option("--verify", help="Check float-preserving passes numerically.")] = False,
    tolerance: Annotated[float, typer.Option(help="Verify tolerance: max abs err <= tol * max|output|.")] = 1e-5,
    report: Annotated[Path | None, typer.Option("--report", help="Write a report (.json or .html).")] = None,
    eval_data: Annotated[str | None, typer.Option("--eval-data", help="Held-out data the check and the report "
                                                  "measure on (default: the calibration data).")] = None,
    labels: LabelsOption = None,
    metric: MetricOption = None,
    patch: Annotated[
        list[Path] | None, typer.Option("--patch", help="Recipe patch(es) to append (e.g. from fallback).")
    ] = None,
    check: Annotated[bool, typer.Option("--check/--no-check", help="At the end, measure each output against the "
                                        "float model (SQNR, cosine, top-1) on --eval-data, else on 8 calibration "
                                        "samples; one run of each model.")] = True,
    min_sqnr: Annotated[float | None, typer.Option("--min-sqnr", metavar="DB", help="Exit 3 (the model is still "
                                                   "written) when an output's SQNR is below DB or not finite.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display and no per-pass lines.")] = False,
    out_dir: Annotated[Path | None, typer.Option("--out-dir", help="Several models: write DIR/<model stem>.int8.onnx "
                                                  "for each (each model a task; see --executor).")] = None,
    executor: ExecutorOption = "local",
    address: AddressOption = None,
    jobs: Annotated[int | None, typer.Option("--jobs", min=1, help="With --out-dir: models run at once (local "
                                             "processes, default 1; Ray: default the cluster's CPUs).")] = None,
) -> None:
    """Run RECIPE on MODEL and write the transformed model to OUTPUT; or on MODEL... into --out-dir (a summary
    table, exit 1 when any model failed; the others are still written)."""
    if out_dir is not None or len(models) != 1:
        from qgraph.cli.many import run_many_command

        if out_dir is None:
            raise_usage(f"{len(models)} models given: write them with --out-dir DIR (DIR/<model stem>.int8.onnx "
                        "each), or give one model and -o OUTPUT.")
        if output is not None:
            raise_usage("-o/--output names one model's output; with --out-dir every output is DIR/<model stem>"
                        ".int8.onnx: drop -o.")
        if report is not None or eval_data or labels or metric or min_sqnr is not None:
            raise_usage("--report, --eval-data, --labels, --metric and --min-sqnr work on one model: run it alone "
                        "with -o.")
        code = run_many_command(recipe, models, out_dir, patches=patch or [], spec=executor_spec(executor, address,
                                jobs), calibration_data=calibration_data, samples=samples, data_layout=data_layout,
                                verify=verify, tolerance=tolerance, quiet=quiet)
        if code:
            raise typer.Exit(code)
        return
    if output is None:
        raise_usage("Missing option '-o' / '--output': give -o OUTPUT (the transformed model), or --out-dir DIR "
                    "for several models.")
    if executor != "local" or address is not None or jobs is not None:
        raise_usage("--executor, --address and --jobs run several models (--out-dir); one model runs here.")
    _run_one(recipe, models[0], output, calibration_data, samples, data_layout, verify, tolerance, report, eval_data,
             labels, metric, patch, quiet, check, min_sqnr)


def raise_usage(message: str) -> NoReturn:
    """Raise `UsageError` (exit 2) with ``message``."""
    from qgraph.errors import UsageError

    raise UsageError(message)


def _run_one(recipe: Path, model: Path, output: Path, calibration_data: str | None, samples: int | None,
             data_layout: DataLayout, verify: bool, tolerance: float, report: Path | None, eval_data: str | None,
             labels: str | None, metric: str | None, patch: list[Path] | None, quiet: bool, check: bool = True,
             min_sqnr: float | None = None) -> None:
    """The single-model ``qgraph run``."""
    from qgraph.pipeline.recipe import Recipe

    need_positive(tolerance, "--tolerance")
    if report is not None and report.suffix.lower() not in (".html", ".json"):
        from qgraph.errors import UsageError

        raise UsageError(f"--report {report}: give a .html or .json file name.")
    if (eval_data or labels or metric) and report is None and not check:
        raise_usage("--eval-data, --labels and --metric choose what the check and the report measure: drop "
                    "--no-check or give --report.")
    if (labels or metric) and not eval_data:
        raise_usage("--labels and --metric need --eval-data (held-out samples to score).")
    if min_sqnr is not None and (not check or math.isnan(min_sqnr) or math.isinf(min_sqnr)):
        raise_usage(f"--min-sqnr {min_sqnr}: give a finite number of dB, without --no-check.")
    from qgraph.io.outputs import check_outputs

    inputs = [recipe, model, data_path(calibration_data), data_path(eval_data), spec_file(labels), spec_file(metric),
              *(patch or [])]
    check_outputs({"-o": output, "--report": report}, inputs=inputs, models=["-o"])
    rec = Recipe.from_yaml(recipe)
    for p in patch or []:
        rec = rec.apply_patch(p)
    if calibration_data is None and rec.calibration.data:  # the recipe names its data: a file this run reads too
        check_outputs({"-o": output, "--report": report}, inputs=[*inputs, spec_file(rec.calibration.data)],
                      models=["-o"])
    if min_sqnr is not None and not (eval_data or calibration_data or rec.calibration.data):
        raise_usage("--min-sqnr needs samples to measure on: give --eval-data or --calibration-data.")
    pipeline = rec.pipeline()
    evaluation = _evaluation(model, eval_data, labels, metric)  # its data, labels and metric checked before the run
    if _stream(pipeline.passes, model, output, verify or report is not None or bool(patch), quiet):
        return
    progress = Progress(
        SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=_app.console, disable=not _app.live_progress(_app.console, quiet),
    )
    on_event = _progress_listener(progress, rec.name, len(pipeline.passes), quiet)
    with progress:
        result = pipeline.run(model, calibration_data=calibration_data, verify=verify, verify_tolerance=tolerance,
                              on_event=on_event, keep_stages=report is not None, samples=samples,
                              data_layout=data_layout, keep_input=report is not None)
    for decision in result.load_decisions:
        say(f"  {decision}")
    from qgraph.pipeline.timing import run_timing

    timing = run_timing(result.records, result.float_inference)
    if timing is not None and not quiet:
        say(f"  {timing.line()}")
    if not quiet and result.calibration_data is not None:
        for note in result.calibration_data.notes():
            say(f"  data: {note}")
    result.save(output)
    say(f"wrote {output}")
    from qgraph.errors import QGraphError

    try:
        outcome = _check(model, output, result, evaluation, min_sqnr) if check else None
    except QGraphError as exc:  # the user's metric failed on the outputs: the model is written all the same
        exc.message = f"{exc.message} ({output} was written before the check failed.)"
        raise
    if report is not None:
        from qgraph.analysis.report import write_report

        write_report(report, rec, result, evaluation, outcome.to_dict() if outcome is not None else None)
        say(f"wrote report {report}")
    unmet = [f"pass #{r.index} {r.name}: {r.result.unmet}" for r in result.records if r.result.unmet]
    if unmet:
        from qgraph.errors import PassError

        raise PassError("; ".join(unmet) + ". Exit 1: a goal of the recipe was not reached.")
    failed = outcome.failures(min_sqnr) if outcome is not None and min_sqnr is not None else []
    if outcome is not None and failed:
        from qgraph.errors import FidelityError

        raise FidelityError(f"{'; '.join(failed)}: below --min-sqnr {min_sqnr:g} dB on {outcome.data}. {output} was "
                            f"written; exit 3. See where the error comes from with qgraph diff {model} {output} "
                            "--eval-data DATA, or keep the worst layers in float (float_fallback).")


def _evaluation(model: Path, eval_data: str | None, labels: str | None, metric: str | None) -> Evaluation | None:
    """``--eval-data`` with its labels and metric, opened against the input model's inputs (read without its
    weights) before any pass runs: a bad label file or metric fails before ``-o`` is written."""
    if eval_data is None:
        return None
    import onnx

    from qgraph.io.model_io import load_model
    from qgraph.runtime.evaluation import Evaluation

    try:
        header = onnx.load(str(model), load_external_data=False)
    except Exception:  # unreadable: the loader's own message
        header = load_model(model)
    return Evaluation.open(header, eval_data, labels=labels, metric=metric)


def _stream(passes: list[Any], model: Path, output: Path, in_memory: bool, quiet: bool) -> bool:
    """A recipe of one pass that streams files (`Pass.streams_file`) over a model with external data: transform the
    file one initializer at a time (its weights never all in memory); False when the pipeline must run instead."""
    from qgraph.io.model_io import external_data_files

    if len(passes) != 1 or in_memory or not passes[0].streams_file() or not external_data_files(model):
        return False
    import time

    start = time.perf_counter()
    result = passes[0].run_file(model, output)
    if not quiet:
        say("  streamed: the model's weights are read, transformed and written one initializer at a time")
        print_pass(_app.console, passes[0].name, result, time.perf_counter() - start, None)
    say(f"wrote {output}")
    return True


def _check(model: Path, output: Path, result: PipelineResult, evaluation: Evaluation | None,
           min_sqnr: float | None = None) -> OutputCheck | None:
    """Measure the written model against the input model and print one line per output (see `qgraph.analysis.fidelity`),
    and a warning line when the result is poor, gate or not (unless ``--min-sqnr`` fails: its error says it); None
    when no pass changed float results or there is no data. The model measured is the one in memory that was
    written, never the file read back: another process may have replaced it since."""
    if not any(r.changed and not r.preserves_float for r in result.records):
        return None  # float-preserving passes only: --verify is their check
    from qgraph.analysis.fidelity import check_fidelity

    outcome = check_fidelity(result.input_model or model, result.model, result.calibration_data, evaluation,
                             result.kernel_choice)
    if outcome is None:
        say("check: no data to measure the transformed model against the float model on: give --eval-data or "
            "--calibration-data (or run qgraph diff MODEL OUTPUT --eval-data DATA).")
        return None
    for line in outcome.lines():
        say(line)
    warning = outcome.poor()
    if warning is not None and not (min_sqnr is not None and outcome.failures(min_sqnr)):
        say(f"{warning}. Where the error comes from: qgraph diff {model} {output} --eval-data DATA; a remedy: keep "
            "the worst layers in float (float_fallback); a gate: --min-sqnr DB.")
    return outcome


def _progress_listener(progress: Progress, name: str, total: int, quiet: bool) -> Callable[[PipelineEvent], None]:
    """A pipeline-event listener driving ``progress``: one bar for the recipe, one per long step of a pass."""
    task = progress.add_task(name, total=total)
    steps: dict[str, Any] = {}
    shown: set[str] = set()  # unmatched criteria already printed (two passes with one selector say it once)

    def on_event(ev: PipelineEvent) -> None:
        if ev.kind == "pipeline_start" and not quiet:  # found before any pass ran (`qgraph.pipeline.preflight`)
            for warning in ev.warnings:
                emit(progress.console, f"  warning: {warning}")
        elif ev.kind == "pass_start":
            progress.update(task, description=f"{name}: {ev.pass_name}")
        elif ev.kind == "pass_progress" and ev.task is not None:
            key = f"{ev.pass_name}: {ev.task}"
            if key not in steps:
                steps[key] = progress.add_task(f"  {key}", total=ev.of)
            progress.update(steps[key], completed=ev.done, total=ev.of)
        elif ev.kind == "pass_end" and ev.result is not None:
            for key in [k for k in steps if k.startswith(f"{ev.pass_name}: ")]:
                progress.remove_task(steps.pop(key))
            progress.advance(task)
            if not quiet:
                print_pass(progress.console, ev.pass_name or "?", ev.result, ev.seconds or 0.0, ev.peak_rss_mb,
                           failed=ev.failed is not None, shown=shown)
        elif ev.kind == "verify" and ev.verify and not quiet:
            print_verified(progress.console, ev, explain="explained" not in steps)
            steps["explained"] = True

    return on_event


def print_verified(console: Any, ev: PipelineEvent, explain: bool) -> None:
    """The verification line of a pass: its worst output against that output's tolerance; with ``explain``, also
    where the tolerance comes from when the model's noise floor raised it (`qgraph.pipeline.verify`)."""
    if all(d.values == 0 for d in ev.verify or []):  # every output empty (a zero-size dim): nothing was measured
        console.print("    verify: nothing could be compared: every output was empty (0 values) on the verification "
                      "inputs; the pass is not verified", markup=False, highlight=False)
        return
    tol = ev.tolerance
    limits = [tol.for_output(i) if tol is not None else 1.0 for i in range(len(ev.verify or []))]
    i, worst = max(enumerate(ev.verify or []), key=lambda t: t[1].relative / limits[t[0]])
    used = f" (tolerance {limits[i]:.2g})" if tol is not None else ""
    emit(console, f"    verified: worst output {worst.name} relative error {worst.relative:.2e}{used}")
    if explain and tol is not None and (tol.raised or tol.note):
        emit(console, f"    {tol.describe()}")


def print_pass(console: Any, name: str, r: PassResult, seconds: float, peak_rss_mb: float | None,
               failed: bool = False, shown: set[str] | None = None) -> None:
    """One line per pass plus the decisions needing attention (all of them, first), its other decisions, unmatched
    selector criteria and skipped nodes (first few of each);
    ``failed``: it ran but failed --verify (marked ✗, the error follows); ``shown``: unmatched criteria an earlier
    pass printed (not repeated; added to)."""
    peak = f", peak {peak_rss_mb:.0f} MB" if peak_rss_mb is not None else ""
    mark = "✗" if failed else "✓"
    head = (f"  {mark} {name}: matched {r.matched}, rewritten {r.rewritten}, skipped {len(r.skipped)}, "
            f"+{r.nodes_added}/-{r.nodes_removed} nodes ({seconds:.2f}s{peak})")
    emit(console, head, style="red" if failed else None)
    for text in r.attention:  # never cut: part of the model left float, or a data problem (`PassResult.decide`)
        emit(console, f"    attention: {text}")
    flagged = set(r.attention)
    routine = [d for d in r.decisions if d not in flagged]
    unmatched = [u for u in dict.fromkeys(r.unmatched) if shown is None or u not in shown]
    if shown is not None:
        shown.update(unmatched)
    for label, items in (("decision", routine), ("matched nothing", unmatched)):
        for text in items[:SHOWN_PER_PASS]:
            emit(console, f"    {label}: {text}")
        if len(items) > SHOWN_PER_PASS:
            emit(console, f"    ... {len(items) - SHOWN_PER_PASS} more ({label}); see --report")
    if r.skipped:
        reasons = "; ".join(f"{s.node}: {s.reason}" for s in r.skipped[:SHOWN_PER_PASS])
        more = f" (+{len(r.skipped) - SHOWN_PER_PASS} more in --report)" if len(r.skipped) > SHOWN_PER_PASS else ""
        emit(console, f"    skipped {len(r.skipped)}: {reasons}{more}")
