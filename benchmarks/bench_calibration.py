"""Calibration benchmark: qgraph vs onnxruntime.quantization.calibrate on the same model and data.

Run on demand::

    python benchmarks/bench_calibration.py [--samples 128 1024] [--methods minmax entropy percentile]

Every configuration (tool x method x sample count, plus plain FP32 inference as the baseline)
runs in a fresh subprocess; its peak RSS is read from ``os.wait4``'s rusage of that child.
Wall time is measured inside the child around the calibration call only (model building and
imports excluded) and compared with plain FP32 inference over the same samples, timed right
after in the same child (so the ratio holds up when the machine is shared).  Samples are
generated on the fly from a per-index seed, so no configuration holds the data set.  Minmax
configurations alternate calibration and FP32 five times in their child and report the median
ratio (single runs on this shared 2-core machine vary by +-15%).

For minmax a second, timing-only measurement pre-generates the feeds before the clock starts
(no RSS is read there), so the ratio shows the graph's cost alone, without the per-sample data
generation both sides pay.  ``qgraph-noopt`` runs qgraph with onnxruntime's optimizations
off, as onnxruntime's calibrators do: its minmax ranges must equal theirs bit for bit.
``qgraph-qdq`` calibrates only the tensors insert_qdq quantizes (what ``qgraph run`` costs):
ReLU outputs rather than the Conv outputs before them, so Conv+ReLU stay fused.

Model: a 10-conv CNN built here with onnx.helper (input 1x3x64x64, He-initialised seeded
weights, biases ~N(0, 0.05)); no downloads.  Options are matched: entropy 2048 bins / 128
levels, percentile 99.999 symmetric with 2048 bins.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

INPUT = "input"
#: Timing rounds per minmax configuration (median ratio reported).
ROUNDS = 5
#: The tensors insert_qdq calibrates (filled by the parent; the child reads them from QDQ_TENSORS).
QDQ_SET: list[str] = []
# (out_channels, stride) of the 3x3 convs; a 1x1 classifier conv follows
LAYERS = [(16, 2), (16, 1), (32, 2), (32, 1), (64, 2), (64, 1), (64, 1), (128, 2), (128, 1)]
ORT_OPTIONS = {
    "entropy": {"num_bins": 2048, "num_quantized_bins": 128, "symmetric": False},
    "percentile": {"num_bins": 2048, "percentile": 99.999, "symmetric": True},
    "minmax": {},
}
QG_OPTIONS: dict[str, dict[str, Any]] = {
    "entropy": {"num_bins": 2048, "num_levels": 128},
    "percentile": {"num_bins": 2048, "percentile": 99.999, "symmetric": True},
    "minmax": {},
}


def build_model() -> onnx.ModelProto:
    """10 conv layers (9 x 3x3 + ReLU, 1 x 1x1) + global average pool, seeded He init."""
    rng = np.random.default_rng(1234)
    nodes, inits = [], []
    prev, cin = INPUT, 3
    for i, (cout, stride) in enumerate([*LAYERS, (10, 1)]):
        k = 1 if i == len(LAYERS) else 3
        w = (rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))).astype(np.float32)
        b = (rng.standard_normal(cout) * 0.05).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        conv_out = f"conv{i}"
        nodes.append(
            helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [conv_out], pads=[k // 2] * 4, strides=[stride, stride])
        )
        if i < len(LAYERS):
            nodes.append(helper.make_node("Relu", [conv_out], [f"relu{i}"]))
            prev = f"relu{i}"
        else:
            prev = conv_out
        cin = cout
    nodes.append(helper.make_node("GlobalAveragePool", [prev], ["pooled"]))
    nodes.append(helper.make_node("Flatten", ["pooled"], ["logits"]))
    graph = helper.make_graph(
        nodes,
        "bench_cnn",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, [1, 3, 64, 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


def sample(i: int) -> dict[str, np.ndarray]:
    """Deterministic image-like sample ``i``."""
    rng = np.random.default_rng(10_000 + i)
    return {INPUT: rng.standard_normal((1, 3, 64, 64)).astype(np.float32)}


def feeds(n: int) -> Iterator[dict[str, np.ndarray]]:
    return (sample(i) for i in range(n))


def calib_tensors(model: onnx.ModelProto) -> list[str]:
    """Graph input + every float node output (the set ORT's calibrators pick by default)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    floats = {
        vi.name
        for vi in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT
    }
    names = [INPUT] + [o for node in model.graph.node for o in node.output]
    return [n for n in names if n in floats]


