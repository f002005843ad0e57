"""QDQ insertion benchmark: qgraph's recipes vs onnxruntime's quantize_static / quantize_dynamic.

Run on demand::

    python benchmarks/bench_qdq.py [--models digits squeezenet shufflenet mobilenet_v2 resnet50 encoder]
                                   [--extra qgraph_table qgraph_measure qgraph_auto qgraph_off]
                                   [--chain 1000 33334] [--ort-chain 100] [--json out.json]

CNNs: the digits example, squeezenet / shufflenet / resnet50 (the onnx wheel's architecture graphs with seeded
weights) and a MobileNetV2-style depthwise model (`qgraph.testing.mobilenet_v2`). Every qgraph row also prints
the wall time of each pass of `qgraph run` (``passes {...}``) and how many units `latency` kept float for speed;
``--extra`` adds variants of the recipe's insert_qdq: ``latency: off`` / ``table`` / ``measure`` and
``weights.symmetric: auto``.

Per model, every tool quantizes the same float model with the same calibration data, each in a fresh
subprocess (wall time of the quantization call and peak RSS of that child; the driver process stays small
because Linux children inherit the parent's RSS high-water mark). Each quantized model is then
evaluated in another subprocess: fidelity vs float (top-1 on the digits eval set; cosine and SQNR of the
outputs otherwise, measured on the logits when the model ends in a Softmax, whose saturated probabilities
would hide or exaggerate differences), INT8 latency relative to float (batch 1, 2 threads, ORT_ENABLE_ALL,
float and int8 timed in blocks in a random order each round in the same process so a shared machine affects
them alike; median of the per-round ratios), and the
QuantizeLinear/DequantizeLinear left after onnxruntime's optimizer plus the fused integer kernels.

qgraph runs its recipe (preparation passes + insert_qdq with the model's preset); onnxruntime gets the model
after qgraph's preparation passes (BatchNormalization folded), so both quantize the same float graph.
onnxruntime's settings are the ones the issue measured: quantize_static QDQ, per-channel, MinMax (its defaults
otherwise: S8S8), and for encoders also quantize_dynamic (MatMul, per-channel, QInt8 weights).

The chain rows time insert_qdq alone (1 calibration sample) on MatMul/Add/Relu chains: 1000 layers = 3,000
nodes, 33,334 layers = 100,002 nodes; onnxruntime's quantize_static on a shorter chain shows its scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits"
PRESET = {n: "ort-x86-vnni" for n in ("digits", "squeezenet", "resnet50", "shufflenet", "mobilenet_v2")}
PRESET["encoder"] = "transformer-ort-x86-vnni"


# ---------------------------------------------------------------------------------------------- model corpus
def prepare(name: str, folder: Path) -> dict[str, str]:
    """Write float model, prepared float model, calibration and eval data for ``name``; return their paths."""
    from qgraph import Pipeline, Recipe

    out = {k: str(folder / f"{name}.{k}") for k in ("float.onnx", "prep.onnx", "cal.npz", "eval.npz")}
    if name == "digits":
        model = onnx.load(str(DIGITS / "model.onnx"))
        cal = dict(np.load(DIGITS / "calibration.npz"))
        ev = dict(np.load(DIGITS / "eval.npz"))
    elif name == "mobilenet_v2":
        from qgraph.testing import mobilenet_v2

        model = mobilenet_v2()
        rng = np.random.default_rng(0)
        cal = {"input": rng.standard_normal((16, 3, 224, 224)).astype(np.float32)}
        ev = {"input": rng.standard_normal((16, 3, 224, 224)).astype(np.float32)}
    elif name == "encoder":
        from qgraph.testing import transformer_encoder, transformer_encoder_inputs

        model = transformer_encoder(17, layers=4, d_model=256, heads=4, seq=128)
        stack = lambda fs: {k: np.concatenate([f[k] for f in fs]) for k in fs[0]}  # noqa: E731
        cal = stack(transformer_encoder_inputs(32, seq=128, d_model=256, seed=1))
        ev = stack(transformer_encoder_inputs(16, seq=128, d_model=256, seed=2))
    else:
        from qgraph.passes.lower_opset.raising import raise_model

        from qgraph.testing import materialize_light_model

        model = raise_model(materialize_light_model(name), 13).model
        inp = model.graph.input[0]
        shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
        rng = np.random.default_rng(0)
        cal = {inp.name: rng.standard_normal((16, *shape[1:])).astype(np.float32)}
        ev = {inp.name: rng.standard_normal((16, *shape[1:])).astype(np.float32)}
    onnx.save(model, out["float.onnx"])
    np.savez(out["cal.npz"], **cal)
    np.savez(out["eval.npz"], **ev)
    recipe = Recipe.from_yaml(ROOT / "recipes" / f"{PRESET[name]}.yaml")
    # the float model as the recipe prepares it: every pass before insert_qdq but smooth_quant (qgraph's accuracy
    # technique: onnxruntime's quantizer gets the graph with BN folded, not qgraph's smoothing)
    names = [p.name for p in recipe.passes]
    prep_passes = [p for p in recipe.passes[: names.index("insert_qdq")] if p.name != "smooth_quant"]
    onnx.save(Pipeline(prep_passes).run(model, calibration_data=out["cal.npz"]).model, out["prep.onnx"])
    return out


def feeds(path: str) -> list[dict[str, np.ndarray]]:
    """One feed per sample (axis 0), labels dropped."""
    data = dict(np.load(path))
    data.pop("labels", None)
    n = next(iter(data.values())).shape[0]
    return [{k: v[i : i + 1] for k, v in data.items()} for i in range(n)]


# ---------------------------------------------------------------------------------------------- child: quantize
def quantize(tool: str, name: str, paths: dict[str, str], out: str) -> dict[str, Any]:
    """Quantize with ``tool``; returns wall seconds of the call and peak RSS of this process."""
    if tool.startswith("qgraph"):
        from qgraph.passes.insert_qdq import InsertQDQ

        from qgraph import Pipeline, Recipe

        recipe = Recipe.from_yaml(ROOT / "recipes" / f"{PRESET[name]}.yaml")
        passes = list(recipe.passes)
        at = [p.name for p in passes].index("insert_qdq")  # correct_bias may follow it
        recipe_qdq = passes[at].config.model_dump(exclude_unset=True)
        if tool == "qgraph_auto":  # the recipe with weights.symmetric: auto (zero points on lopsided layers)
            weights = {"symmetric": "auto", "asymmetric_gain": 1.1}
            passes[at] = InsertQDQ(**{**recipe_qdq, "weights": weights})
        elif tool in ("qgraph_off", "qgraph_table", "qgraph_measure"):  # the recipe with latency: off / table / measure
            passes[at] = InsertQDQ(**{**recipe_qdq, "latency": {"mode": tool.split("_")[1]}})
        elif tool in ("qgraph_dwfloat", "qgraph_dwauto"):  # the recipe's insert_qdq with depthwise: float / auto
            passes[at] = InsertQDQ(passes[at].config.model_copy(update={"depthwise": tool.removeprefix("qgraph_dw")}))
        start = time.perf_counter()
        res = Pipeline(passes).run(paths["float.onnx"], calibration_data=paths["cal.npz"])
        res.save(out)
        per_pass = {r.name: round(r.seconds, 3) for r in res.records}
        kept = sum(s.reason.startswith("kept float for speed") for r in res.records for s in r.result.skipped)
    else:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        from qgraph.testing import ort_quantize_static

        start = time.perf_counter()
        if tool == "ort_static":
            ort_quantize_static(paths["prep.onnx"], out, list(feeds(paths["cal.npz"])), per_channel=True)
        else:
            quantize_dynamic(paths["prep.onnx"], out, weight_type=QuantType.QInt8, per_channel=True)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if tool.startswith("qgraph"):
        return {"seconds": seconds, "peak_rss_mb": rss, "pass_seconds": per_pass, "kept_float_for_speed": kept}
    return {"seconds": seconds, "peak_rss_mb": rss}


# ---------------------------------------------------------------------------------------------- child: evaluate
def _session(path: str | bytes, threads: int = 2, optimized: bool = True) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    level = ort.GraphOptimizationLevel
    so.graph_optimization_level = level.ORT_ENABLE_ALL if optimized else level.ORT_DISABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def evaluate(name: str, paths: dict[str, str], qpaths: dict[str, str], rounds: int) -> dict[str, Any]:
    """Fidelity, latency ratio and fusion report of every model in ``qpaths`` (tool -> path).

    Latency: float and every int8 model are timed in blocks, in a random order each round, in this one
    process; the ratio per tool is the median over rounds of (int8 block / float block of the same round)."""
    from qgraph.quant.qdq import ort_fusion_report

    ref = _session(paths["float.onnx"])
    sessions = {tool: _session(p) for tool, p in qpaths.items()}
    evals = feeds(paths["eval.npz"])
    probe = _logits(paths["float.onnx"])  # compare logits, not a final Softmax's saturated probabilities
    yf = [_run_probe(ref, paths["float.onnx"], probe, f) for f in evals]
    a = np.concatenate([y.ravel() for y in yf]).astype(np.float64)
    results: dict[str, Any] = {}
    for tool, sess in sessions.items():
        out: dict[str, Any] = {"compared": probe or "output"}
        yq = [_run_probe(sess, qpaths[tool], probe, f) for f in evals]
        if name == "digits":
            labels = np.load(paths["eval.npz"])["labels"]
            out["top1_float"] = float(np.mean(np.argmax(np.concatenate(yf), 1) == labels))
            out["top1"] = float(np.mean(np.argmax(np.concatenate(yq), 1) == labels))
        elif probe:  # the Softmax input: top-1 agreement with float is the other fidelity number
            out["top1_agree"] = float(np.mean([np.argmax(x) == np.argmax(y) for x, y in zip(yf, yq, strict=True)]))
        b = np.concatenate([y.ravel() for y in yq]).astype(np.float64)
        out["cosine"] = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        out["sqnr_db"] = float(10 * np.log10(np.sum(a * a) / max(np.sum((a - b) ** 2), 1e-30)))
        # the same model with every op in float (Q/DQ semantics, no fused kernels): the quantization choices alone
        plain = _session(_with_output(qpaths[tool], probe), optimized=False)
        c = np.concatenate([plain.run([probe or plain.get_outputs()[0].name], f)[0].ravel() for f in evals])
        c = c.astype(np.float64)
        out["qdq_sqnr_db"] = float(10 * np.log10(np.sum(a * a) / max(np.sum((a - c) ** 2), 1e-30)))
        rep = ort_fusion_report(qpaths[tool])
        out.update(q_left=rep.quantize, dq_left=rep.dequantize, integer=rep.integer, float_ops=rep.float_compute)
        results[tool] = out
    feed = evals[0]
    block = max(5, int(0.2 / max(_time_once(ref, feed), 1e-5)))
    times: dict[str, list[float]] = {"float": [], **{t: [] for t in sessions}}
    order = [("float", ref), *sessions.items()]
    shuffle = np.random.default_rng(0)
    for _ in range(rounds):  # a fresh random order each round: no model always runs right after another
        for i in shuffle.permutation(len(order)):
            tool, sess = order[i]
            times[tool].append(_time_block(sess, feed, block))
    for tool in sessions:
        ratios = [q / f for q, f in zip(times[tool], times["float"], strict=True)]
        results[tool].update(
            float_ms=float(np.median(times["float"])) * 1e3,
            int8_ms=float(np.median(times[tool])) * 1e3,
            latency_ratio=float(np.median(ratios)),
        )
    return results


def _logits(path: str) -> str | None:
    """The input of the Softmax producing the model's first output (through reshapes), if the model ends so."""
    model = onnx.load(path, load_external_data=False)
    producer = {o: n for n in model.graph.node for o in n.output}
    node = producer.get(model.graph.output[0].name)
    while node is not None and node.op_type in ("Reshape", "Flatten", "Squeeze", "Identity"):
        node = producer.get(node.input[0])
    return str(node.input[0]) if node is not None and node.op_type == "Softmax" else None


