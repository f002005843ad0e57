"""Sensitivity ranking and automatic float fallback: time, full evaluations, peak RSS, agreement.

Run on demand::

    python benchmarks/bench_fallback.py [--blocks 140] [--agreement-blocks 30] [--samples 16]
                                        [--transformer-layers 53 --transformer-width 128] [--full-transformer]

Models (built here, no downloads):

- ``cnn``: `qgraph.testing.fragile_resnet` with ``--blocks`` residual blocks (5 nodes each, ~700 nodes at 140)
  and five planted fragile layers (an outlier channel before a per-tensor activation pair), INT8 by
  onnxruntime's ``quantize_static`` (QDQ, per-channel weights, MinMax), evaluated on ``--samples`` samples;
- ``transformer``: `qgraph.testing.transformer_encoder` with 53 layers (~1,800 nodes), saved with external
  data, INT8 by qgraph's ``insert_qdq``. ``--full-transformer`` sets width 704 (about 1.3 GB of float weights).

Every measurement runs in a fresh subprocess; its peak RSS is read from ``os.wait4``'s rusage. ``session`` is
the reference for memory: one onnxruntime session of the QDQ model running the evaluation data (what any
evaluation costs). ``ranking`` is `auto_fallback(report_only=True)` (baseline evaluation, the one-run ranking,
range statistics); ``auto`` the whole automatic fallback to a reachable SQNR target: ``--reach`` (75%) of the way
from the INT8 model's SQNR to that of every candidate in float (weights stored as integers keep their error in
float, so that is the most any fallback reaches). The peer is
the previous method, the exact leave-one-out measure (one full evaluation per candidate): its time is
extrapolated from ``--exact-sample`` measured candidates. ``agreement`` ranks a smaller CNN
(``--agreement-blocks``) and a 2-layer transformer encoder (onnxruntime QDQ) both ways and reports how many of
the exact top-10 the one-run top-10 contains.
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

FRAGILE = (8.0, 30.0, 16.0, 60.0, 4.0)


def _fragile(blocks: int) -> dict[int, float]:
    return {blocks * (i + 1) // 7: k for i, k in enumerate(FRAGILE)}


# ----------------------------------------------------------------------------- children
def _child(args: argparse.Namespace) -> dict[str, Any]:
    from qgraph import load_model
    from qgraph.compare import make_session
    from qgraph.sensitivity.evaluate import Evaluator, load_feeds, reference_outputs, run_batches
    from qgraph.sensitivity.ranking import candidate_nodes, rank_nodes, sensitivity_report
    from qgraph.sensitivity.search import auto_fallback
    from qgraph.sensitivity.targets import parse_target

    folder = Path(args.folder)
    ref, qdq, data = folder / "float.onnx", folder / "qdq.onnx", str(folder / "eval.npz")
    start = time.perf_counter()
    if args.child == "session":
        model = load_model(qdq)
        batches = load_feeds(data, model)
        run_batches(make_session(model, mem_pattern=False), batches)
        return {"seconds": time.perf_counter() - start}
    if args.child == "ranking":
        r = auto_fallback(load_model(ref), load_model(qdq), data, "sqnr:999", report_only=True)
        assert r.sensitivity is not None
        return {"seconds": time.perf_counter() - start, "ranking_s": r.stages.get("ranking", 0.0),
                "candidates": r.sensitivity.candidates, "int8": r.int8_score}
    if args.child == "auto":
        r = auto_fallback(load_model(ref), load_model(qdq), data, args.target, max_time=args.max_time)
        return {"seconds": time.perf_counter() - start, "met": r.target_met, "nodes": len(r.nodes),
                "score": r.score, "evaluations": r.evaluations, "stages": r.stages, "message": r.message()}
    fm, qm = load_model(ref), load_model(qdq)
    batches = load_feeds(data, fm)
    ev = Evaluator(qm, batches, reference_outputs(fm, batches))
    cands, _ = candidate_nodes(qm)
    target = parse_target("sqnr:999")
    if args.child == "reach":  # INT8 and every candidate in float: the reachable range of SQNR
        all_float = ev.measure(tuple(n for n, _ in cands))
        sample = [ev.measure((n,)) for n, _ in cands[: args.exact_sample]]
        return {"int8": min(d.sqnr_db for d in ev.measure(()).diffs),
                "all_float": min(d.sqnr_db for d in all_float.diffs), "candidates": len(cands),
                "exact_eval_s": float(np.mean([m.seconds for m in sample]))}
    # agreement
    exact = sensitivity_report(ev, target, cands, stats=False)
    exact_s = time.perf_counter() - start
    t = time.perf_counter()
    one = rank_nodes(ev, target, cands, ev.measure(()))
    one_s = time.perf_counter() - t
    top_exact = [r.name for r in exact.ranked()[:10]]
    top_one = [r.name for r in one.ranked()[:10]]
    # exact_top: 20 (the first 20 of the one-run ranking measured exactly, re-ranked): read off the exact table
    gain = {r.name: r.sensitivity for r in exact.rows}
    refined = sorted((r.name for r in one.ranked()[:20]), key=lambda n: -gain[n])[:10]
    return {"exact_s": exact_s, "one_s": one_s, "candidates": len(cands),
            "overlap": len(set(top_exact) & set(top_one)), "top_exact": top_exact, "top_one": top_one,
            "overlap_exact_top20": len(set(top_exact) & set(refined))}


def _spawn(mode: str, folder: Path, **extra: Any) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--folder", str(folder)]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = subprocess.Popen([*cmd, "--out", out.name], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        err = proc.stderr.read().decode() if proc.stderr else ""
        if status:
            raise RuntimeError(f"{mode} failed:\n{err[-3000:]}")
        result = json.loads(Path(out.name).read_text())
    result["peak_rss_mb"] = usage.ru_maxrss / 1024.0
    return result


# ----------------------------------------------------------------------------- models
def _cnn(folder: Path, blocks: int, samples: int) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    from qgraph.testing import fragile_resnet

    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(fragile_resnet(blocks, fragile=_fragile(blocks)), folder / "float.onnx")
    rng = np.random.default_rng(0)
    feeds = iter([{"input": rng.standard_normal((1, 8, 16, 16)).astype(np.float32)} for _ in range(16)])

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(feeds, None)

    quantize_static(str(folder / "float.onnx"), str(folder / "qdq.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True)
    np.savez(folder / "eval.npz",
             input=np.random.default_rng(1).standard_normal((samples, 8, 16, 16)).astype(np.float32))


def _small_transformer(folder: Path, samples: int) -> None:
    """A 2-layer encoder INT8 by onnxruntime's quantize_static (its Softmax pairs are the fragile layers)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    from qgraph.testing import transformer_encoder, transformer_encoder_inputs

    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(transformer_encoder(layers=2, d_model=64, heads=4, seq=16), folder / "float.onnx")
    feeds = iter(transformer_encoder_inputs(16, seed=1))

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(feeds, None)

    quantize_static(str(folder / "float.onnx"), str(folder / "qdq.onnx"), Reader(), quant_format=QuantFormat.QDQ)
    data = transformer_encoder_inputs(samples, seed=2)
    np.savez(folder / "eval.npz", **{k: np.concatenate([f[k] for f in data]) for k in data[0]})


