"""Benchmark: how quantization cost grows with graph size, ready recipes vs a plain recipe vs onnxruntime.

    python benchmarks/bench_scaling.py [--nodes 3000 30000 100000] [--samples 32] [--tools ...] [--quick]
                                       [--ort-max-nodes 3000] [--timeout 900] [--profile TOOL:NODES]

Model: ``qgraph.testing.matmul_add_relu_chain`` (MatMul -> Add -> Relu layers, width 16, 3 nodes per layer),
calibrated on ``--samples`` random ``[1, 16]`` inputs. Each (tool, size) runs in its own child process, so peak
RSS (``ru_maxrss``, which includes building the model) belongs to that run alone. Tools:

- ``float``: one float inference pass of the chain over the calibration data in onnxruntime (session creation
  not counted): the unit every other column is compared with;
- ``plain``: fold_constants, cleanup, insert_qdq (preset ort-x86-vnni, ``activations.method: minmax``);
- ``ort-x86-avx2``, ``ort-x86-vnni``: the ready recipes, as shipped;
- ``ort``: onnxruntime's ``quantize_static`` (QDQ, per channel), only up to ``--ort-max-nodes`` (it is about
  O(N^2.2): 218 s at 3,000 nodes on this machine), and killed after ``--timeout`` seconds.

Printed: wall seconds, the child's CPU seconds (less sensitive than wall time to other load on a shared machine),
peak RSS, the multiple of the float pass, and each qgraph run's per-pass split (the
quantizing pass's calibration in brackets) with the run summary's timing line. ``--quick`` is a CI-sized smoke run
(300 nodes, 8 samples, no onnxruntime quantizer). ``--profile TOOL:NODES`` runs one cell under cProfile and prints
the 40 most expensive functions (cumulative).

Measured (issue #34, AMD Zen 4 with AVX512-VNNI, 2 cores shared with other jobs; wall seconds, peak RSS):

    main before #34, load ~2-5       3,000 nodes             30,000 nodes
    float pass (32 samples)          0.03 s                  1.0 s
    plain                            2.0 s, 197 MB           27.2 s, 691 MB
    ort-x86-avx2                     22.0 s, 308 MB          857 s, 2011 MB (correct_bias 627 s, insert_qdq 103 s)
    ort-x86-vnni                     21.1 s, 308 MB          (not run)
    onnxruntime quantize_static      103.5 s, 354 MB         (not run: O(N^2.2))

    before/after #34, same minutes, load 10-14: child CPU seconds (wall seconds)
    plain                            3.6 -> 3.5 (22.7 -> 21.3)
    ort-x86-vnni                     25.5 -> 23.5 (161 -> 138)
    ort-x86-avx2                     28.9 -> 21.7 (239 -> 84; correct_bias 113 -> 26, insert_qdq 80 -> 14)

Calibration alone (1,000 ReLU outputs of the 3,000-node chain, 32 samples, CPU seconds; one float pass 0.05 s):
minmax 1.1 -> 1.1, entropy 3.7 -> 1.8, auto 5.0 -> 3.3. The ready recipes' outputs are byte-identical before and
after (`tools/recipe_digests.py`). Still far from the issue's targets (3k nodes < 3 s, calibration <= 2x a float
pass): see the issue's report for what is left.

equalize_weights and smooth_quant alone (the ready recipes' options, CPU seconds of the pass, same host under load
2-5; one float pass over the data: 0.03 s at 3k, 1.0 s at 30k):

                                     3,000 nodes             30,000 nodes
    equalize_weights                 2.40 -> 1.3             23.7 -> 12.8-13.2   (50 rounds x 999 / 9,999 pairs)
    smooth_quant (alpha auto)        1.75 -> 0.6             16.6 -> 6.1-7.0

Whole runs after this session's work (calibration candidates on sparse rows, histogram fast paths, correct_bias
with fewer sessions, equalize/smooth_quant above, a full GC only where weights were dropped, a one-walk acyclicity
check), same host idle (load ~1), wall seconds (child CPU), peak RSS:

                                     3,000 nodes                          30,000 nodes
    float pass (32 samples)          0.03 s                               0.90 s
    plain                            1.99 s (2.7), 198 MB                 18.5 s (19.5), 691 MB
    ort-x86-vnni                     9.6 s (10.4), 326 MB                 159 s (160), 1998 MB (correct_bias 108 s)
    ort-x86-avx2                     12.5 s (13.4), 328 MB                168 s (170), 2002 MB (correct_bias 105 s)
    onnxruntime quantize_static      79.7 s (80.1), 343 MB                (not run)
    per pass at 3k (avx2 / vnni)     insert_qdq 2.11 / 1.67 [calibration 1.16 / 1.21] (plain: 1.38 [0.94]),
                                     correct_bias 7.69 / 5.25, equalize_weights 1.24, smooth_quant 0.60

At 100,000 nodes: float pass 3.45 s, plain 70.3 s (69.8 CPU), 2008 MB; ort-x86-vnni did not finish in 420 s.
The 1.5x-of-plain and 3k < 3 s targets are not met: correct_bias (its fidelity guard's two scoring sessions and
fusion probe, and the twin-means runs, each a whole-graph onnxruntime session) and the per-pair CLE sweep remain.

correct_bias measuring each layer's mean input row instead of running a float twin of it (`qgraph.runtime.row_means`),
and its per-layer check run off by default, same host, load ~1, wall seconds (child CPU), peak RSS:

                                     3,000 nodes                          30,000 nodes
    ort-x86-vnni                     8.7 s (9.5), 277 MB                  139.6 s (140.1), 1612 MB
                                     (correct_bias 5.25 -> 4.25)          (correct_bias 108 -> 81.5)
    ort-x86-avx2                     9.45 s (10.2), 280 MB                133.0 s (134.7), 1623 MB
                                     (correct_bias 7.69 -> 4.53)          (correct_bias 105 -> 77.1)
    plain                            1.87 s (2.6)

At 10k nodes correct_bias takes 21.5 s: the guard's two scoring sessions 11.4 s (7.4 s of it building sessions on
the target's kernels), the rows 8.0 s (a ~40k-node graph run in slices: 14 runs per sample).

The fidelity guard scoring long graphs in exact slices (`qgraph.runtime.sliced`: cuts only on integer Q -> DQ
edges, so onnxruntime fuses the same units; the slices' outputs are bit-identical), same host, load ~1:

                                     30,000 nodes                         100,000 nodes
    ort-x86-vnni                     139.6 -> 107.0 s (108.8), 1611 MB    not done in 700 s -> 397 s (401), 5079 MB
                                     (correct_bias 81.5 -> 48.4)          (correct_bias 196; equalize 48.7,
                                                                           insert_qdq 78.5 [cal 46.6], smooth 29.7)

At 30k nodes the guard's two sessions on the target's kernels took 36.6 s to build whole; in 20 slices each they take
8.5 s. Below 8,000 nodes (the 3k chain: 7,829 after quantization) nothing changes.

Then segmented runs on one onnxruntime thread (as every other session: the same reductions on any host) and the
pipeline starting each pass from the snapshot the previous one left (N+1 graph walks, not 2N). Same minutes, 30k
nodes: 106.2 s (d04a98d) -> 103.0 s (correct_bias 52.1 -> 51.0; the fuse passes 0.50 -> 0.31 s each). 100k nodes
re-run: 402 s, 5082 MB. Where the 30k peak is: 939 MB when insert_qdq ends; the guard's sliced session of the graph
+420 MB while it scores; the means run of correct_bias +670 MB (every slice's session kept for the 32 samples:
onnxruntime holds ~3.8 KB per node of a built session, with or without its arena and memory pattern).

Outputs byte-identical (the chain at both sizes, and `tools/recipe_digests.py`). What is left in equalize_weights is
the Gauss-Seidel sweep itself, one pair after the other (each step reads the previous step's scales), ~25 numpy calls
per pair per round; in smooth_quant, measuring (0.42 s at 3k, 5.4 s at 30k: the export, onnxruntime fetching every
MatMul input, in segments above 3k nodes, and the statistics); alpha auto's scoring is ~0.1 s per 1,000 groups.

2026-11-28, idle, 30k nodes: plain 20.1 s, 697 MB; ort-x86-vnni 94.0 s, 1621 MB (correct_bias 43.2, insert_qdq 19.2
[cal 11.8], equalize_weights 13.1, smooth_quant 7.2). What a node costs in memory, whatever the passes do (the chain's
quantized 30k-node graph has 70,000 nodes): the graphsurgeon graph holds 2.5 KB per node (172 MB), one onnxruntime
session of it at ORT_ENABLE_ALL 5.4 KB per node (378 MB). At 100k nodes (~233,000 after quantization) that is
0.57 GB for the graph and 1.26 GB for any session over all of it: the issue's "< 1 GB at 100k" needs every data pass
to run slice-major (build one slice's session, run every sample through it, free it) and the plain recipe to do so
too (2.0 GB at 100k today). Peak RSS after each pass at 30k: insert_qdq 938 MB, correct_bias 1620 MB (its guard's
sliced session +377 MB while scoring).

Then up to 64 samples run slice-major wherever a long graph runs in slices (`qgraph.runtime.segments.run_slice_major`:
every sample through one slice, two at a time, and that slice's session freed before the next is built; the guard's
scoring sessions are single-use). The same runs, so the same model (graph digest equal at 30k and 100k). Same
minutes, ort-x86-vnni, wall seconds and peak RSS of the whole process:

                                     30,000 nodes                         100,000 nodes
    before (2396ffa)                 94.8 s, 1617 MB                      367.5 s, 5083 MB
    after                            97.8 s, 1183 MB                      371.1 s, 3507 MB
                                     (RSS when smooth_quant ends 672 -> 577 MB, insert_qdq 938 -> 890 MB; at 100k
                                     1721 -> 1431 and 2857 -> 2556 MB)

Time is unchanged within this host's drift. Three runs at 30k alternating slice-major on / off
(`SLICE_MAJOR_SAMPLES` 64 / 0):
- correct_bias 42.8 / 43.5 / 47.4 s;
- smooth_quant 6.5 / 7.7 / 6.9 s;
- insert_qdq 18.6 / 20.1 / 18.5 s.
Inside a slice, two samples run at a time; before, the segmented runs were one at a time.

2026-11-29: the run summary's float yardstick built one onnxruntime session over the whole input graph, the last
whole-graph session of a run on the chain, and its build time grows faster than the graph (26.4 s at 100k nodes,
4.1 s at 30k). It now runs in slices typed with the graph's inferred shapes, all built on an untimed first run
(8.3 s and 2.1 s; the timed pass itself 0.85 -> 0.73 s at 100k). Idle host, wall seconds, peak RSS:

                                     3,000 nodes          30,000 nodes                100,000 nodes
    plain                            1.61 s, 199 MB       20.1 -> 16.8 s, 695 MB      60.3 s, 2035 MB (was 70.3)
    ort-x86-vnni                     7.0 s, 278 MB        ~90 -> 86.5 s, 1144 MB      371 -> 328 s, 3512 MB
                                                                                      (correct_bias 150, insert_qdq
                                                                                       70.5 [cal 41.5], equalize 45.3,
                                                                                       smooth_quant 26.1)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
READY = ("ort-x86-avx2", "ort-x86-vnni")
PLAIN = """
name: plain
passes:
  - pass: fold_constants
  - pass: cleanup
  - pass: insert_qdq
    preset: ort-x86-vnni
    activations: {method: minmax}