def _with_output(path: str, tensor: str | None) -> str | bytes:
    if tensor is None:
        return path
    model = onnx.load(path)
    model.graph.output.add().name = tensor
    return model.SerializeToString()


_PROBES: dict[str, Any] = {}


def _run_probe(sess: Any, path: str, probe: str | None, feed: dict[str, np.ndarray]) -> np.ndarray:
    if probe is None:
        return np.asarray(sess.run(None, feed)[0])
    if path not in _PROBES:
        _PROBES[path] = _session(_with_output(path, probe))
    return np.asarray(_PROBES[path].run([probe], feed)[0])


def _time_once(sess: Any, feed: dict[str, np.ndarray]) -> float:
    sess.run(None, feed)
    t = time.perf_counter()
    sess.run(None, feed)
    return time.perf_counter() - t


def _time_block(sess: Any, feed: dict[str, np.ndarray], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        sess.run(None, feed)
    return (time.perf_counter() - t) / n


# ---------------------------------------------------------------------------------------------- child: chains
def chain(tool: str, layers: int) -> dict[str, Any]:
    """Time insert_qdq (or quantize_static) alone on a MatMul/Add/Relu chain with one calibration sample."""
    from qgraph.testing import matmul_add_relu_chain, random_feeds

    model = matmul_add_relu_chain(layers)
    sample = random_feeds(model, 1)
    if tool == "qgraph":
        from qgraph.passes.insert_qdq import InsertQDQ

        from qgraph import GraphHandle, PassContext
        from qgraph.data import CallableSource

        handle = GraphHandle(model)
        ctx = PassContext(calibration_data=CallableSource(lambda: sample, "sample"))
        wall, cpu = time.perf_counter(), time.process_time()
        InsertQDQ(preset="ort-x86-vnni").run(handle, ctx)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    else:
        from qgraph.testing import ort_quantize_static

        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "chain.onnx")
            onnx.save(model, src)
            wall, cpu = time.perf_counter(), time.process_time()
            ort_quantize_static(src, os.path.join(tmp, "q.onnx"), list(sample), per_channel=True)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"nodes": len(model.graph.node), "seconds": wall, "cpu_seconds": cpu, "peak_rss_mb": rss}