def qdq_tensors(model: onnx.ModelProto) -> list[str]:
    """The activations qgraph's insert_qdq (preset ort-x86-vnni) calibrates: inputs of its QuantizeLinear nodes."""
    from qgraph.passes.insert_qdq import InsertQDQ

    from qgraph import Pipeline

    with tempfile.TemporaryDirectory() as tmp:
        np.savez(Path(tmp) / "cal.npz", **{INPUT: np.concatenate([sample(i)[INPUT] for i in range(2)])})
        q = Pipeline([InsertQDQ(preset="ort-x86-vnni")]).run(model, calibration_data=Path(tmp) / "cal.npz").model
    weights = {t.name for t in q.graph.initializer}
    return [n.input[0] for n in q.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in weights]


# --------------------------------------------------------------------------------------------- child side
def run_child(tool: str, method: str, n: int, out: str, pregenerate: bool = False) -> None:
    import onnxruntime as ort

    model = build_model()
    pregenerated = list(feeds(n)) if pregenerate else None

    def source() -> Any:
        return iter(pregenerated) if pregenerated is not None else feeds(n)

    tmp = Path(tempfile.mkdtemp(prefix="qgbench-"))
    model_path = tmp / "model.onnx"
    onnx.save(model, str(model_path))
    # imports and the choice of tensors happen before the clock starts, and only the measured tool's
    names = json.loads(os.environ["QDQ_TENSORS"]) if tool == "qgraph-qdq" else calib_tensors(model)
    if tool.startswith("qgraph"):
        from qgraph.calibrate import collect_ranges
    elif tool == "ort":
        from onnxruntime.quantization.calibrate import (
            CalibrationDataReader,
            CalibrationMethod,
            create_calibrator,
        )

    def calibrate() -> dict[str, list[float]]:
        if tool == "fp32":
            sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
            for f in source():
                sess.run(None, f)
            return {}
        if tool.startswith("qgraph"):
            opt = tool != "qgraph-noopt"
            cal = collect_ranges(model, names, source, method, options=QG_OPTIONS[method], optimize=opt)
            return {k: [float(v.range.rmin), float(v.range.rmax)] for k, v in cal.items()}

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.it = source()

            def get_next(self) -> dict[str, np.ndarray] | None:
                return next(self.it, None)

        m = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy}.get(
            method, CalibrationMethod.Percentile
        )
        calibrator = create_calibrator(
            model_path,
            augmented_model_path=str(tmp / "augmented.onnx"),
            calibrate_method=m,
            extra_options=ORT_OPTIONS[method],
        )
        calibrator.collect_data(Reader())
        data = calibrator.compute_data()
        return {
            k: [float(np.asarray(v.range_value[0]).ravel()[0]), float(np.asarray(v.range_value[1]).ravel()[0])]
            for k, v in data.data.items()
        }

    def fp32() -> None:
        sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        for f in source():
            sess.run(None, f)

    # Calibration and FP32 inference over the same samples alternate in this process, so the ratio holds up
    # when the machine is shared; minmax (cheap) gets several rounds and the median, the others one.
    times: list[float] = []
    fp32_times: list[float] = []
    for _ in range(ROUNDS if method == "minmax" else 1):
        start = time.perf_counter()
        ranges = calibrate()
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        fp32()
        fp32_times.append(time.perf_counter() - start)
    ratio = float(np.median([t / f for t, f in zip(times, fp32_times, strict=True)]))
    Path(out).write_text(json.dumps({
        "seconds": float(np.median(times)), "fp32_seconds": float(np.median(fp32_times)), "ratio": ratio,
        "ranges": ranges,
    }))


def kl_search_ms() -> float:
    """Median time of one KL threshold search over a 2048-bin |x| histogram (ORT's loop: ~0.6 s)."""
    from qgraph.calibrate.search import kl_divergences

    rng = np.random.default_rng(0)
    counts = np.bincount(np.minimum((np.abs(rng.standard_normal(200_000)) * 400).astype(int), 2047), minlength=2048)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        kl_divergences(counts, 128)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


