"""Benchmark: load → rewrite-ready handle → save, against doing it by hand with onnx + graphsurgeon.

    python benchmarks/bench_graph_roundtrip.py [--sizes 10000 50000 100000]

"rewrite-ready" = qgraph's GraphHandle with its name index and networkx view built (what a pass gets).
The by-hand baseline is ``onnx.load`` + ``gs.import_onnx`` + ``gs.export_onnx`` + ``onnx.save``.
Time per node must stay flat across sizes (linear cost) and within 1.5x of the baseline.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from rich.console import Console
from rich.table import Table

from qgraph import GraphHandle, load_model, save_model


def chain_model(n_nodes: int) -> onnx.ModelProto:
    """A Mul→Add→Relu chain of about ``n_nodes`` nodes with small per-node constants."""
    nodes, inits = [], []
    prev = "x"
    for i in range(n_nodes // 3):
        inits.append(onnx.numpy_helper.from_array(np.full((8,), 0.5, np.float32), f"k{i}"))
        nodes.append(onnx.helper.make_node("Mul", [prev, f"k{i}"], [f"m{i}"], name=f"mul{i}"))
        nodes.append(onnx.helper.make_node("Add", [f"m{i}", f"k{i}"], [f"a{i}"], name=f"add{i}"))
        nodes.append(onnx.helper.make_node("Relu", [f"a{i}"], [f"r{i}"], name=f"relu{i}"))
        prev = f"r{i}"
    graph = onnx.helper.make_graph(
        nodes, "chain",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8])],
        [onnx.helper.make_tensor_value_info(prev, onnx.TensorProto.FLOAT, [1, 8])],
        inits,
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)


def by_hand(src: Path, dst: Path) -> float:
    t = time.perf_counter()
    graph = gs.import_onnx(onnx.load(str(src)))
    onnx.save(gs.export_onnx(graph), str(dst))
    return time.perf_counter() - t


def with_qgraph(src: Path, dst: Path) -> float:
    t = time.perf_counter()
    handle = GraphHandle(load_model(src))
    _ = handle.index, handle.nx
    save_model(handle.to_onnx(), dst)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 50_000, 100_000])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    table = Table(title="load → rewrite-ready → save round trip")
    for col in ("nodes", "by hand s", "qgraph s", "qgraph µs/node", "ratio"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            src = Path(tmp) / f"chain{n}.onnx"
            save_model(chain_model(n), src)
            hand = min(by_hand(src, Path(tmp) / "h.onnx") for _ in range(args.repeat))
            ours = min(with_qgraph(src, Path(tmp) / "q.onnx") for _ in range(args.repeat))
            table.add_row(f"{n:,}", f"{hand:.2f}", f"{ours:.2f}", f"{ours / n * 1e6:.1f}", f"{ours / hand:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
