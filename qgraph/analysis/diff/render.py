"""Render diffs: terminal tables (rich), JSON, and one self-contained HTML page with inline SVG charts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from qgraph.analysis.diff.html import (
    BLUE,
    ORANGE,
    RED,
    esc,
    fmt,
    histogram_chart,
    layer_chart,
    page,
    section,
    table,
)
from qgraph.analysis.diff.layers import LayerDiff, NumericDiff, json_number
from qgraph.analysis.diff.qdq import QdqCoverage
from qgraph.analysis.diff.render_culprits import culprits_html, evaluation_line, print_culprits
from qgraph.analysis.diff.structural import ModelFacts, StructuralDiff
from qgraph.analysis.diff.tables import rich_table as _rich_table
from qgraph.analysis.diff.tables import sqnr_cell

_HTML_ROWS = 500  # rows per HTML table before "... N more"


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def _facts_line(label: str, f: ModelFacts) -> str:
    size = _mb(f.file_bytes if f.file_bytes is not None else f.model_bytes)
    return (f"{label}: {f.path or '<memory>'}  IR {f.ir_version}  opsets {f.opsets}  {f.nodes} nodes  "
            f"{f.initializers} initializers ({_mb(f.initializer_bytes)})  size {size}")


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value) and not any(ch.isspace() for ch in value)


def _clip(rows: list[list[Any]], top: int) -> tuple[list[list[Any]], int]:
    return rows[:top], max(0, len(rows) - top)


def coverage_rows(a: QdqCoverage | None, b: QdqCoverage) -> list[list[Any]]:
    """``op, int8, partial, float`` rows (``before → after`` when ``a`` is given)."""
    ba = a.by_op() if a is not None else {}
    bb = b.by_op()
    rows: list[list[Any]] = []
    for op in sorted(set(ba) | set(bb)):
        x = ba.get(op, {"int8": 0, "partial": 0, "float": 0})
        y = bb.get(op, {"int8": 0, "partial": 0, "float": 0})
        if a is None:
            rows.append([op, y["int8"], y["partial"], y["float"]])
        else:
            rows.append([op, *(f"{x[k]} → {y[k]}" for k in ("int8", "partial", "float"))])
    return rows


def float_node_rows(cov: QdqCoverage) -> list[list[Any]]:
    """Quantizable nodes that are not fully int8, with the reason when known."""
    return [[n.node, n.op, n.status, n.dtypes, n.reason] for n in cov.nodes if n.status != "int8"]


def _layer_rows(layers: Sequence[LayerDiff]) -> list[list[Any]]:
    return [[d.label, d.op_label, d.tensor, sqnr_cell(d.sqnr_db), sqnr_cell(d.input_sqnr_db, "exact inputs"),
             d.drop_db, sqnr_cell(d.layer_sqnr_db, "adds none"), d.cosine, d.max_abs, d.rel_l2] for d in layers]


_LAYER_HEAD = ["node", "op", "tensor", "SQNR dB", "input SQNR dB", "drop dB", "layer SQNR dB", "cosine", "max abs",
               "rel L2"]
_OUT_HEAD = ["output", "SQNR dB", "cosine", "max abs", "relative", "rel L2"]


def _output_rows(outputs: Sequence[LayerDiff]) -> list[list[Any]]:
    """Rows of the outputs table; a part of an output (`qgraph.runtime.output_parts`) is marked ``↳`` under its
    output."""
    return [[f"↳ {d.tensor}" if d.part is not None else d.tensor if d.candidate is None else
             f"{d.tensor} ↔ {d.candidate}", sqnr_cell(d.sqnr_db), d.cosine, d.max_abs, d.relative, d.rel_l2]
            for d in outputs]


def part_lines(n: NumericDiff) -> list[str]:
    """One sentence per output scored in parts (or a Concat output kept whole, and why)."""
    return n.output_parts.decisions() if n.output_parts is not None else []


def body_lines(n: NumericDiff) -> list[str]:
    """One line per If/Loop body: what was compared inside it, or that it did not run (never "no error")."""
    return [f"body {scope}: {status}" + ("" if status.startswith("observed") else "; nothing inside it is compared")
            for scope, status in n.bodies.items()]


# --------------------------------------------------------------------------------------------- terminal
def print_structural(console: Console, d: StructuralDiff, top: int = 10) -> None:
    """Print the structural diff as tables."""
    console.print(_facts_line("A", d.a), markup=False, highlight=False)
    console.print(_facts_line("B", d.b), markup=False, highlight=False)
    s = d.summary()
    init = s["initializers"]
    console.print(
        f"[bold]nodes[/] +{s['added']} -{s['removed']} ~{s['changed']} (renamed {s['renamed']}, unchanged "
        f"{s['unchanged']}, attribute changes {s['attribute_changes']});  [bold]initializers[/] +{init['added']} "
        f"-{init['removed']} ~{init['changed']} ({s['initializer_bytes_delta'] / 1e6:+.2f} MB)"
    )
    if d.a.ir_version != d.b.ir_version or d.a.opsets != d.b.opsets:
        console.print(f"IR {d.a.ir_version} → {d.b.ir_version}; opsets {d.a.opsets} → {d.b.opsets}",
                      markup=False, highlight=False)
    ops = sorted(set(d.ops_a) | set(d.ops_b), key=lambda o: (-abs(d.ops_b.get(o, 0) - d.ops_a.get(o, 0)), o))
    console.print(_rich_table("op histogram", ["op", "A", "B", "Δ"],
                              [[o, d.ops_a.get(o, 0), d.ops_b.get(o, 0),
                                f"{d.ops_b.get(o, 0) - d.ops_a.get(o, 0):+d}"] for o in ops]))
    if d.added:
        console.print(_rich_table("added nodes by pass", ["pass", "nodes"], list(d.added_by_pass().items())))
    rows, more = _clip([[e.node, e.op, e.pass_name or "untagged"] for e in d.added], top)
    if rows:
        console.print(_rich_table("added nodes" + (f" (first {top} of {len(d.added)})" if more else ""),
                                  ["node", "op", "created by"], rows))
    rows, more = _clip([[e.node, e.op] for e in d.removed], top)
    if rows:
        console.print(_rich_table("removed nodes" + (f" (first {top} of {len(d.removed)})" if more else ""),
                                  ["node", "op"], rows))
    rows, more = _clip([[c.node, c.op, "; ".join(c.changes[:3]) + (" ..." if len(c.changes) > 3 else "")]
                        for c in d.changed], top)
    if rows:
        console.print(_rich_table("changed nodes" + (f" (first {top} of {len(d.changed)})" if more else ""),
                                  ["node", "op", "changes"], rows))
    inits = sorted(d.initializers, key=lambda i: -max(i.bytes_before, i.bytes_after))
    rows, more = _clip([[i.name, i.kind, i.before, i.after, i.bytes_after - i.bytes_before] for i in inits], top)
    if rows:
        console.print(_rich_table("initializers (largest first)" + (f", {more} more" if more else ""),
                                  ["name", "kind", "before", "after", "Δ bytes"], rows))
    rows, more = _clip([[b.node, f"{b.bits}-bit / {b.block_size}", f"{b.weight_sqnr_db:.1f}",
                         f"column {b.worst_column}, inputs {b.worst_channels[0]}..{b.worst_channels[1] - 1}",
                         f"{b.worst_block_sqnr_db:.1f}", f"{100 * b.worst_block_share:.1f}%"] for b in d.blocks], top)
    if rows:
        console.print(_rich_table("block-quantized weights vs A (worst first)" + (f", {more} more" if more else ""),
                                  ["node", "bits / block", "weight SQNR dB", "worst block", "its SQNR dB",
                                   "its share of the error"], rows))
    if d.has_quantization():
        ca, cb = d.coverage_a.counts(), d.coverage_b.counts()
        console.print(_rich_table(
            f"QDQ coverage: int8 {ca['int8']} → {cb['int8']} of {len(d.coverage_b.nodes)} quantizable "
            f"({cb['int8'] / max(len(d.coverage_b.nodes), 1):.0%}); Q/DQ nodes {d.coverage_b.quantize_nodes}/"
            f"{d.coverage_b.dequantize_nodes}",
            ["op", "int8", "partial", "float"], coverage_rows(d.coverage_a, d.coverage_b)))
        wide = d.coverage_b.wide
        if wide:
            names = ", ".join(n.node for n in wide[:top]) + (f", ... {len(wide) - top} more" if len(wide) > top else "")
            console.print(f"of which {len(wide)} read 16-bit activations ({wide[0].dtypes}...): {names}",
                          markup=False, highlight=False, soft_wrap=True)
        rows, more = _clip(float_node_rows(d.coverage_b), top)
        if rows and d.coverage_b.dequantize_nodes:
            console.print(_rich_table("not int8 in B" + (f" (first {top}, {more} more)" if more else ""),
                                      ["node", "op", "status", "dtypes", "why"], rows))
    if d.provenance:
        keys = ["pass", "matched", "rewritten", "skipped", "nodes_before", "nodes_after"]
        console.print(_rich_table(f"provenance of B (recipe {d.recipe or '?'})", keys,
                                  [[p.get(k, "") for k in keys] for p in d.provenance]))


def print_numeric(console: Console, n: NumericDiff, top: int = 10) -> None:
    """Print the numeric diff: outputs, where the error first jumps, layers that introduced it, worst."""
    console.print(f"[bold]numeric diff[/] on {n.samples} sample(s), {len(n.layers)} tensors compared "
                  f"in {n.runs} run(s); {len(n.skipped)} skipped")
    if n.rescaled:
        console.print(f"{len(n.rescaled)} tensor(s) rescaled by equalization (recorded per-channel factors undone "
                      f"before comparing): {', '.join(n.rescaled[:4])}{' ...' if len(n.rescaled) > 4 else ''}",
                      markup=False, highlight=False)
    console.print(_rich_table("outputs", _OUT_HEAD, _output_rows(n.output_rows())))
    for line in [*part_lines(n), *body_lines(n)]:
        console.print(line, markup=False, highlight=False)
    if n.evaluation is not None:
        console.print(evaluation_line(n.evaluation), markup=False, highlight=False)
    if n.attribution is not None:
        print_culprits(console, n.attribution, top)
    problem = n.problem()
    if problem is not None:
        console.print("error:", style="bold red", end=" ")
        console.print(problem, markup=False, highlight=False)
    first = n.first_jump
    if first is None:
        console.print(f"no layer drops SQNR by ≥ {n.jump_db:g} dB with its own error above the "
                      f"{n.noise_floor_db:g} dB noise floor.")
    else:
        console.print(f"[bold red]error first jumps at[/] {first.label} ({first.op_label}) → {first.tensor}: "
                      f"SQNR {fmt(first.sqnr_db)} dB from inputs at {fmt(first.input_sqnr_db)} dB", highlight=False)
    console.print(_rich_table(f"layers that introduced error (top {top}, most error first)", _LAYER_HEAD,
                              _layer_rows(n.introduced(top))))
    console.print(_rich_table(f"worst layers (top {top}, by SQNR)", _LAYER_HEAD, _layer_rows(n.worst(top))))
    console.print("inf (exact): identical values; inf (adds none): the layer's error is no larger than its "
                  "input's (e.g. a quantized Gemm averaging its inputs' noise).", style="dim", highlight=False)


def print_analysis(console: Console, a: dict[str, Any], top: int = 10) -> None:
    """Print the analyses of ``qgraph inspect`` (the ``analysis`` dict of `qgraph.analysis.inspect.inspect_model`)."""
    cov = a["qdq_coverage"]
    if cov["quantizable"]:
        counts = cov["counts"]
        console.print(_rich_table(
            f"QDQ coverage: {counts.get('int8', 0)} of {cov['quantizable']} quantizable nodes in integer "
            f"({cov['fraction_int8']:.0%}); Q/DQ nodes {cov['quantize_nodes']}/{cov['dequantize_nodes']}",
            ["op", "int8", "partial", "float"],
            [[op, c["int8"], c["partial"], c["float"]] for op, c in cov["by_op"].items()]))
        wide = [n for n in cov["nodes"] if n["status"] == "int8" and "16" in n["dtypes"]]
        if wide:
            names = ", ".join(n["node"] for n in wide[:top]) + (f", ... {len(wide) - top} more" if len(wide) > top
                                                                  else "")
            console.print(f"of which {len(wide)} read 16-bit activations ({wide[0]['dtypes']}...): {names}",
                          markup=False, highlight=False, soft_wrap=True)
    bn = a["batchnorm"]
    if bn["total"]:
        console.print(f"BatchNormalization: {bn['foldable']} of {bn['total']} foldable", highlight=False)
        rows, _ = _clip([[b["node"], b["reason"]] for b in bn["not_foldable"]], top)
        if rows:
            console.print(_rich_table("BatchNormalization not foldable", ["node", "reason"], rows))
    op = a["opset"]
    if op["unsupported"]:
        console.print(_rich_table(
            f"ops vs opset {op['target_opset']} (model opset {op['model_opset']})", ["op", "nodes", "issue"],
            [[u["op"], u["count"], u["reason"]] for u in op["unsupported"]]))
    if op["target_opset"] != op["model_opset"]:
        rows, more = _clip([[b] for b in op.get("blockers", [])], top)
        if rows:
            console.print(_rich_table(f"what blocks opset {op['target_opset']} (model opset {op['model_opset']})"
                                      + (f", {more} more" if more else ""), ["node and reason"], rows))
        else:
            changed = sum(c["count"] for c in op["version_changes"])
            console.print(f"converts to opset {op['target_opset']} with the same results ({changed} nodes whose op "
                          "definition changes are rewritten by `qgraph lower`)", highlight=False)
    elif not op["unsupported"]:
        console.print(f"every op is defined at opset {op['target_opset']}", highlight=False)
    if a.get("target"):
        t = a["target"]
        if t["float_ops"]:
            console.print(_rich_table(f"ops running in float on {t['target']} ({t['float_nodes']} nodes; "
                                      f"{t['int8_capable_nodes']} int8-capable)", ["op", "nodes"],
                                      list(t["float_ops"].items())))
        else:
            console.print(f"every op has an int8 kernel or QDQ fusion on {t['target']}", highlight=False)
    rows, more = _clip([[e["tensor"], e["kind"], e["min"], e["max"], e["spread"], e["reason"]]
                        for e in a["extreme_ranges"]], top)
    if rows:
        console.print(_rich_table("extreme ranges" + (f" (first {top}, {more} more)" if more else ""),
                                  ["tensor", "kind", "min", "max", "spread", "why"], rows))
    if a["saturation"] is None:  # not a question for this target
        return
    rows, more = _clip([[r["node"], r["op"], r["overflowing_pairs"], r["pairs"], r["worst_pair_sum"],
                         r["max_weight_code"]] for r in a["saturation"]], top)
    if not rows and cov["dequantize_nodes"]:
        console.print("int16 saturation risk (u8×s8 without VNNI): none", highlight=False)
    if rows:
        console.print(_rich_table(
            "int16 saturation risk (u8×s8 on x86 without VNNI; use reduce_range or a VNNI target)"
            + (f", {more} more" if more else ""),
            ["node", "op", "overflowing pairs", "pairs", "worst pair sum", "max |w| code"], rows))


# --------------------------------------------------------------------------------------------- JSON
def diff_json(structural: StructuralDiff, numeric: NumericDiff | None, top: int = 10) -> dict[str, Any]:
    """The whole diff as a JSON-ready dict."""
    att = numeric.attribution if numeric is not None else None
    return {"structural": structural.to_dict(), "numeric": numeric.to_dict(top) if numeric else None,
            "culprits": [c.to_dict() for c in att.culprits] if att is not None else [],
            "attribution": {k: v for k, v in att.to_dict().items() if k != "culprits"} if att is not None else None}


def dumps(data: Any) -> str:
    """JSON text with non-finite floats as strings."""
    def clean(x: Any) -> Any:
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return json_number(x)

    return json.dumps(clean(data), indent=2, default=str) + "\n"


# --------------------------------------------------------------------------------------------- HTML
def _html_rows(headers: Sequence[str], rows: list[list[Any]], table_id: str) -> str:
    shown, more = _clip(rows, _HTML_ROWS)
    note = f'<p class="muted">... {more} more rows (see the JSON output)</p>' if more else ""
    return table(headers, shown, table_id=table_id) + note


def coverage_html(a: QdqCoverage | None, b: QdqCoverage, table_id: str = "qdq-coverage") -> str:
    """Coverage table (and the nodes left float, with reasons)."""
    c = b.counts()
    head = (f"<p>{c['int8']} of {len(b.nodes)} quantizable nodes in integer ({b.fraction:.0%}), {c['partial']} "
            f"partial, {c['float']} float; {b.quantize_nodes} QuantizeLinear / {b.dequantize_nodes} "
            "DequantizeLinear.</p>")
    body = head + table(["op", "int8", "partial", "float"], coverage_rows(a, b), table_id=table_id)
    rows = float_node_rows(b)
    if rows and b.dequantize_nodes:
        body += "<h3>Not in integer, and why</h3>" + _html_rows(["node", "op", "status", "dtypes", "why"], rows,
                                                                 table_id + "-float")
    return body


def numeric_html(n: NumericDiff, top: int = 10) -> str:
    """Sections for a numeric diff: outputs, first jump, introduced, worst, per-layer chart."""
    first = n.first_jump
    hits = {id(d) for d in n.introduced()}
    colors = [RED if d is first else ORANGE if id(d) in hits else BLUE for d in n.layers]
    labels = [f"{d.label} ({d.op_label}): {d.tensor}" for d in n.layers]
    if first is None:
        jump = (f"<p>No layer drops SQNR by ≥ {n.jump_db:g} dB with its own error above the {n.noise_floor_db:g} dB "
                "noise floor.</p>")
    else:
        jump = (f'<p id="first-jump">Error first jumps at <b>{esc(first.label)}</b> ({esc(first.op_label)}) → '
                f"<code>{esc(first.tensor)}</code>: SQNR {esc(fmt(first.sqnr_db))} dB from inputs at "
                f"{esc(fmt(first.input_sqnr_db))} dB.</p>")
    culprits = culprits_html(n.attribution, top) if n.attribution is not None else ""
    return culprits + "".join([
        section("Outputs", f"<p>{n.samples} sample(s); {len(n.layers)} tensors compared in {n.runs} run(s); "
                f"{len(n.skipped)} skipped.</p>" + table(_OUT_HEAD, _output_rows(n.output_rows()), table_id="outputs")
                + "".join(f'<p class="output-parts">{esc(line)}</p>' for line in part_lines(n))
                + (f'<p id="evaluation">{esc(evaluation_line(n.evaluation))}</p>' if n.evaluation else "")
                + "".join(f'<p class="muted body-status">{esc(line)}</p>' for line in body_lines(n)),
                "outputs-section"),
        section("Per-layer error", jump + layer_chart(labels, [d.sqnr_db for d in n.layers], colors=colors,
                                                      reference=n.noise_floor_db)
                + '<p class="muted">Red: first jump; orange: layers that introduced error; hover a bar for its '
                  "name. Infinite SQNR (identical) is drawn at the top.</p>", "layers-section"),
        section(f"Layers that introduced error (top {top})",
                table(_LAYER_HEAD, _layer_rows(n.introduced(top)), table_id="introduced"), "introduced-section"),
        section(f"Worst layers (top {top})", table(_LAYER_HEAD, _layer_rows(n.worst(top)), table_id="worst"),
                "worst-section"),
    ])


def structural_html(d: StructuralDiff, top: int = 10) -> str:
    """Sections for a structural diff."""
    facts = [["A", d.a.path or "<memory>", d.a.ir_version, json.dumps(d.a.opsets), d.a.nodes, d.a.initializers,
              _mb(d.a.initializer_bytes), _mb(d.a.file_bytes or d.a.model_bytes)],
             ["B", d.b.path or "<memory>", d.b.ir_version, json.dumps(d.b.opsets), d.b.nodes, d.b.initializers,
              _mb(d.b.initializer_bytes), _mb(d.b.file_bytes or d.b.model_bytes)]]
    s = d.summary()
    ops = sorted(set(d.ops_a) | set(d.ops_b), key=lambda o: (-max(d.ops_a.get(o, 0), d.ops_b.get(o, 0)), o))
    out = [
        section("Models", table(["", "path", "IR", "opsets", "nodes", "initializers", "weights", "size"], facts,
                                table_id="models")
                + f"<p>Nodes +{s['added']} −{s['removed']} ~{s['changed']} (renamed {s['renamed']}, unchanged "
                  f"{s['unchanged']}, attribute changes {s['attribute_changes']}).</p>", "models-section"),
        section("Op histogram", histogram_chart(ops, [d.ops_a.get(o, 0) for o in ops], [d.ops_b.get(o, 0) for o in ops])
                + table(["op", "A", "B", "Δ"], [[o, d.ops_a.get(o, 0), d.ops_b.get(o, 0),
                                                 d.ops_b.get(o, 0) - d.ops_a.get(o, 0)] for o in ops],
                        table_id="ops"), "ops-section"),
        section("Nodes", "<h3>Added (by creating pass)</h3>"
                + table(["pass", "nodes"], list(d.added_by_pass().items()), table_id="added-by-pass")
                + _html_rows(["node", "op", "created by"], [[e.node, e.op, e.pass_name or "untagged"] for e in d.added],
                             "added")
                + "<h3>Removed</h3>" + _html_rows(["node", "op"], [[e.node, e.op] for e in d.removed], "removed")
                + "<h3>Changed</h3>" + _html_rows(["node", "op", "changes"],
                                                  [[c.node, c.op, "; ".join(c.changes)] for c in d.changed],
                                                  "changed"), "nodes-section"),
        section("Initializers", _html_rows(["name", "kind", "before", "after", "bytes before", "bytes after"],
                                           [[i.name, i.kind, i.before, i.after, i.bytes_before, i.bytes_after]
                                            for i in d.initializers], "initializers"), "initializers-section"),
    ]
    if d.has_quantization():
        out.append(section("QDQ coverage", coverage_html(d.coverage_a, d.coverage_b), "qdq-section"))
    if d.provenance:
        keys = ["pass", "matched", "rewritten", "skipped", "nodes_before", "nodes_after"]
        out.append(section(f"Provenance of B (recipe {d.recipe or '?'})",
                           table(keys, [[p.get(k, "") for k in keys] for p in d.provenance], table_id="provenance"),
                           "provenance-section"))
    return "".join(out)


def diff_html(structural: StructuralDiff, numeric: NumericDiff | None, top: int = 10, graph_view: str = "") -> str:
    """One self-contained HTML page for a diff (``graph_view``:
    `qgraph.analysis.diff.graphview.changed_regions_html`)."""
    title = f"qgraph diff: {structural.a.path or 'A'} → {structural.b.path or 'B'}"
    body = [structural_html(structural, top)]
    if graph_view:
        body.insert(0, section("Changed regions of the graph", graph_view, "graph-section"))
    if numeric is not None:
        body.insert(0, numeric_html(numeric, top))
    return page(title, body, subtitle=structural.short())


