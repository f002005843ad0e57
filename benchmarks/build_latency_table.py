"""Build insert_qdq's latency cost table on this host (what ``latency: table`` reads).

Run on demand (about a minute per model)::

    python benchmarks/build_latency_table.py [--models shufflenet mobilenet_v2 squeezenet digits]
                                             [--presets ort-x86-vnni] [--runs 10]
                                             [--out qgraph/runtime/latency_table.json]

Per model and preset: the model's preparation passes (fold_constants, fuse_batchnorm, cleanup), then insert_qdq
with ``latency: off`` (every unit int8); the float and the int8 model are profiled in onnxruntime alternately
(`qgraph.runtime.latency.profile_kernels`: batch 1, 2 threads, ORT_ENABLE_ALL, median per node), so each unit's cost is
what onnxruntime executes *in the graph* (fusions, NHWC layout of u8 kernels, reorders). Each quantizable unit
(its node plus the Relu/Clip/bias Add it absorbs) and each integer data-movement node is filed under its
`qgraph.runtime.latency.op_signature` (kind, size bucket, work); entries average their samples. QuantizeLinear and
DequantizeLinear costs per element (with the NCHW <-> NHWC layout change at a float/int8 boundary) are timed on
1M elements. The table is per host: rebuild it on the target.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]


def corpus(name: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Float model and 8 calibration samples (digits: its own calibration set; others: seeded N(0, 1))."""
    if name == "digits":
        model = onnx.load(str(ROOT / "examples" / "digits" / "model.onnx"))
        cal = dict(np.load(ROOT / "examples" / "digits" / "calibration.npz"))
        return model, {k: v[:8] for k, v in cal.items() if k != "labels"}
    if name == "mobilenet_v2":
        from qgraph.testing import mobilenet_v2

        model = mobilenet_v2()
    else:
        from qgraph.passes.lower_opset.raising import raise_model

        from qgraph.testing import materialize_light_model

        model = raise_model(materialize_light_model(name), 13).model
    inp = model.graph.input[0]
    shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    return model, {inp.name: np.random.default_rng(0).standard_normal((8, *shape[1:])).astype(np.float32)}


def measure(name: str, preset: str, runs: int) -> list[dict[str, Any]]:
    """Samples ``{kind, bucket, work, float_us, int8_us}`` of every unit and integer movement node of ``name``."""
    from qgraph.passes.insert_qdq import InsertQDQ
    from qgraph.passes.insert_qdq.ops import float32_tensors
    from qgraph.passes.insert_qdq.placement import Planner
    from qgraph.passes.insert_qdq.speed import CostModel, Measured, name_nodes

    from qgraph import GraphHandle, Pipeline, Recipe
    from qgraph.data import CallableSource
    from qgraph.runtime.compare import random_feeds
    from qgraph.runtime.latency import profile_kernels

    model, cal = corpus(name)
    recipe = Recipe.from_yaml(ROOT / "recipes" / f"{preset}.yaml")
    prep = name_nodes(Pipeline([p for p in recipe.passes if p.name != "insert_qdq"]).run(model).model)
    samples = [{k: v[i : i + 1] for k, v in cal.items()} for i in range(8)]
    quant = InsertQDQ(preset=preset, latency={"mode": "off"})
    int8 = Pipeline([quant]).run(prep, calibration_data=CallableSource(lambda: samples, "cal")).model
    prof = profile_kernels({"float": prep, "int8": int8}, random_feeds(prep, 1)[0], runs=runs, budget_seconds=60)
    graph = GraphHandle(prep)
    cfg = quant.config
    selected = {id(n) for n in graph.index.nodes if n.op in set(cfg.op_types)}
    plan = Planner(graph, cfg, selected, float32_tensors(graph.index.nodes, graph.graph.inputs)).plan()
    costs = CostModel(graph, preset, None, Measured(prof["float"], prof["int8"], 1.0, 1.0))
    out = []
    for node, fused in [(u.node, [u.node, *u.absorbed]) for u in plan.units] + [(n, [n]) for n in plan.movement]:
        cost, sig = costs.node(node, fused), costs.signature(node)
        if cost is not None and sig is not None:
            out.append({"kind": sig[0], "bucket": sig[1], "work": sig[2], "float_us": cost.float_us,
                        "int8_us": cost.int8_us})
    return out


def aggregate(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (kind, bucket): mean work and mean times of its samples."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        groups[(s["kind"], s["bucket"])].append(s)
    return [
        {"kind": k, "bucket": b, "samples": len(g), "work": float(np.mean([s["work"] for s in g])),
         "float_us": round(float(np.mean([s["float_us"] for s in g])), 3),
         "int8_us": round(float(np.mean([s["int8_us"] for s in g])), 3)}
        for (k, b), g in sorted(groups.items())
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    corpus_names = ["shufflenet", "mobilenet_v2", "squeezenet", "resnet50", "digits"]
    parser.add_argument("--models", nargs="*", default=corpus_names)
    parser.add_argument("--presets", nargs="*", default=["ort-x86-vnni"])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "qgraph" / "runtime" / "latency_table.json")
    args = parser.parse_args()
    import onnxruntime as ort

    from qgraph.runtime.kernels.cpu import host_cpu
    from qgraph.runtime.latency import TABLE_VERSION, LatencyTable, element_costs

    q_ns, dq_ns = element_costs()
    presets = {}
    for preset in args.presets:
        samples = []
        for name in args.models:
            got = measure(name, preset, args.runs)
            print(f"{preset} {name}: {len(got)} samples", flush=True)
            samples += got
        presets[preset] = {"quantize_ns": q_ns, "dequantize_ns": dq_ns, "entries": aggregate(samples)}
    host = host_cpu().describe()
    table = {"version": TABLE_VERSION, "host": host or platform.machine(), "runtime": ort.__version__,
             "threads": 2, "presets": presets}
    LatencyTable.model_validate(table)
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    for e in presets[args.presets[0]]["entries"]:
        print(f"{e['kind']:24s} {e['bucket']:14s} n={e['samples']:3d} float {e['float_us']:9.1f} us  "
              f"int8 {e['int8_us']:9.1f} us  x{e['int8_us'] / max(e['float_us'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
