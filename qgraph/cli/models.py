"""Model commands: ``lower``, ``inspect`` and ``diff``."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

import qgraph.cli._app as _app
from qgraph.cli._app import (
    KernelsOption,
    QGraphCommand,
    TargetCpuOption,
    app,
    check_kernel_options,
    data_path,
    need_positive,
    say,
    spec_file,
)
from qgraph.cli.check import LabelsOption, MetricOption
from qgraph.io.outputs import check_output, check_outputs


@app.command(cls=QGraphCommand)
def lower(
    model: Annotated[Path, typer.Argument(help="Input ONNX model (never modified).")],
    opset: Annotated[int, typer.Option("--opset", help="Target opset (lower or higher than the model's).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output ONNX model.")],
    verify: Annotated[bool, typer.Option("--verify", help="Compare outputs with the input model in ORT.")] = False,
    tolerance: Annotated[float, typer.Option(help="Verify tolerance: max abs err <= tol * max|output|.")] = 1e-5,
) -> None:
    """Rewrite MODEL so it is valid at --opset and computes the same results (lowering or raising)."""
    from qgraph.graph.opsets import check_opset, model_opset
    from qgraph.io.model_io import load_model, read_header
    from qgraph.pipeline.pass_api import get_pass
    from qgraph.pipeline.runner import Pipeline

    check_opset(opset, "--opset")
    need_positive(tolerance, "--tolerance")
    check_output(output, inputs=[model], model=True)
    if not Path(model).is_file():
        load_model(model)  # raises the usual ModelError (missing file, a folder)
    current = model_opset(read_header(model), opset)  # the opset without reading the weights: the pipeline does
    name = "lower_opset" if opset <= current else "raise_opset"
    result = Pipeline([get_pass(name)(opset=opset)], name=f"{name}-{opset}").run(
        model, verify=verify, verify_tolerance=tolerance, keep_input=False)
    for note in [*result.records[0].result.decisions, *result.records[0].result.notes]:
        say(note)
    result.save(output)
    say(f"wrote {output}")


@app.command(cls=QGraphCommand)
def inspect(
    model: Annotated[Path | None, typer.Argument(help="ONNX model (not needed with --host).")] = None,
    host: Annotated[bool, typer.Option("--host", help="This machine instead: its CPU, what onnxruntime's integer "
                                       "kernels compute here, and which ready recipe fits it.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    opset: Annotated[int | None, typer.Option(help="Check ops against this target opset.")] = None,
    target: Annotated[str | None, typer.Option(help="Check int8 support on a target preset.")] = None,
    inputs: Annotated[
        str | None, typer.Option("--inputs", help="Data for activation ranges (.npz, folder, module:function).")
    ] = None,
    samples: Annotated[int, typer.Option(min=1, help="Samples read from --inputs.")] = 8,
    top: Annotated[int, typer.Option(min=1, help="Rows per analysis table.")] = 10,
) -> None:
    """Summarize a model (opset, IR, ops, I/O, weights, subgraphs, external data) and analyse it: QDQ coverage,
    foldable BatchNorms, ops unsupported at --opset or on --target, extreme ranges, int16 saturation risk; with
    --host, this machine: CPU, integer-kernel arithmetic and the recipe that fits it."""
    from qgraph.analysis.diff.render import dumps, print_analysis
    from qgraph.analysis.inspect import inspect_model
    from qgraph.errors import UsageError
    from qgraph.graph.opsets import check_opset

    if host:
        from qgraph.runtime.kernels.guide import host_lines, host_report

        if model is not None:
            raise UsageError("qgraph inspect --host describes this machine: give no MODEL with it.")
        report = host_report()
        if as_json:
            sys.stdout.write(dumps(report))
        else:
            for line in host_lines(report):
                _app.out.print(line, markup=False, highlight=False, soft_wrap=True)
        return
    if model is None:
        raise UsageError("qgraph inspect needs a MODEL (or --host for this machine).")

    if opset is not None:
        check_opset(opset, "--opset")
    data_path(inputs)
    info = inspect_model(model, opset=opset, target=target, inputs=inputs, samples=samples)
    if as_json:
        sys.stdout.write(dumps(info))
        return
    out = _app.out
    out.print(f"{model}  IR {info['ir_version']}  opsets {info['opsets']}  "
              f"{info['nodes']} nodes  {info['initializer_bytes'] / 1e6:.2f} MB weights", markup=False)
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
        out.print(f"subgraphs: {info['subgraphs']}", markup=False)
    if info.get("node_naming"):
        out.print(f"node names: {info['node_naming']}", markup=False)
    if info["external_data"]:
        out.print(f"external data files: {info['external_data']}", markup=False)
    print_analysis(out, info["analysis"], top)


@app.command(cls=QGraphCommand)
def diff(
    a: Annotated[Path, typer.Argument(help="Reference model (before).")],
    b: Annotated[Path, typer.Argument(help="Candidate model (after).")],
    inputs: Annotated[
        str | None,
        typer.Option("--eval-data", "--inputs", help="Held-out data for the numeric diff (.npz, folder, "
                     "module:function, or 'random')."),
    ] = None,
    samples: Annotated[int, typer.Option(min=1, help="Samples used by the numeric diff.")] = 8,
    labels: LabelsOption = None,
    metric: MetricOption = None,
    exact_top: Annotated[int, typer.Option("--exact-top", min=0, help="Q/DQ pairs measured alone (the others "
                                           "are ranked by the noise they inject).")] = 16,
    json_out: Annotated[str | None, typer.Option("--json", help="Write JSON to FILE ('-': stdout only).")] = None,
    html: Annotated[Path | None, typer.Option("--html", help="Write a self-contained HTML page.")] = None,
    top: Annotated[int, typer.Option(min=1, help="Rows in ranked tables.")] = 10,
    whole_outputs: Annotated[bool, typer.Option("--whole-outputs", help="Compare an output that a final Concat "
                             "joins from different tensors (a detector's boxes and class scores) only as one tensor, "
                             "and rank Q/DQ pairs by it; default: a row per part too, the ranking on the worst "
                             "part.")] = False,
    kernels: KernelsOption = "auto",
    target_cpu: TargetCpuOption = None,
) -> None:
    """Diff two models: nodes, ops, weights, opsets, QDQ coverage; with --eval-data, layer-by-layer error, top-1
    agreement and your metric, and the Q/DQ pairs ranked by the output error they cause (and why)."""
    from qgraph.analysis.diff import diff_files
    from qgraph.analysis.diff.render import diff_html, diff_json, dumps, print_numeric, print_structural
    from qgraph.io.outputs import write_atomic

    json_file = None if json_out in (None, "-") else json_out
    check_outputs({"--json": json_file, "--html": html},
                  inputs=[a, b, None if inputs == "random" else data_path(inputs), spec_file(labels),
                          spec_file(metric)])
    need_positive(samples, "--samples")
    check_kernel_options(kernels, target_cpu)
    structural, numeric = diff_files(a, b, inputs=inputs, samples=samples, labels=labels, metric=metric,
                                     exact_top=exact_top, whole_outputs=whole_outputs, kernels=kernels,
                                     target_cpu=target_cpu)
    if json_out == "-":
        sys.stdout.write(dumps(diff_json(structural, numeric, top)))
    else:
        print_structural(_app.out, structural, top)
        if numeric is not None:
            print_numeric(_app.out, numeric, top)
        if json_file:
            say(f"wrote {write_atomic(json_file, dumps(diff_json(structural, numeric, top)))}")
    if html is not None:
        from qgraph.analysis.diff.graphview import changed_regions_html
        from qgraph.io.model_io import load_model

        view = changed_regions_html(load_model(a), load_model(b), numeric)
        say(f"wrote {write_atomic(html, diff_html(structural, numeric, top, view))}")
    problem = numeric.problem() if numeric is not None else None
    if problem is not None:
        from qgraph.errors import VerificationError

        raise VerificationError(problem)
