"""Calibration benchmark: qgraph vs onnxruntime.quantization.calibrate on the same model and data.

Run on demand::

    python benchmarks/bench_calibration.py [--samples 128 1024] [--methods minmax entropy percentile]

Every configuration (tool x method x sample count, plus plain FP32 inference as the baseline)
runs in a fresh subprocess; its peak RSS is read from ``os.wait4``'s rusage of that child.
Wall time is measured inside the child around the calibration call only (model building and
imports excluded) and compared with plain FP32 inference over the same samples, timed right
after in the same child (so the ratio holds up when the machine is shared).  Samples are
generated on the fly from a per-index seed, so no configuration holds the data set.

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


# --------------------------------------------------------------------------------------------- child side
def run_child(tool: str, method: str, n: int, out: str) -> None:
    import onnxruntime as ort

    model = build_model()
    tmp = Path(tempfile.mkdtemp(prefix="qgbench-"))
    model_path = tmp / "model.onnx"
    onnx.save(model, str(model_path))
    ranges: dict[str, list[float]] = {}
    # imports happen before the clock starts, and only the measured tool's
    if tool == "qgraph":
        from qgraph.calibrate import collect_ranges
    elif tool == "ort":
        from onnxruntime.quantization.calibrate import (
            CalibrationDataReader,
            CalibrationMethod,
            create_calibrator,
        )

    start = time.perf_counter()
    if tool == "fp32":
        sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        for f in feeds(n):
            sess.run(None, f)
    elif tool == "qgraph":
        cal = collect_ranges(model, calib_tensors(model), lambda: feeds(n), method, options=QG_OPTIONS[method])
        ranges = {k: [float(v.range.rmin), float(v.range.rmax)] for k, v in cal.items()}
    else:

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.it = feeds(n)

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
        ranges = {
            k: [
                float(np.asarray(v.range_value[0]).ravel()[0]),
                float(np.asarray(v.range_value[1]).ravel()[0]),
            ]
            for k, v in data.data.items()
        }
    elapsed = time.perf_counter() - start
    # FP32 inference over the same samples, right after and in the same process, so the
    # ratio is robust to other load on the machine (peak RSS is dominated by calibration)
    start = time.perf_counter()
    fp32 = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    for f in feeds(n):
        fp32.run(None, f)
    fp32_seconds = time.perf_counter() - start
    Path(out).write_text(json.dumps({"seconds": elapsed, "fp32_seconds": fp32_seconds, "ranges": ranges}))


# -------------------------------------------------------------------------------------------- parent side
def measure(tool: str, method: str, n: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, __file__, "--child", tool, method, str(n), out]
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
    args = parser.parse_args()
    if args.child:
        tool, method, n, out = args.child
        run_child(tool, method, int(n), out)
        return

    t0 = time.perf_counter()
    fp32 = {n: measure("fp32", "none", n) for n in args.samples}
    rows = []
    results: dict[tuple[str, str, int], dict[str, Any]] = {}
    for method in args.methods:
        for tool in ("qgraph", "ort"):
            for n in args.samples:
                r = measure(tool, method, n)
                results[(tool, method, n)] = r
                rows.append((tool, method, n, r))
                print(f"  done {tool:6s} {method:10s} n={n:5d}: {r['seconds']:.2f}s", file=sys.stderr)

    lo, hi = min(args.samples), max(args.samples)
    print(f"\nmodel: 10-conv CNN, input 1x3x64x64, {len(calib_tensors(build_model()))} calibrated tensors")
    print(
        "FP32 inference alone (fresh process): "
        f"n={lo}: {fp32[lo]['seconds']:.2f}s, peak RSS {fp32[lo]['peak_rss_mb']:.0f} MB; "
        f"n={hi}: {fp32[hi]['seconds']:.2f}s, peak RSS {fp32[hi]['peak_rss_mb']:.0f} MB\n"
    )
    header = (
        f"| {'tool':6} | {'method':10} | RSS n={lo:<4} MB | RSS n={hi:<4} MB | time n={lo:<4} s | "
        f"time n={hi:<4} s | x FP32 n={lo:<4} | x FP32 n={hi:<4} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for method in args.methods:
        for tool in ("qgraph", "ort"):
            a, b = results[(tool, method, lo)], results[(tool, method, hi)]
            print(
                f"| {tool:6} | {method:10} | {a['peak_rss_mb']:14.0f} | {b['peak_rss_mb']:14.0f} | "
                f"{a['seconds']:15.2f} | {b['seconds']:15.2f} | {a['seconds'] / a['fp32_seconds']:13.1f} | "
                f"{b['seconds'] / b['fp32_seconds']:13.1f} |"
            )
    if "minmax" in args.methods:
        for n in args.samples:
            q, o = results[("qgraph", "minmax", n)]["ranges"], results[("ort", "minmax", n)]["ranges"]
            common = sorted(set(q) & set(o))
            diff = max(abs(q[k][i] - o[k][i]) for k in common for i in (0, 1))
            exact = all(q[k] == o[k] for k in common)
            print(
                f"\nminmax n={n}: {len(common)} tensors in common (qgraph {len(q)}, ORT {len(o)}); "
                f"identical: {exact}; max |difference| = {diff:.3g}"
            )
    for method in [m for m in args.methods if m != "minmax"]:
        q, o = results[("qgraph", method, hi)]["ranges"], results[("ort", method, hi)]["ranges"]
        common = sorted(set(q) & set(o))
        rel = [abs(q[k][1] - o[k][1]) / max(abs(o[k][1]), 1e-12) for k in common]
        print(f"{method} n={hi}: upper bound qgraph vs ORT, median relative difference {np.median(rel):.3f}")
    print(f"\ntotal benchmark time {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