# -------------------------------------------------------------------------------------------- parent side
def measure(tool: str, method: str, n: int, pregenerate: bool = False) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, PYTHONUNBUFFERED="1", QDQ_TENSORS=json.dumps(QDQ_SET))
    cmd = [sys.executable, __file__, "--child", tool, method, str(n), out, *(["--pregenerate"] if pregenerate else [])]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    if status != 0:
        raise RuntimeError(f"{tool}/{method}/{n} failed:\n{stderr[-3000:]}")
    result: dict[str, Any] = json.loads(Path(out).read_text())
    os.unlink(out)
    result["peak_rss_mb"] = usage.ru_maxrss / 1024.0  # Linux reports KiB
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--methods", nargs="+", default=["minmax", "entropy", "percentile"])
    parser.add_argument("--child", nargs=4, metavar=("TOOL", "METHOD", "N", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--pregenerate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--qdq-set", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.qdq_set:
        Path(args.qdq_set).write_text(json.dumps(qdq_tensors(build_model())))
        return
    if args.child:
        tool, method, n, out = args.child
        run_child(tool, method, int(n), out, args.pregenerate)
        return

    t0 = time.perf_counter()
    # in a child: the parent stays small, since a child's peak RSS counts the parent's pages until it execs
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, __file__, "--qdq-set", f"{tmp}/set.json"], check=True, capture_output=True)
        QDQ_SET[:] = json.loads(Path(f"{tmp}/set.json").read_text())
    fp32 = {n: measure("fp32", "none", n) for n in args.samples}
    results: dict[tuple[str, str, int], dict[str, Any]] = {}
    tools = {
        m: ("qgraph", "qgraph-noopt", "qgraph-qdq", "ort") if m == "minmax" else ("qgraph", "ort") for m in args.methods
    }
    for method in args.methods:
        for tool in tools[method]:
            for n in args.samples:
                r = measure(tool, method, n)
                if method == "minmax":  # graph cost alone: feeds generated before the clock
                    pre = measure(tool, method, n, pregenerate=True)
                    r["pregen_ratio"] = pre["ratio"]
                results[(tool, method, n)] = r
                print(f"  done {tool:12s} {method:10s} n={n:5d}: {r['seconds']:.2f}s", file=sys.stderr)

    lo, hi = min(args.samples), max(args.samples)
    print(
        f"\nmodel: 10-conv CNN, input 1x3x64x64; {len(calib_tensors(build_model()))} calibrated tensors (every float "
        f"tensor, as ORT's calibrators pick), qgraph-qdq: the {len(QDQ_SET)} that insert_qdq quantizes"
    )
    print(
        "FP32 inference alone (fresh process): "
        f"n={lo}: {fp32[lo]['seconds']:.2f}s, peak RSS {fp32[lo]['peak_rss_mb']:.0f} MB; "
        f"n={hi}: {fp32[hi]['seconds']:.2f}s, peak RSS {fp32[hi]['peak_rss_mb']:.0f} MB\n"
    )
    cols = [
        "tool", "method", f"RSS n={lo} MB", f"RSS n={hi} MB", "RSS growth", f"time n={hi} s",
        f"x FP32 n={lo}", f"x FP32 n={hi}", f"x FP32 graph only n={hi}",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("-" * (len(c) + 2) for c in cols) + "|")
    for method in args.methods:
        for tool in tools[method]:
            a, b = results[(tool, method, lo)], results[(tool, method, hi)]
            cells = [
                tool, method, f"{a['peak_rss_mb']:.0f}", f"{b['peak_rss_mb']:.0f}",
                f"{100 * (b['peak_rss_mb'] / a['peak_rss_mb'] - 1):+.0f}%", f"{b['seconds']:.2f}",
                f"{a['ratio']:.2f}", f"{b['ratio']:.2f}",
                f"{b['pregen_ratio']:.2f}" if "pregen_ratio" in b else "",
            ]
            print("| " + " | ".join(f"{c:>{len(h)}}" for c, h in zip(cells, cols, strict=True)) + " |")
    if "minmax" in args.methods:
        for n in args.samples:
            o = results[("ort", "minmax", n)]["ranges"]
            for tool in ("qgraph-noopt", "qgraph"):
                q = results[(tool, "minmax", n)]["ranges"]
                common = sorted(set(q) & set(o))
                span = {k: max(abs(o[k][0]), abs(o[k][1]), 1e-12) for k in common}
                rel = max(abs(q[k][i] - o[k][i]) / span[k] for k in common for i in (0, 1))
                exact = all(q[k] == o[k] for k in common)
                print(
                    f"minmax n={n}: {tool} vs ORT MinMax on {len(common)} tensors (qgraph {len(q)}, ORT {len(o)}): "
                    f"identical: {exact}; max difference {rel:.2g} of the tensor's range"
                )
    for method in [m for m in args.methods if m != "minmax"]:
        q, o = results[("qgraph", method, hi)]["ranges"], results[("ort", method, hi)]["ranges"]
        common = sorted(set(q) & set(o))
        rel = [abs(q[k][1] - o[k][1]) / max(abs(o[k][1]), 1e-12) for k in common]
        print(f"{method} n={hi}: upper bound qgraph vs ORT, median relative difference {np.median(rel):.3f}")
    print(f"entropy KL search, 2048 bins / 128 levels: {kl_search_ms():.1f} ms per tensor (vectorized)")
    print(f"\ntotal benchmark time {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