def _transformer(folder: Path, layers: int, width: int, samples: int) -> int:
    from qgraph import Pipeline, Recipe, save_model
    from qgraph.testing import transformer_encoder, transformer_encoder_inputs

    folder.mkdir(parents=True, exist_ok=True)
    model = transformer_encoder(layers=layers, d_model=width, heads=8, seq=16)
    save_model(model, folder / "float.onnx", external_data=True)
    feeds = transformer_encoder_inputs(samples, seed=1, d_model=width)
    stack = {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}
    np.savez(folder / "eval.npz", **stack)
    np.savez(folder / "calib.npz", **stack)
    recipe = Recipe.from_text("name: t\npasses:\n  - pass: insert_qdq\n")
    qdq = Pipeline(recipe.passes, recipe=recipe).run(folder / "float.onnx", calibration_data=folder / "calib.npz")
    save_model(qdq.model, folder / "qdq.onnx", external_data=True)
    return len(model.graph.node)


# ----------------------------------------------------------------------------- table
def _row(name: str, r: dict[str, Any], base_rss: float, extra: str = "") -> str:
    rss = r["peak_rss_mb"]
    return f"| {name} | {r.get('seconds', 0.0):.1f} | {rss:.0f} | {rss / base_rss:.2f}x | {extra} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=140)
    p.add_argument("--agreement-blocks", type=int, default=30)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--reach", type=float, default=0.75, help="target: this fraction of the reachable SQNR gain")
    p.add_argument("--max-time", type=float, default=240.0)
    p.add_argument("--exact-sample", type=int, default=5)
    p.add_argument("--transformer-layers", type=int, default=53)
    p.add_argument("--transformer-width", type=int, default=128)
    p.add_argument("--full-transformer", action="store_true", help="width 704: about 1.3 GB of float weights")
    p.add_argument("--skip", nargs="*", default=[], choices=["cnn", "agreement", "transformer"])
    p.add_argument("--child")
    p.add_argument("--folder")
    p.add_argument("--target")
    p.add_argument("--out")
    args = p.parse_args()
    if args.child:
        Path(args.out).write_text(json.dumps(_child(args), default=str))
        return
    width = 704 if args.full_transformer else args.transformer_width
    lines = ["| model / stage | seconds | peak RSS MB | RSS / one session | notes |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        if "cnn" not in args.skip:
            folder = Path(tmp) / "cnn"
            _cnn(folder, args.blocks, args.samples)
            nodes = len(onnx.load(folder / "float.onnx").graph.node)
            session = _spawn("session", folder)
            reach = _spawn("reach", folder, exact_sample=args.exact_sample)
            goal = reach["int8"] + args.reach * (reach["all_float"] - reach["int8"])
            ranking = _spawn("ranking", folder)
            auto = _spawn("auto", folder, target=f"sqnr:{goal:.2f}", max_time=args.max_time)
            peer_s = reach["candidates"] * reach["exact_eval_s"]
            lines += [
                _row(f"cnn {nodes} nodes: one session", session, session["peak_rss_mb"]),
                _row("cnn: ranking (baseline + one run + stats)", ranking, session["peak_rss_mb"],
                     f"{ranking['candidates']} candidates, ranking stage {ranking['ranking_s']:.1f} s"),
                _row(f"cnn: auto to sqnr:{goal:.2f}", auto, session["peak_rss_mb"],
                     f"met={auto['met']}, {auto['nodes']} nodes in float, {auto['evaluations']} full evaluations, "
                     f"INT8 {reach['int8']:.2f} dB, all-float {reach['all_float']:.2f} dB; "
                     + ", ".join(f"{k} {v:.1f} s" for k, v in auto["stages"].items())),
                f"| cnn: exact leave-one-out (previous method, extrapolated) | {peer_s:.0f} | - | - | "
                f"{reach['candidates']} evaluations x {reach['exact_eval_s']:.2f} s |",
            ]
            print(auto["message"])
        if "agreement" not in args.skip:
            folder = Path(tmp) / "small"
            _cnn(folder, args.agreement_blocks, args.samples)
            agree = _spawn("agreement", folder)
            lines.append(
                f"| cnn {args.agreement_blocks} blocks: agreement | {agree['one_s']:.1f} "
                f"(exact {agree['exact_s']:.0f}) | {agree['peak_rss_mb']:.0f} | - | "
                f"top-10 overlap {agree['overlap']}/10 over {agree['candidates']} candidates "
                f"({agree['overlap_exact_top20']}/10 with exact_top: 20) |"
            )
            print("exact top-10:", agree["top_exact"], "\none-run top-10:", agree["top_one"])
            folder = Path(tmp) / "small_tr"
            _small_transformer(folder, args.samples)
            agree = _spawn("agreement", folder)
            lines.append(
                f"| transformer 2 layers (onnxruntime QDQ): agreement | {agree['one_s']:.1f} "
                f"(exact {agree['exact_s']:.0f}) | {agree['peak_rss_mb']:.0f} | - | "
                f"top-10 overlap {agree['overlap']}/10 over {agree['candidates']} candidates "
                f"({agree['overlap_exact_top20']}/10 with exact_top: 20) |"
            )
            print("exact top-10:", agree["top_exact"], "\none-run top-10:", agree["top_one"])
        if "transformer" not in args.skip:
            folder = Path(tmp) / "tr"
            nodes = _transformer(folder, args.transformer_layers, width, args.samples)
            mb = sum(f.stat().st_size for f in folder.iterdir() if f.name.startswith("float")) / 2**20
            session = _spawn("session", folder)
            ranking = _spawn("ranking", folder)
            lines += [
                _row(f"transformer {nodes} nodes, {mb:.0f} MB: one session", session, session["peak_rss_mb"]),
                _row("transformer: ranking", ranking, session["peak_rss_mb"],
                     f"{ranking['candidates']} candidates, ranking stage {ranking['ranking_s']:.1f} s"),
            ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