"""


def _samples(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"input": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(n)]


def _float_pass(model: Any, samples: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    from qgraph.runtime.compare import make_session

    sess = make_session(model)
    start = time.perf_counter()
    for feed in samples:
        sess.run(None, feed)
    return {"seconds": time.perf_counter() - start}


def _qgraph(tool: str, model: Any, samples: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    from qgraph import Recipe
    from qgraph.data import CallableSource
    from qgraph.pipeline.runner import PipelineEvent
    from qgraph.pipeline.timing import run_timing

    recipe = Recipe.from_text(PLAIN) if tool == "plain" else Recipe.from_yaml(ROOT / "recipes" / f"{tool}.yaml")
    cpu: list[float] = []  # per pass, in run order: CPU seconds of this process (steadier than wall on a shared host)

    def on_event(ev: PipelineEvent) -> None:
        if ev.kind == "pass_start":
            cpu.append(-time.process_time())
        elif ev.kind == "pass_end" and cpu:
            cpu[-1] += time.process_time()

    start = time.perf_counter()
    res = recipe.pipeline().run(model, calibration_data=CallableSource(lambda: samples, "chain"), on_event=on_event)
    seconds = time.perf_counter() - start
    cpu += [0.0] * (len(res.records) - len(cpu))
    passes = [[r.name, r.seconds, r.result.calibration_seconds, c] for r, c in zip(res.records, cpu, strict=False)]
    timing = run_timing(res.records, res.float_inference)
    return {"seconds": seconds, "passes": passes, "timing": timing.line() if timing else ""}


def _ort(model: Any, samples: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    import onnx

    from qgraph.testing import ort_quantize_static

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "chain.onnx"
        onnx.save(model, str(src))
        start = time.perf_counter()
        ort_quantize_static(src, Path(tmp) / "q.onnx", samples, per_channel=True)
        return {"seconds": time.perf_counter() - start}


def child(tool: str, nodes: int, n_samples: int) -> dict[str, Any]:
    """One (tool, size) cell, in this process."""
    from qgraph.testing import matmul_add_relu_chain

    model = matmul_add_relu_chain(max(nodes // 3, 1))
    samples = _samples(n_samples)
    if tool == "float":
        out = _float_pass(model, samples)
    elif tool == "ort":
        out = _ort(model, samples)
    else:
        out = _qgraph(tool, model, samples)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["peak_rss_mb"] = usage.ru_maxrss / 1024.0
    out["cpu_seconds"] = usage.ru_utime + usage.ru_stime  # the whole child (model building included): on a shared
    out["nodes"] = len(model.graph.node)  # machine CPU time is less noisy than wall time
    return out


def _run_child(tool: str, nodes: int, n_samples: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", tool, str(nodes), str(n_samples)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:g} s"}
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:160]}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _print_cell(tool: str, cell: dict[str, Any], unit: float | None) -> None:
    if "error" in cell:
        print(f"  {tool:14s} {cell['error']}", flush=True)
        return
    times = f" {cell['seconds'] / unit:7.1f}x float" if unit else ""
    print(f"  {tool:14s} {cell['seconds']:8.2f} s (child CPU {cell['cpu_seconds']:7.1f} s) "
          f"{cell['peak_rss_mb']:7.0f} MB{times}", flush=True)
    if cell.get("passes"):
        split = ", ".join(f"{n} {s:.2f}/{u:.2f}" + (f" [cal {c:.2f}]" if c else "") for n, s, c, u in cell["passes"])
        print(f"      passes (wall/CPU s): {split}", flush=True)
    if cell.get("timing"):
        print(f"      summary: {cell['timing']}", flush=True)


def profile(tool: str, nodes: int, n_samples: int) -> None:
    """Run one cell under cProfile; print the most expensive functions."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    cell = child(tool, nodes, n_samples)
    prof.disable()
    print(json.dumps({k: v for k, v in cell.items() if k != "passes"}))
    pstats.Stats(prof).sort_stats("cumulative").print_stats(40)


