"""Sensitivity ranking and automatic float fallback: time, full evaluations, peak RSS, agreement.

Run on demand::

    python benchmarks/bench_fallback.py [--blocks 140] [--agreement-blocks 30] [--samples 16]
                                        [--transformer-layers 53 --transformer-width 128] [--full-transformer]
                                        [--repeats 3] [--skip cnn agreement transformer]

Models (built here, no downloads):

- ``cnn``: `qgraph.testing.fragile_resnet` with ``--blocks`` residual blocks (5 nodes each, ~700 nodes at 140)
  and five planted fragile layers (an outlier channel before a per-tensor activation pair), INT8 by
  onnxruntime's ``quantize_static`` (QDQ, per-channel weights, MinMax), evaluated on ``--samples`` samples;
- ``transformer``: `qgraph.testing.transformer_encoder` with 53 layers (~1,800 nodes), saved with external
  data, INT8 by qgraph's ``insert_qdq``. ``--full-transformer`` sets width 704 (about 1.3 GB of float weights).

Every measurement runs in a fresh subprocess; its peak RSS is read from ``os.wait4``'s rusage. ``session`` is
the reference for memory: one onnxruntime session of the QDQ model running the evaluation data (what any
evaluation costs). ``ranking`` is `auto_fallback` with ``report_only`` (baseline evaluation, the one-run ranking,
range statistics); ``auto`` the whole automatic fallback to a reachable SQNR target: ``--reach`` (75%) of the way
from the INT8 model's SQNR to that of every candidate in float (weights stored as integers keep their error in
float, so that is the most any fallback reaches). The peer is
the previous method, the exact leave-one-out measure (one full evaluation per candidate): its time is
extrapolated from ``--exact-sample`` measured candidates. ``agreement`` ranks a smaller CNN
(``--agreement-blocks``) and a 2-layer transformer encoder (onnxruntime QDQ) both ways and reports how many of
the exact top-10 the one-run top-10 contains, on the evaluation set and on ``--repeats`` independent sets of the
same size. Next to it, the exact measure's own stability: its top-10 overlap between every two sets
(self-agreement; a ranking cannot be expected to agree with the exact one better than that), and the noise floor
(twice the largest standard deviation over the sets of an exact top-10 gain) with how many of the exact top-10
nodes whose mean gain exceeds it (distinguishable from noise) the one-run top-10 contains.
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
ROOT = Path(__file__).resolve().parents[1]


def _fragile(blocks: int) -> dict[int, float]:
    return {blocks * (i + 1) // 7: k for i, k in enumerate(FRAGILE)}


# ----------------------------------------------------------------------------- children
def _child(args: argparse.Namespace) -> dict[str, Any]:
    from qgraph import load_model
    from qgraph.analysis.sensitivity.evaluate import Evaluator, load_feeds, reference_outputs, run_batches
    from qgraph.analysis.sensitivity.options import SearchOptions
    from qgraph.analysis.sensitivity.ranking import candidate_nodes
    from qgraph.analysis.sensitivity.search import auto_fallback
    from qgraph.analysis.sensitivity.targets import parse_target
    from qgraph.runtime.compare import make_session

    folder = Path(args.folder)
    ref, qdq, data = folder / "float.onnx", folder / "qdq.onnx", str(folder / "eval.npz")
    start = time.perf_counter()
    if args.child == "session":
        model = load_model(qdq)
        batches = load_feeds(data, model)
        run_batches(make_session(model, mem_pattern=False), batches)
        return {"seconds": time.perf_counter() - start}
    if args.child == "ranking":
        r = auto_fallback(load_model(ref), load_model(qdq), data, "sqnr:999", SearchOptions(report_only=True))
        assert r.sensitivity is not None
        return {"seconds": time.perf_counter() - start, "ranking_s": r.stages.get("ranking", 0.0),
                "candidates": r.sensitivity.candidates, "int8": r.int8_score}
    if args.child == "auto":
        from qgraph.analysis.sensitivity.cost import CostSpec
        from qgraph.quant.reference_weights import ReferenceWeights
        from qgraph.runtime.latency import shipped_latency_table

        # modelled latency from the table insert_qdq ships, whatever the order (cost: error ranks without it)
        costs = CostSpec(shipped_latency_table(), "ort-x86-vnni")
        fm = load_model(ref)
        r = auto_fallback(fm, load_model(qdq), data, args.target, SearchOptions(
            max_time=args.max_time, costs=costs, rank_by=args.cost, float_weights=ReferenceWeights(fm),
            latency_rounds=args.latency_rounds))
        return {"seconds": time.perf_counter() - start, "met": r.target_met, "nodes": len(r.nodes),
                "score": r.score, "evaluations": r.evaluations, "stages": r.stages, "message": r.message(),
                "latency": r.latency}
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
    # agreement, on the evaluation set and on ``--repeats`` independent sets of the same size
    runs = [_agreement_run(ev, target, cands)]
    for i in range(1, args.repeats + 1):
        b = load_feeds(str(folder / f"eval_r{i}.npz"), fm)
        runs.append(_agreement_run(Evaluator(qm, b, reference_outputs(fm, b)), target, cands))
    return {"candidates": len(cands), **_agreement_summary(runs)}


def _agreement_run(ev: Any, target: Any, cands: list[tuple[str, str]]) -> dict[str, Any]:
    """Exact (leave-one-out) and one-run rankings of ``cands`` on one evaluation set."""
    from qgraph.analysis.sensitivity.ranking import rank_nodes, sensitivity_report

    t = time.perf_counter()
    exact = sensitivity_report(ev, target, cands, stats=False)
    exact_s = time.perf_counter() - t
    t = time.perf_counter()
    one = rank_nodes(ev, target, cands, ev.measure(()))
    return {"exact_s": exact_s, "one_s": time.perf_counter() - t,
            "gain": {r.name: r.sensitivity for r in exact.rows},
            "top_exact": [r.name for r in exact.ranked()[:10]], "order_one": [r.name for r in one.ranked()]}


def _agreement_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Top-10 overlaps: one-run vs exact per set, exact vs exact across sets, and over distinguishable nodes.

    Noise floor: the exact gain of node ``n`` measured on the ``R`` independent sets has standard deviation
    ``σ_n``; ``floor = 2 max_n σ_n`` over the exact top-10 of the first set. A node is distinguishable when its
    mean gain exceeds that floor; ``overlap_distinct`` counts the distinguishable nodes of the exact top-10 that
    the one-run top-10 contains."""
    first = runs[0]
    names = list(first["gain"])
    gains = np.array([[r["gain"][n] for n in names] for r in runs])
    mean = dict(zip(names, gains.mean(0), strict=True))
    std = dict(zip(names, gains.std(0, ddof=1) if len(runs) > 1 else 0 * gains[0], strict=True))
    floor = 2 * max(std[n] for n in first["top_exact"])
    top_one = first["order_one"][:10]
    distinct = [n for n in first["top_exact"] if mean[n] > floor]
    pairs = [(a, b) for i, a in enumerate(runs) for b in runs[i + 1:]]
    return {
        "exact_s": first["exact_s"], "one_s": first["one_s"], "sets": len(runs),
        "top_exact": first["top_exact"], "top_one": top_one,
        "overlap": len(set(first["top_exact"]) & set(top_one)),
        # exact gains averaged over all the sets (R times the samples): a steadier exact top-10
        "overlap_pooled": len(set(sorted(names, key=lambda n: -mean[n])[:10]) & set(top_one)),
        "overlap_mean": float(np.mean([len(set(r["top_exact"]) & set(r["order_one"][:10])) for r in runs])),
        "self_agreement": [len(set(a["top_exact"]) & set(b["top_exact"])) for a, b in pairs],
        "floor_db": floor, "distinct": len(distinct), "overlap_distinct": len(set(distinct) & set(top_one)),
        "top_gains": [round(first["gain"][n], 4) for n in first["top_exact"]],
        # exact_top: 20 (the first 20 of the one-run ranking measured exactly, re-ranked)
        "overlap_exact_top20": len(set(first["top_exact"]) & set(
            sorted(first["order_one"][:20], key=lambda n: -first["gain"][n])[:10])),
    }


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
def _cnn(folder: Path, blocks: int, samples: int, repeats: int = 0) -> None:
    from qgraph.testing import fragile_resnet, ort_quantize_static

    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(fragile_resnet(blocks, fragile=_fragile(blocks)), folder / "float.onnx")
    rng = np.random.default_rng(0)
    feeds = [{"input": rng.standard_normal((1, 8, 16, 16)).astype(np.float32)} for _ in range(16)]
    ort_quantize_static(folder / "float.onnx", folder / "qdq.onnx", feeds, per_channel=True)
    for i in range(repeats + 1):  # eval.npz, then independent sets of the same size for the repeats
        np.savez(folder / ("eval.npz" if i == 0 else f"eval_r{i}.npz"),
                 input=np.random.default_rng(1 + 100 * i).standard_normal((samples, 8, 16, 16)).astype(np.float32))


