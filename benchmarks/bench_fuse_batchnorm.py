"""Benchmark ``fuse_batchnorm`` against onnxoptimizer's ``fuse_bn_into_conv`` and check that it scales linearly.

Two tables (markdown on stdout, optionally JSON with ``--json``):

1. every light model of the onnx wheel, materialized with seeded weights (``qgraph.testing.models``): BN nodes
   before, BN nodes folded/rewritten by qgraph and by onnxoptimizer, nodes after each, and wall time (best of
   ``--repeats``). qgraph is timed twice: the pass alone on an imported graph, and end to end
   (``GraphHandle(model)`` + pass + ``to_onnx()``), which is what onnxoptimizer's ``optimize(model)`` does
   (proto in, proto out). onnxoptimizer runs ``fuse_bn_into_conv`` followed by ``eliminate_deadend`` and
   ``eliminate_unused_initializer`` so the dead BN nodes and their parameters are removed as well.
2. ``conv_bn_relu_chain`` at 10k / 50k / 100k nodes: seconds per 10k nodes for the pass (should be flat).
3. both tools on small chains (``--optimizer-chain-sizes``): onnxoptimizer's pass is superlinear on long
   chains (about 40 s at 900 nodes and 330 s at 1800 on the reference machine), so it is not run at 10k+.

Run: ``python benchmarks/bench_fuse_batchnorm.py [--repeats 3] [--sizes 10000 50000 100000] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
from qgraph.passes.fuse_batchnorm import FuseBatchNorm

from qgraph import GraphHandle, PassContext
from qgraph.testing.models import LIGHT_MODEL_NAMES, cached_light_model, conv_bn_relu_chain

OPTIMIZER_PASSES = ["fuse_bn_into_conv", "eliminate_deadend", "eliminate_unused_initializer"]


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, value = float("inf"), None
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - start)
    return best, value


def _bn_count(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "BatchNormalization" for n in model.graph.node)


def _qgraph_pass(model: onnx.ModelProto, repeats: int) -> tuple[float, float, onnx.ModelProto, dict[str, Any]]:
    """(pass seconds, end-to-end seconds, output, details); every repeat starts from a fresh import."""
    pass_times = []
    for _ in range(repeats):
        handle = GraphHandle(model)
        gc.collect()
        start = time.perf_counter()
        FuseBatchNorm().run(handle, PassContext())
        pass_times.append(time.perf_counter() - start)

    def end_to_end() -> tuple[onnx.ModelProto, dict[str, Any]]:
        handle = GraphHandle(model)
        res = FuseBatchNorm().run(handle, PassContext())
        return handle.to_onnx(), res.details

    e2e, (out, details) = _best(end_to_end, repeats)
    return min(pass_times), e2e, out, details


def _onnxoptimizer(model: onnx.ModelProto, repeats: int) -> tuple[float, onnx.ModelProto | None, str]:
    try:
        import onnxoptimizer
    except ImportError as exc:
        return float("nan"), None, f"not installed ({exc})"
    try:
        seconds, out = _best(lambda: onnxoptimizer.optimize(model, OPTIMIZER_PASSES), repeats)
    except Exception as exc:  # the optimizer raises assorted errors on models it does not support
        return float("nan"), None, f"{type(exc).__name__}: {exc}"
    return seconds, out, onnxoptimizer.__version__


def light_models(repeats: int, cache: Path) -> list[dict[str, Any]]:
    """Table 1 rows."""
    rows = []
    for name in LIGHT_MODEL_NAMES:
        model = onnx.load(cached_light_model(name, cache))
        bn = _bn_count(model)
        q_pass, q_e2e, q_out, details = _qgraph_pass(model, repeats)
        o_time, o_out, o_version = _onnxoptimizer(model, repeats)
        rows.append(
            {
                "model": name,
                "nodes": len(model.graph.node),
                "bn": bn,
                "qgraph_removed": bn - _bn_count(q_out),
                "qgraph_into_conv": sum(details["folded_into_preceding"].values())
                + sum(details["folded_into_following"].values()),
                "qgraph_mul_add": details["rewritten_to_mul_add"],
                "qgraph_nodes_after": len(q_out.graph.node),
                "qgraph_pass_s": q_pass,
                "qgraph_e2e_s": q_e2e,
                "onnxoptimizer_removed": None if o_out is None else bn - _bn_count(o_out),
                "onnxoptimizer_nodes_after": None if o_out is None else len(o_out.graph.node),
                "onnxoptimizer_added_ops": None
                if o_out is None
                else dict(Counter(n.op_type for n in o_out.graph.node) - Counter(n.op_type for n in model.graph.node)),
                "onnxoptimizer_s": o_time,
                "onnxoptimizer_version": o_version,
            }
        )
        print(f"  {name}: done", file=sys.stderr)
    return rows


def chains(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """Table 2 rows (3 nodes per Conv-BN-Relu block): qgraph only."""
    rows = []
    for nodes in sizes:
        blocks = max(1, round(nodes / 3))
        model = conv_bn_relu_chain(blocks)
        n = len(model.graph.node)
        q_pass, q_e2e, out, details = _qgraph_pass(model, repeats)
        assert _bn_count(out) == 0 and details["folded_into_preceding"] == {"Conv": blocks}
        import_s, _ = _best(functools.partial(GraphHandle, model), repeats)
        rows.append(
            {
                "nodes": n,
                "bn_folded": blocks,
                "pass_s": q_pass,
                "pass_s_per_10k": q_pass / (n / 10_000),
                "import_s": import_s,
                "e2e_s": q_e2e,
                "e2e_s_per_10k": q_e2e / (n / 10_000),
            }
        )
        print(f"  chain {n}: done", file=sys.stderr)
        del model, out
    return rows


def small_chains(sizes: list[int]) -> list[dict[str, Any]]:
    """Table 3 rows: both tools on chains small enough for onnxoptimizer (its fuse pass is superlinear)."""
    rows = []
    for nodes in sizes:
        blocks = max(1, round(nodes / 3))
        model = conv_bn_relu_chain(blocks)
        _, q_e2e, out, _ = _qgraph_pass(model, 1)
        o_time, o_out, _ = _onnxoptimizer(model, 1)
        rows.append(
            {
                "nodes": len(model.graph.node),
                "qgraph_e2e_s": q_e2e,
                "qgraph_bn_left": _bn_count(out),
                "onnxoptimizer_s": o_time,
                "onnxoptimizer_bn_left": None if o_out is None else _bn_count(o_out),
            }
        )
        print(f"  small chain {nodes}: done", file=sys.stderr)
    return rows


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def render(light: list[dict[str, Any]], chain: list[dict[str, Any]], small: list[dict[str, Any]]) -> str:
    """Both tables as markdown."""
    out = [
        f"fuse_batchnorm benchmark — python {platform.python_version()}, {platform.machine()}, "
        f"onnx {onnx.__version__}, onnxoptimizer {light[0]['onnxoptimizer_version'] if light else '?'}",
        "",
        "| model | nodes | BN | qgraph BN removed (into Conv / Mul+Add) | qgraph nodes after | qgraph pass s "
        "| qgraph end-to-end s | onnxoptimizer BN removed | onnxoptimizer nodes after | onnxoptimizer s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in light:
        out.append(
            f"| {r['model']} | {r['nodes']} | {r['bn']} | {r['qgraph_removed']} ({r['qgraph_into_conv']} / "
            f"{r['qgraph_mul_add']}) | {r['qgraph_nodes_after']} | {_fmt(r['qgraph_pass_s'])} | "
            f"{_fmt(r['qgraph_e2e_s'])} | {_fmt(r['onnxoptimizer_removed'])} | "
            f"{_fmt(r['onnxoptimizer_nodes_after'])} | {_fmt(r['onnxoptimizer_s'])} |"
        )
    out += [
        "",
        "| chain nodes | BN folded | pass s | pass s / 10k nodes | import s | end-to-end s | end-to-end s / 10k |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in chain:
        out.append(
            f"| {r['nodes']} | {r['bn_folded']} | {_fmt(r['pass_s'])} | {_fmt(r['pass_s_per_10k'])} | "
            f"{_fmt(r['import_s'])} | {_fmt(r['e2e_s'])} | {_fmt(r['e2e_s_per_10k'])} |"
        )
    if small:
        out += [
            "",
            "| small chain nodes | qgraph end-to-end s | qgraph BN left | onnxoptimizer s | onnxoptimizer BN left |",
            "|---:|---:|---:|---:|---:|",
        ]
        for r in small:
            out.append(
                f"| {r['nodes']} | {_fmt(r['qgraph_e2e_s'])} | {r['qgraph_bn_left']} | "
                f"{_fmt(r['onnxoptimizer_s'])} | {_fmt(r['onnxoptimizer_bn_left'])} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (best is reported)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 50_000, 100_000], help="chain node counts")
    parser.add_argument(
        "--optimizer-chain-sizes",
        type=int,
        nargs="*",
        default=[450, 900],
        help="chain node counts on which onnxoptimizer is also timed (it takes ~40 s at 900 nodes, ~330 s at 1800)",
    )
    parser.add_argument("--cache", type=Path, default=None, help="folder for materialized light models")
    parser.add_argument("--skip-light", action="store_true", help="only run the scaling chains")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or Path(tmp)
        light = [] if args.skip_light else light_models(args.repeats, cache)
        chain = chains(args.sizes, max(1, min(args.repeats, 2)))
        small = small_chains(args.optimizer_chain_sizes)
    print(render(light, chain, small))
    if args.json:
        args.json.write_text(json.dumps({"light": light, "chain": chain, "small": small}, indent=2, default=str))
    ok = all(r["onnxoptimizer_removed"] is None or r["qgraph_removed"] >= r["onnxoptimizer_removed"] for r in light)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
