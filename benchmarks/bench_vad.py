"""silero-vad (compute inside ``If`` branches chosen by ``sr``): INT8 fidelity, task metric and latency.

    python -m pip install --no-deps silero-vad espeakng-loader
    python benchmarks/bench_vad.py                       # makes the speech data (benchmarks/vad_data.py)
    python benchmarks/bench_vad.py --data cal.npz eval.npz --json vad.json

Rows: the float model; onnxruntime ``quantize_static`` (QDQ, per-channel) on the specialized float graph; qgraph
recipes (``RECIPES``): the ready ``ort-x86-vnni`` recipe on the unspecialized model (bodies quantized statically),
alone, with an auto ``float_fallback`` whose candidates are the nodes inside the branches (chunk-wise and
streamed) and with ``tune_ranges`` tuning the pairs inside the branches, and after ``specialize_inputs``
(sr = 16000); then specialize + ``insert_qdq`` alone (the ready recipe's options), with the STFT front end left
float, with ``optimize_rounding``, with an auto ``float_fallback`` (target ``sqnr:30``, searched on the
calibration data), with ``tune_ranges`` (output-aware activation ranges, with and without the STFT in INT8), and
with ``quantize_lstm`` too (the LSTM as DynamicQuantizeLSTM);
then ``tune_ranges`` scored streamed (``recurrent``: each model fed its own state over the calibration
utterances), a streamed refinement after chunk-wise tuning, and an auto ``float_fallback`` scored streamed
(probability >= 30 dB). ``--rows WORD,...`` runs only the matching rows.

Columns (held-out chunks; the float model's outputs are the reference): SQNR of the speech probability
(``output``) and of the recurrent state (``stateN``); the share of the squared probability error carried by the
5 % of chunks with the largest error (the metric's conditioning: a sigmoid output is flat at 0 and 1, so the
error sits on the few transition chunks); decision agreement at the wheel's threshold 0.5; mean and max
absolute probability error; the same agreement and SQNR *streamed*, each model fed its own state chunk
after chunk over the evaluation utterances as deployed (errors accumulate through the state; an utterance starts
where the data's recorded state is zero); INT8/float latency (onnxruntime, batch = one 512-sample chunk, 1 thread,
ORT_ENABLE_ALL, interleaved rounds, median of per-round ratios); which Conv nodes run in int8.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
import vad_data

from qgraph import Recipe

ROOT = Path(__file__).resolve().parents[1]
SPECIALIZE = [{"pass": "specialize_inputs", "inputs": {"sr": 16000}}]
NO_STFT = {"nodes": {"exclude": {"regex": ["/stft/"]}}}
FALLBACK = {"pass": "float_fallback", "auto": {"target": "sqnr:30", "max_time": 240}}
RECURRENT = {"state_inputs": {"state": "stateN"}}  # tune_ranges scores streamed: each model fed its own state
STREAMED_FALLBACK = {"pass": "float_fallback", "auto": {
    "target": f"{ROOT / 'benchmarks' / 'fallback_metrics.py'}:first_output_sqnr>=30", "max_time": 240,
    "recurrent": RECURRENT}}  # the probability's SQNR, both models streamed on the calibration utterances
STREAMED_REFINE = {"samples": 874, "factors": [1.4, 1.2, 0.85, 0.7], "recurrent": RECURRENT}


def _recipe(passes: list[dict[str, Any]], qdq: dict[str, Any] | None = None) -> dict[str, Any]:
    insert = {"pass": "insert_qdq", "preset": "ort-x86-vnni", "activations": {"method": "auto"},
              "latency": {"mode": "table"}, **(qdq or {})}
    return {"name": "vad", "target": {"runtime": "onnxruntime", "cpu": "x86-vnni"},
            "passes": [*SPECIALIZE, {"pass": "fold_constants"}, {"pass": "cleanup"}, insert, *passes]}


RECIPES: dict[str, dict[str, Any]] = {
    "ready recipe (bodies static)": Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml").to_dict(),
    # The If kept (sr stays an input): the auto fallback's candidates include the nodes inside the branches.
    "ready recipe (bodies static), fallback 30 in bodies": {
        **(r0 := Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml").to_dict()),
        "passes": [*r0["passes"], FALLBACK]},
    "ready recipe (bodies static), fallback 30 streamed in bodies": {
        **r0, "passes": [*r0["passes"], STREAMED_FALLBACK]},
    "ready recipe (bodies static), tune_ranges in bodies": {
        **r0, "passes": [*r0["passes"], {"pass": "tune_ranges"}]},
    "ready recipe (bodies static), tune_ranges + fallback 30 in bodies": {
        **r0, "passes": [*r0["passes"], {"pass": "tune_ranges"}, FALLBACK]},
    "ready recipe (bodies static), tune_ranges streamed in bodies": {
        **r0, "passes": [*r0["passes"], {"pass": "tune_ranges", "samples": 874, "recurrent": RECURRENT}]},
    "ready recipe (bodies static), tune_ranges + fallback 30 streamed in bodies": {
        **r0, "passes": [*r0["passes"], {"pass": "tune_ranges"}, STREAMED_FALLBACK]},
    "ready recipe (bodies static), tune_ranges + fallback 30 on output streamed in bodies": {
        **r0, "passes": [*r0["passes"], {"pass": "tune_ranges"}, {"pass": "float_fallback", "auto": {
            "target": "sqnr:30", "outputs": ["output"], "max_time": 240, "recurrent": RECURRENT}}]},
    "specialized + ready recipe": {**(r := Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml").to_dict()),
                                   "passes": SPECIALIZE + r["passes"]},
    "specialized, insert_qdq": _recipe([]),
    "specialized, STFT float": _recipe([], NO_STFT),
    "specialized, STFT float, optimize_rounding": _recipe([{"pass": "optimize_rounding"}], NO_STFT),
    "specialized, STFT float, rounding, fallback 30": _recipe([{"pass": "optimize_rounding"}, FALLBACK], NO_STFT),
    "specialized, insert_qdq, tune_ranges": _recipe([{"pass": "tune_ranges"}]),
    "specialized, STFT float, tune_ranges": _recipe([{"pass": "tune_ranges"}], NO_STFT),
    "specialized, insert_qdq, tune_ranges, quantize_lstm": _recipe([{"pass": "tune_ranges"},
                                                                    {"pass": "quantize_lstm"}]),
    "specialized, insert_qdq, tune_ranges streamed, quantize_lstm": _recipe([
        {"pass": "tune_ranges", "samples": 874, "recurrent": RECURRENT}, {"pass": "quantize_lstm"}]),
    "specialized, insert_qdq, tune_ranges, + streamed refinement, quantize_lstm": _recipe([
        {"pass": "tune_ranges"}, {"pass": "tune_ranges", **STREAMED_REFINE}, {"pass": "quantize_lstm"}]),
    "specialized, insert_qdq, tune_ranges, fallback 30 streamed, quantize_lstm": _recipe([
        {"pass": "tune_ranges"}, STREAMED_FALLBACK, {"pass": "quantize_lstm"}]),
}


def stacked(feeds: list[dict[str, np.ndarray]], names: set[str]) -> dict[str, np.ndarray]:
    """All chunks as one batch (the model is batch-parallel: chunks are independent given their state)."""
    out = {"input": np.concatenate([f["input"] for f in feeds]),
           "state": np.concatenate([f["state"] for f in feeds], axis=1)}
    if "sr" in names:
        out["sr"] = feeds[0]["sr"]
    return out


def outputs(model: bytes, feeds: list[dict[str, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities [N], states [N, 2, 128])."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    s = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    prob, state = s.run(None, stacked(feeds, {i.name for i in s.get_inputs()}))
    return prob.reshape(-1), state.transpose(1, 0, 2)


def sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    """10 log10(sum ref^2 / sum (ref - got)^2)."""
    noise = float(((ref.astype(np.float64) - got) ** 2).sum())
    return float("inf") if noise == 0 else float(10 * np.log10((ref.astype(np.float64) ** 2).sum() / noise))


def scores(ref: tuple[np.ndarray, np.ndarray], got: tuple[np.ndarray, np.ndarray]) -> dict[str, float]:
    """The columns of the table (module docstring)."""
    (p, s), (q, t) = ref, got
    e2 = (p.astype(np.float64) - q) ** 2
    top = np.sort(e2)[::-1][: max(1, len(e2) // 20)]
    return {"prob_db": sqnr(p, q), "state_db": sqnr(s, t), "top5pct_share": float(top.sum() / max(e2.sum(), 1e-30)),
            "agree": float(np.mean((p > 0.5) == (q > 0.5))), "mae": float(np.abs(p - q).mean()),
            "max_err": float(np.abs(p - q).max())}


def streamed_chunks(model: bytes, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    """`streamed` on the chunks of an ``.npz`` (each holds its 64 samples of context): an utterance starts where
    the recorded state is all zeros; every other chunk gets the model's own state from the chunk before."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    s = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in s.get_inputs()}
    probs: list[float] = []
    state = np.zeros((2, 1, 128), np.float32)
    for f in feeds:
        state = f["state"] if not np.any(f["state"]) else state
        prob, state = s.run(None, {k: v for k, v in {**f, "state": state}.items() if k in names})
        probs.append(float(prob.reshape(-1)[0]))
    return np.array(probs)