def _small_transformer(folder: Path, samples: int, repeats: int = 0) -> None:
    """A 2-layer encoder INT8 by onnxruntime's quantize_static (its Softmax pairs are the fragile layers)."""
    from qgraph.testing import ort_quantize_static, transformer_encoder, transformer_encoder_inputs

    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(transformer_encoder(layers=2, d_model=64, heads=4, seq=16), folder / "float.onnx")
    ort_quantize_static(folder / "float.onnx", folder / "qdq.onnx", transformer_encoder_inputs(16, seed=1))
    for i in range(repeats + 1):
        data = transformer_encoder_inputs(samples, seed=2 + 100 * i)
        np.savez(folder / ("eval.npz" if i == 0 else f"eval_r{i}.npz"),
                 **{k: np.concatenate([f[k] for f in data]) for k in data[0]})


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
def _agreement_row(name: str, a: dict[str, Any]) -> str:
    print(f"{name}: exact top-10 {a['top_exact']}\n  gains (dB) {a['top_gains']}\n  one-run top-10 {a['top_one']}")
    selfs = a["self_agreement"]
    return (f"| {name}: agreement | {a['one_s']:.1f} (exact {a['exact_s']:.0f}) | {a['peak_rss_mb']:.0f} | - | "
            f"top-10 overlap {a['overlap']}/10 over {a['candidates']} candidates (mean {a['overlap_mean']:.1f} "
            f"over {a['sets']} eval sets, {a['overlap_pooled']}/10 with exact gains averaged over them; "
            f"{a['overlap_exact_top20']}/10 with exact_top: 20); "
            f"exact self-agreement across eval sets {min(selfs, default=10)}-{max(selfs, default=10)}/10 "
            f"(mean {np.mean(selfs) if selfs else 10:.1f}); noise floor {a['floor_db']:.4f} dB: "
            f"{a['overlap_distinct']}/{a['distinct']} distinguishable exact top-10 nodes in the one-run top-10 |")


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
    p.add_argument("--repeats", type=int, default=3,
                   help="agreement: independent evaluation sets (same size) the exact measure is repeated on")
    p.add_argument("--transformer-layers", type=int, default=53)
    p.add_argument("--transformer-width", type=int, default=128)
    p.add_argument("--full-transformer", action="store_true", help="width 704: about 1.3 GB of float weights")
    p.add_argument("--skip", nargs="*", default=[], choices=["cnn", "agreement", "transformer"])
    p.add_argument("--child")
    p.add_argument("--folder")
    p.add_argument("--target")
    p.add_argument("--cost", default="latency", choices=["error", "latency"])
    p.add_argument("--latency-rounds", type=int, default=5, help="onnxruntime timing rounds of the chosen model")
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
            autos = {c: _spawn("auto", folder, target=f"sqnr:{goal:.2f}", max_time=args.max_time, cost=c,
                               latency_rounds=args.latency_rounds) for c in ("error", "latency")}
            auto = autos["error"]
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
            for c, a in autos.items():
                lat = a["latency"]
                measured = (f", measured {lat['measured_chosen']:.2f}x (INT8 {lat['measured_int8']:.2f}x)"
                            if "measured_chosen" in lat else "")
                lines.append(_row(f"cnn: auto, cost: {c}", a, session["peak_rss_mb"],
                                  f"met={a['met']}, {a['nodes']} nodes in float, latency modelled "
                                  f"{lat.get('modelled_chosen_ratio', float('nan')):.2f}x float (INT8 "
                                  f"{lat.get('modelled_int8_ratio', float('nan')):.2f}x){measured}"))
                print(a["message"])
        if "agreement" not in args.skip:
            for name, build in ((f"cnn {args.agreement_blocks} blocks", lambda f: _cnn(
                    f, args.agreement_blocks, args.samples, args.repeats)),
                    ("transformer 2 layers (onnxruntime QDQ)", lambda f: _small_transformer(
                        f, args.samples, args.repeats))):
                folder = Path(tmp) / name.split()[0]
                build(folder)
                lines.append(_agreement_row(name, _spawn("agreement", folder, repeats=args.repeats)))
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
