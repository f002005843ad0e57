"""Model facts for ``qgraph inspect``: opset, IR, ops, I/O, weights, subgraphs, external data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx

from qgraph.graph import check_acyclic
from qgraph.model_io import load_model


def _value_info(vi: onnx.ValueInfoProto) -> dict[str, Any]:
    tt = vi.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_string(tt.elem_type) if tt.elem_type else "?"
    shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
    return {"name": vi.name, "dtype": dtype.removeprefix("TensorProto."), "shape": shape}


def _walk(graph: onnx.GraphProto, path: str, ops: list[str], subgraphs: list[str]) -> None:
    for node in graph.node:
        ops.append(node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}")
        for attr in node.attribute:
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                sub = f"{path}/{node.name or node.op_type}.{attr.name}"
                subgraphs.append(sub)
                _walk(g, sub, ops, subgraphs)


def inspect_model(path: str | Path) -> dict[str, Any]:
    """A JSON-ready summary of the model at ``path``."""
    raw = onnx.load(str(path), load_external_data=False)
    external = sorted(
        {
            e.value
            for t in raw.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL
            for e in t.external_data
            if e.key == "location"
        }
    )
    model = load_model(path)
    check_acyclic(model)
    ops: list[str] = []
    subgraphs: list[str] = []
    _walk(model.graph, "", ops, subgraphs)
    init_names = {t.name for t in model.graph.initializer}
    init_bytes = sum(
        int(onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize) * _numel(t) for t in model.graph.initializer
    )
    return {
        "path": str(path),
        "ir_version": model.ir_version,
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "nodes": len(ops),
        "ops": ops,
        "inputs": [_value_info(v) for v in model.graph.input if v.name not in init_names],
        "outputs": [_value_info(v) for v in model.graph.output],
        "initializers": len(model.graph.initializer),
        "initializer_bytes": init_bytes,
        "subgraphs": subgraphs,
        "external_data": external,
        "metadata": {p.key: p.value for p in model.metadata_props},
    }


def _numel(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= int(d)
    return n