def latency(models: dict[str, bytes], feeds: list[dict[str, np.ndarray]], rounds: int = 7) -> dict[str, float]:
    """Per model, median over rounds of (its time / float's time) for streaming the chunks one by one."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads, opts.log_severity_level = 1, 1, 3
    sessions = {k: ort.InferenceSession(m, opts, providers=["CPUExecutionProvider"]) for k, m in models.items()}
    per = {k: [] for k in models}  # type: dict[str, list[float]]
    for _ in range(rounds):
        for k, s in sessions.items():
            names = {i.name for i in s.get_inputs()}
            chunk = [{n: v for n, v in f.items() if n in names} for f in feeds]
            t0 = time.perf_counter()
            for f in chunk:
                s.run(None, f)
            per[k].append(time.perf_counter() - t0)
    base = np.array(per["float"])
    return {k: float(np.median(np.array(v) / base)) for k, v in per.items()}


def int8_convs(model: onnx.ModelProto) -> str:
    """Conv nodes (every scope) onnxruntime runs as QLinearConv: int8 weight, and the output (or its Relu's)
    requantized."""
    from qgraph.graph.ops import proto_scopes

    scopes = proto_scopes(model.graph)
    quantized = {n.input[0] for g in scopes for n in g.node if n.op_type == "QuantizeLinear"}
    relu = {n.input[0]: n.output[0] for g in scopes for n in g.node if n.op_type == "Relu"}
    dequantized = {n.output[0] for g in scopes for n in g.node if n.op_type == "DequantizeLinear"}
    convs = [n for g in scopes for n in g.node if n.op_type == "Conv"]
    fused = [n.name.split("__")[-1].removesuffix("/Conv") for n in convs
             if n.input[1] in dequantized and (n.output[0] in quantized or relu.get(n.output[0]) in quantized)]
    lstm = sum(n.op_type == "DynamicQuantizeLSTM" for g in scopes for n in g.node)
    return f"{len(fused)}/{len(convs)}: {' '.join(fused)}" + (f" + {lstm} LSTM" if lstm else "")


def main() -> None:
    """Quantize, score and time every row; print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs=2, metavar=("CAL", "EVAL"), help=".npz files from benchmarks/vad_data.py")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--rows", help="only the qgraph rows whose name contains one of these comma-separated words "
                    "(the float and onnxruntime rows always run)")
    args = ap.parse_args()
    if args.data:
        cal_npz, eval_npz = args.data
    else:
        tmp = Path(tempfile.mkdtemp())
        cal_npz, eval_npz = str(tmp / "cal.npz"), str(tmp / "eval.npz")
        vad_data.save_npz(vad_data.vad_feeds("cal"), cal_npz)
        vad_data.save_npz(vad_data.vad_feeds("eval"), eval_npz)
    ev = dict(np.load(eval_npz))
    feeds = [{"input": ev["input"][i:i + 1], "state": ev["state"][i][:, None].copy(), "sr": np.array(16000, np.int64)}
             for i in range(len(ev["input"]))]
    path = vad_data.silero_model_path()
    models: dict[str, bytes] = {"float": path.read_bytes()}
    rows: dict[str, dict[str, Any]] = {}
    for name, recipe in RECIPES.items():
        if args.rows and not any(w in name for w in args.rows.split(",")):
            continue
        t0 = time.perf_counter()
        res = Recipe.from_dict(recipe).pipeline().run(str(path), calibration_data=cal_npz)
        models[name] = res.model.SerializeToString()
        rows[name] = {"quantize_s": time.perf_counter() - t0, "int8_convs": int8_convs(res.model)}
    flat = Recipe.from_dict({"name": "flat", "passes": [*SPECIALIZE, {"pass": "fold_constants"}, {"pass": "cleanup"}]})
    with tempfile.TemporaryDirectory() as tmp:
        flat_path = Path(tmp) / "flat.onnx"
        flat.pipeline().run(str(path)).save(flat_path)
        from qgraph.testing.runtime import ort_quantize_static

        cal = dict(np.load(cal_npz))
        t0 = time.perf_counter()
        cal_feeds = [{"input": cal["input"][i:i + 1], "state": cal["state"][i][:, None].copy()}
                     for i in range(len(cal["input"]))]
        ort_model = ort_quantize_static(flat_path, Path(tmp) / "ort.onnx", cal_feeds, per_channel=True)
        models["onnxruntime quantize_static"] = ort_model.SerializeToString()
        rows["onnxruntime quantize_static"] = {"quantize_s": time.perf_counter() - t0,
                                               "int8_convs": int8_convs(ort_model)}
    ref = outputs(models["float"], feeds)
    rows = {"float": {}, **rows}
    ref_stream = streamed_chunks(models["float"], feeds)
    for name, model in models.items():
        rows[name].update(scores(ref, outputs(model, feeds)))
        got = streamed_chunks(model, feeds)
        rows[name]["stream_db"] = sqnr(ref_stream, got)
        rows[name]["stream_agree"] = float(np.mean((ref_stream > 0.5) == (got > 0.5)))
    for name, ratio in latency(models, feeds[:200]).items():
        rows[name]["latency_x"] = ratio
    p = ref[0]
    print(f"{len(feeds)} eval chunks: {np.mean(p > 0.5):.0%} speech, {np.mean((p > 0.05) & (p < 0.95)):.0%} "
          "transition chunks (0.05 < p < 0.95)")
    print("| row | prob SQNR | state SQNR | error share of worst 5% | agreement @0.5 | MAE / max | streamed: SQNR, "
          "agreement | latency | int8 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        if name == "float":
            print("| float | reference | | | | | | x1.00 | 0/6 |")
            continue
        stream = f"{r['stream_db']:.1f} dB, {r['stream_agree']:.1%}"
        print(f"| {name} | {r['prob_db']:.1f} dB | {r['state_db']:.1f} dB | {r['top5pct_share']:.0%} | "
              f"{r['agree']:.1%} | {r['mae']:.4f} / {r['max_err']:.3f} | {stream} | x{r['latency_x']:.2f} | "
              f"{r['int8_convs']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