# ---------------------------------------------------------------------------------------------- driver
def _child(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*",
                        default=["digits", "squeezenet", "shufflenet", "mobilenet_v2", "resnet50", "encoder"])
    parser.add_argument("--chain", nargs="*", type=int, default=[1000, 33334])
    parser.add_argument("--ort-chain", nargs="*", type=int, default=[100])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--extra", nargs="*", default=["qgraph_off", "qgraph_measure", "qgraph_auto"],
                        help="further qgraph variants for CNNs: qgraph_off / qgraph_table / qgraph_measure "
                        "(latency: off / table / measure; the recipe says table), qgraph_auto (weights.symmetric: "
                        "auto), qgraph_dwfloat / qgraph_dwauto (depthwise: float / auto)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs="*")
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "prepare":
            res = prepare(rest[0], Path(rest[1]))
        elif kind == "quantize":
            res = quantize(rest[0], rest[1], json.loads(rest[2]), rest[3])
        elif kind == "evaluate":
            res = evaluate(rest[0], json.loads(rest[1]), json.loads(rest[2]), int(rest[3]))
        else:
            res = chain(rest[0], int(rest[1]))
        print(json.dumps(res))
        return
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-qdq-") as tmp:
        for name in args.models:
            paths = _child("prepare", name, tmp)  # in a child: this process stays small (RSS is inherited)
            if "error" in paths:
                print(f"{name}: cannot prepare: {paths['error']}")
                continue
            tools = ["qgraph", "ort_static"] + (["ort_dynamic"] if name == "encoder" else args.extra)
            made: dict[str, str] = {}
            batch: list[dict[str, Any]] = []
            for tool in tools:
                out = str(Path(tmp) / f"{name}.{tool}.onnx")
                row: dict[str, Any] = {
                    "model": name,
                    "tool": tool,
                    **_child("quantize", tool, name, json.dumps(paths), out),
                }
                if "error" not in row:
                    made[tool] = out
                batch.append(row)
            evaluated = _child("evaluate", name, json.dumps(paths), json.dumps(made), str(args.rounds))
            for row in batch:
                row.update(evaluated.get(row["tool"], {"error": evaluated.get("error", row.get("error", "?"))}))
                rows.append(row)
                print(_fmt(row), flush=True)
    chains = [{"tool": "qgraph", "layers": n, **_child("chain", "qgraph", str(n))} for n in args.chain]
    chains += [{"tool": "ort_static", "layers": n, **_child("chain", "ort_static", str(n))} for n in args.ort_chain]
    for c in chains:
        print(
            f"chain {c['tool']:10s} {c.get('nodes', '?'):>7} nodes: {c.get('seconds', float('nan')):7.2f} s wall, "
            f"{c.get('cpu_seconds', float('nan')):7.2f} s cpu, {c.get('peak_rss_mb', 0):6.0f} MB {c.get('error', '')}"
        )
    if args.json:
        args.json.write_text(json.dumps({"models": rows, "chains": chains}, indent=1))


def _fmt(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['model']:10s} {r['tool']:11s} ERROR {r['error']}"
    fid = f"top1 {r['top1']:.4f} (float {r['top1_float']:.4f})" if "top1" in r else f"cos {r['cosine']:.5f}"
    if "top1_agree" in r:
        fid += f" top1= {r['top1_agree']:.2f}"
    return (
        f"{r['model']:10s} {r['tool']:11s} {fid:32s} sqnr {r['sqnr_db']:6.1f} dB (qdq {r['qdq_sqnr_db']:5.1f})  "
        f"latency x{r['latency_ratio']:.2f} "
        f"({r['int8_ms']:.2f}/{r['float_ms']:.2f} ms)  Q/DQ left {r['q_left']}/{r['dq_left']}  "
        f"quantize {r['seconds']:.1f} s {r['peak_rss_mb']:.0f} MB  int8 ops {sum(r['integer'].values())} "
        f"float ops {r['float_ops']}"
        + (f"  kept float {r['kept_float_for_speed']}; passes {r['pass_seconds']}" if "pass_seconds" in r else "")
    )


if __name__ == "__main__":
    main()
