"""INT8 fidelity on real-weight models: qgraph recipes vs onnxruntime's quantize_static, in the same run.

Run on demand (a few minutes on 2 cores; the corpus is built and cached on first use)::

    python benchmarks/bench_accuracy.py [--models orientation layout minilm] [--recipe my.yaml]
                                        [--recipe minilm=smooth.yaml] [--tools [vnni ...]] [--json out.json]
                                        [--keep DIR] [--eval-samples N]

Per model (see ``real_models.py`` for weights, data and metric), every tool quantizes the same float model
with the same calibration data, each in a fresh subprocess (wall time of the quantization call):

- ``ort_static``: onnxruntime ``quantize_static`` (QDQ, per-channel, MinMax, its other defaults) on the float
  graph after qgraph's preparation passes (the recipe's passes before ``insert_qdq``: BN folded), so both tools
  quantize the same graph; ``ort_static_rr`` the same with ``reduce_range`` (7-bit weights: onnxruntime's advice
  for AVX2 without VNNI); ``ort_dynamic`` (``quantize_dynamic``, per-channel s8) for the encoders;
- ``qgraph:<recipe>``: the ready recipes ``ort-x86-vnni``, ``ort-x86-avx2`` and ``tensorrt`` (static, also for
  the encoders, since static transformer quantization is what the issue asks for) and ``transformer-ort-x86-vnni``
  (dynamic) for the encoders;
- every ``--recipe PATH`` (all models) or ``--recipe MODEL=PATH`` (that model only): your passes measured
  with the same data and metric (e.g. ``cross_layer_equalization`` before ``insert_qdq``); ``--tools`` narrows
  the built-in tools (``--tools`` alone: only your recipes; ``--tools vnni ort_static``: those and yours).

Every number is measured with onnxruntime's default optimizations on the host that runs the benchmark (its
deployed kernels; the table's title names the CPU): run it under qemu-user on an emulated AVX2 CPU for an AVX2
host's accuracy numbers (``qemu-x86_64 -cpu Haswell-noTSX python benchmarks/bench_accuracy.py``; its latency column
is then meaningless).

Then, in one evaluation subprocess per model: the corpus metric of each INT8 model against float (top-1 vs
labels and agreement with float; SQNR per output slice; embedding cosine) and INT8 latency relative to float
(batch 1, 2 threads, ORT_ENABLE_ALL, blocks in a random order each round, median of per-round ratios).
``--keep DIR`` keeps the float, prepared and INT8 models and ``cal.npz``/``eval.npz`` there for
``qgraph diff float.onnx int8.onnx --eval-data eval.npz`` (which layers lose the accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import real_models as rm  # noqa: E402

ENCODERS = ("minilm", "encoder")


def tools_for(name: str, extra: list[str], only: list[str] | None = None) -> list[str]:
    """The tools run on ``name``: onnxruntime's quantizers, qgraph's ready recipes (those whose name contains one of
    ``only``, when given), then the extra recipes."""
    tools = ["ort_static", "ort_static_rr", "qgraph:ort-x86-vnni", "qgraph:ort-x86-avx2", "qgraph:tensorrt"]
    if name in ENCODERS:
        tools += ["ort_dynamic", "qgraph:transformer-ort-x86-vnni"]
    if only is not None:
        tools = [t for t in tools if any(o in t for o in only)]
    for item in extra:
        model, _, path = item.rpartition("=") if "=" in item else ("", "", item)
        if not model or model == name:
            tools.append(f"recipe:{Path(path).resolve()}")
    return tools


def _recipe_path(tool: str) -> Path:
    return (
        Path(tool.split(":", 1)[1]) if tool.startswith("recipe:") else ROOT / "recipes" / f"{tool.split(':')[1]}.yaml"
    )


def _prep_recipe(name: str) -> Path:
    return ROOT / "recipes" / ("transformer-ort-x86-vnni.yaml" if name in ENCODERS else "ort-x86-vnni.yaml")


def _sizes() -> dict[str, int]:
    """``n_eval`` from ``--eval-samples`` (passed to the children in ``QGRAPH_BENCH_EVAL``), else the defaults."""
    n = os.environ.get("QGRAPH_BENCH_EVAL")
    return {"n_eval": int(n)} if n else {}


# ---------------------------------------------------------------------------------------------- children
def prepare(name: str, folder: Path) -> dict[str, str]:
    """Write ``float.onnx``, ``prep.onnx`` (preparation passes applied), ``cal.npz``, ``eval.npz`` for ``name``."""
    from qgraph import Pipeline, Recipe

    model, cal, ev, spec = rm.load(name, **_sizes())  # the loaders' default sample counts unless --eval-samples
    folder.mkdir(parents=True, exist_ok=True)
    paths = {k: str(folder / k) for k in ("float.onnx", "prep.onnx", "cal.npz", "eval.npz")}
    onnx.save(model, paths["float.onnx"])
    recipe = Recipe.from_yaml(_prep_recipe(name))
    # the preparation: every pass before insert_qdq but smooth_quant (an accuracy technique of qgraph's, which
    # needs calibration data; onnxruntime's quantizer gets the graph with BN folded, not qgraph's smoothing)
    names = [p.name for p in recipe.passes]
    prep = [p for p in recipe.passes[: names.index("insert_qdq")] if p.name != "smooth_quant"]
    onnx.save(Pipeline(prep).run(model).model, paths["prep.onnx"])
    np.savez(paths["cal.npz"], **rm.stack(cal))
    labels = {"labels": spec.labels} if spec.labels is not None else {}
    np.savez(paths["eval.npz"], **rm.stack(ev), **labels)
    return paths


def quantize(tool: str, name: str, paths: dict[str, str], out: str) -> dict[str, Any]:
    """Quantize with ``tool`` into ``out``; returns the wall seconds of the quantization call."""
    cal = np.load(paths["cal.npz"])
    feeds = rm._split(dict(cal))
    if tool.startswith(("qgraph:", "recipe:")):
        from qgraph import Pipeline, Recipe

        recipe = Recipe.from_yaml(_recipe_path(tool))
        start = time.perf_counter()
        res = Pipeline(recipe.passes).run(paths["float.onnx"], calibration_data=paths["cal.npz"], samples=len(feeds))
        seconds = time.perf_counter() - start
        res.save(out)
        row: dict[str, Any] = {"seconds": seconds}
        for rec in res.records:  # an automatic float_fallback stage: what it kept float and its own latency view
            row.update(("latency_check", d) for d in rec.result.decisions if d.startswith("latency check"))
            auto = rec.result.details.get("auto") if rec.name == "float_fallback" else None
            if auto:
                row.update(float_nodes=len(auto["nodes"]), candidates=auto.get("candidates"),
                           fallback_latency=auto.get("latency", {}), fallback_target_met=auto["target_met"],
                           fallback_score=auto["score"])
        return row
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from qgraph.testing import ort_quantize_static

    start = time.perf_counter()
    if tool == "ort_static":
        ort_quantize_static(paths["prep.onnx"], out, feeds, per_channel=True)
    elif tool == "ort_static_rr":  # onnxruntime's advice for AVX2 without VNNI: 7-bit weights
        ort_quantize_static(paths["prep.onnx"], out, feeds, per_channel=True, reduce_range=True)
    else:
        quantize_dynamic(paths["prep.onnx"], out, weight_type=QuantType.QInt8, per_channel=True)
    return {"seconds": time.perf_counter() - start}


def evaluate(name: str, paths: dict[str, str], made: dict[str, str], rounds: int) -> dict[str, Any]:
    """Corpus metric of every model in ``made`` (tool -> path) vs float, and its latency ratio to float."""
    model, _, ev, spec = rm.load(name, **_sizes())
    reference = rm.run_model(model, ev, spec)
    results: dict[str, Any] = {"float": {"metric": rm.score(spec, reference, reference)}}
    sessions = {"float": _session(paths["float.onnx"])}
    cpu = os.environ.get("QGRAPH_BENCH_CPU")  # --cpu: every model as it deploys on that CPU
    for tool, path in made.items():
        try:
            results[tool] = {"metric": rm.score(spec, reference, rm.run_model(path, ev, spec, cpu=cpu))}
            sessions[tool] = _session(path)
        except Exception as exc:  # a model onnxruntime cannot run is a result, not a crash of the whole table
            results[tool] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    feed = ev[0]
    block = max(3, int(0.15 / max(_time_block(sessions["float"], feed, 1), 1e-5)))
    times: dict[str, list[float]] = {t: [] for t in sessions}
    order = list(sessions)
    shuffle = np.random.default_rng(0)
    for _ in range(rounds):  # a fresh random order each round: no model always runs right after another
        for i in shuffle.permutation(len(order)):
            times[order[i]].append(_time_block(sessions[order[i]], feed, block))
    for tool in sessions:
        ratios = [q / f for q, f in zip(times[tool], times["float"], strict=True)]
        results[tool].update(ms=float(np.median(times[tool])) * 1e3, latency_ratio=float(np.median(ratios)))
    return results


def _session(path: str) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 2, 1, 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def _time_block(sess: Any, feed: dict[str, np.ndarray], n: int) -> float:
    sess.run(None, feed)
    t = time.perf_counter()
    for _ in range(n):
        sess.run(None, feed)
    return (time.perf_counter() - t) / n


# ---------------------------------------------------------------------------------------------- driver
def _child(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:240]}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def run_model_rows(
    name: str, folder: Path, extra: list[str], rounds: int, only: list[str] | None = None
) -> list[dict[str, Any]]:
    """Prepare, quantize with every tool, evaluate; one row per tool (float first)."""
    paths = _child("prepare", name, str(folder))
    if "error" in paths:
        return [{"model": name, "tool": "float", "error": f"cannot prepare: {paths['error']}"}]
    made: dict[str, str] = {}
    rows: list[dict[str, Any]] = [{"model": name, "tool": "float"}]
    for tool in tools_for(name, extra, only):
        label = tool if not tool.startswith("recipe:") else f"recipe:{Path(tool[7:]).stem}"
        out = str(folder / f"{label.replace(':', '.')}.onnx")
        row = {"model": name, "tool": label, **_child("quantize", tool, name, json.dumps(paths), out)}
        if "error" not in row:
            made[label] = out
        rows.append(row)
    evaluated = _child("evaluate", name, json.dumps(paths), json.dumps(made), str(rounds))
    for row in rows:
        fallback = {"error": evaluated.get("error", "not evaluated")} if "error" not in row else {}
        row.update(evaluated.get(row["tool"], fallback))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(rm.REAL), help=f"from {sorted(rm.LOADERS)}")
    parser.add_argument("--recipe", action="append", default=[], help="PATH or MODEL=PATH (repeatable)")
    parser.add_argument(
        "--tools",
        nargs="*",
        help="run only the built-in tools whose name contains one of these (e.g. ort_static "
        "vnni); --recipe files always run; none: only the --recipe files",
    )
    parser.add_argument("--rounds", type=int, default=5, help="latency rounds")
    parser.add_argument("--eval-samples", type=int, help="held-out samples per model (default: the loader's)")
    parser.add_argument("--cpu", choices=["x86-vnni", "x86-avx2", "arm"],
                        help="measure every INT8 model as it deploys on this CPU (qgraph.runtime.kernels: this host's "
                        "kernels when it is one, that CPU's arithmetic emulated otherwise; latency stays this host's)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="keep models and data in this folder")
    parser.add_argument("--child", nargs="*")
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "prepare":
            res: dict[str, Any] = prepare(rest[0], Path(rest[1]))
        elif kind == "quantize":
            res = quantize(rest[0], rest[1], json.loads(rest[2]), rest[3])
        else:
            res = evaluate(rest[0], json.loads(rest[1]), json.loads(rest[2]), int(rest[3]))
        print(json.dumps(res))
        return
    if args.eval_samples:
        os.environ["QGRAPH_BENCH_EVAL"] = str(args.eval_samples)  # read by the children (`_sizes`)
    if args.cpu:
        os.environ["QGRAPH_BENCH_CPU"] = args.cpu  # read by the evaluation child
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-acc-") as tmp:
        base = args.keep or Path(tmp)
        for name in args.models:
            model_rows = run_model_rows(name, base / name, args.recipe, args.rounds, args.tools)
            rows += model_rows
            print_table(model_rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=float))


def fidelity(row: dict[str, Any]) -> str:
    """The metric column: top-1 (vs labels, agreement), per-slice SQNR (a detector's map IoU and box F1) or
    embedding cosine."""
    m = row.get("metric", {})
    if "top1_agree" in m:
        top1 = f"top1 {100 * m['top1']:.1f}% " if "top1" in m else ""
        return f"{top1}agree {100 * m['top1_agree']:.1f}% logits {m['sqnr_db']:.1f} dB"
    if "slices_db" in m:
        cells = " ".join(f"{k.split('/')[0][0]}{k.split('/')[-1][1:]}:{v:.1f}" for k, v in m["slices_db"].items())
        boxes = f" | map IoU {m['mask_iou']:.3f} box F1 {m['box_f1']:.3f}" if "box_f1" in m else ""
        if "det_f1" in m:  # a YOLO detector: post-processed detections of INT8 vs float
            boxes += f" | det F1 {m['det_f1']:.3f} ({m['det_int8']:.0f}/{m['det_float']:.0f} found)"
        return f"min {m['min_db']:.1f} dB ({m['worst']}) | {cells}{boxes}"
    if "cos_mean" in m:
        return f"cos mean {m['cos_mean']:.4f} min {m['cos_min']:.4f} ({m['sqnr_db']:.1f} dB)"
    return ""


def print_table(rows: list[dict[str, Any]]) -> None:
    """A rich table when rich is installed, plain lines otherwise."""
    header = ("model", "tool / recipe", "fidelity vs float", "latency", "quantize")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append((r["model"], r["tool"], f"ERROR {r['error']}", "", ""))
            continue
        lat = f"x{r['latency_ratio']:.2f} ({r['ms']:.1f} ms)" if "latency_ratio" in r else ""
        quant = f"{r['seconds']:.1f} s" if "seconds" in r else ""
        if "float_nodes" in r:
            quant += f", {r['float_nodes']} nodes float"
        lines.append((r["model"], r["tool"], fidelity(r), lat, quant))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a qgraph dependency
        for line in lines:
            print(" | ".join(line))
        return
    from qgraph.runtime.kernels.host import host_kernels

    cpu = os.environ.get("QGRAPH_BENCH_CPU")
    measured = f"as deployed on {cpu} (qgraph.runtime.kernels)" if cpu else "this host's deployed kernels"
    table = Table(*header, show_lines=False,
                  title=f"fidelity: {measured}; host {host_kernels().describe()}; {host_kernels().runtime}")
    for line in lines:
        table.add_row(*line)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