def main() -> None:
    """Command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", nargs="+", type=int, default=[3000, 30000, 100000])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--tools", nargs="+", default=["float", "plain", *READY, "ort"])
    ap.add_argument("--ort-max-nodes", type=int, default=3000)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--quick", action="store_true", help="CI smoke size: 300 nodes, 8 samples, no onnxruntime")
    ap.add_argument("--profile", help="TOOL:NODES, one cell under cProfile")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return
    if args.profile:
        tool, nodes = args.profile.split(":")
        profile(tool, int(nodes), args.samples)
        return
    if args.quick:
        args.nodes, args.samples = [300], 8
        args.tools = [t for t in args.tools if t != "ort"]
    print(f"MatMul/Add/Relu chain, {args.samples} calibration samples of [1, 16]")
    for nodes in args.nodes:
        print(f"\n## {nodes} nodes", flush=True)
        unit = None
        for tool in args.tools:
            if tool == "ort" and nodes > args.ort_max_nodes:
                print(f"  {tool:14s} skipped (> --ort-max-nodes {args.ort_max_nodes})", flush=True)
                continue
            cell = _run_child(tool, nodes, args.samples, args.timeout)
            if tool == "float" and "error" not in cell:
                unit = cell["seconds"]
            _print_cell(tool, cell, unit)


if __name__ == "__main__":
    main()
