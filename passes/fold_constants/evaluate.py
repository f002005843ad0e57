"""Evaluation helpers of ``fold_constants``: static Shape/Size values, generator output sizes, and the one
model (one session) that computes every foldable node of a scope."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from qgraph.graph import const_value, is_default_domain

#: ``static_shape(tensor)``: the tensor's fully known shape, or None.
StaticShape = Callable[[gs.Tensor], "tuple[int, ...] | None"]


def shape_value(node: gs.Node, static_shape: StaticShape) -> np.ndarray | None:
    """Value of a Shape/Size node whose input has a static shape (None otherwise)."""
    if node.op not in ("Shape", "Size") or not is_default_domain(node.domain):
        return None
    shape = static_shape(node.inputs[0]) if node.inputs else None
    if shape is None:
        return None
    if node.op == "Size":
        return np.array(math.prod(shape), dtype=np.int64)
    rank = len(shape)
    start = int(node.attrs.get("start", 0))
    end = int(node.attrs.get("end", rank))
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return np.array(shape[start:end], dtype=np.int64)


def generator_size(node: gs.Node, known: dict[int, np.ndarray], static_shape: StaticShape) -> int | None:
    """Bytes a generator op would produce, when its inputs' values are already known; else None."""

    def val(i: int) -> np.ndarray | None:
        if len(node.inputs) <= i or not node.inputs[i].name:
            return None
        t = node.inputs[i]
        return known[id(t)] if id(t) in known else const_value(t)

    def ints(a: np.ndarray) -> list[int]:
        return [int(d) for d in a.reshape(-1)]

    first = val(0)
    if node.op == "ConstantOfShape":
        fill = node.attrs.get("value")
        itemsize = np.asarray(fill.values).dtype.itemsize if isinstance(fill, gs.Constant) else 4
    elif node.op == "OneHot":
        values = val(2)
        itemsize = 8 if values is None else values.dtype.itemsize
    else:
        itemsize = 8 if first is None else first.dtype.itemsize
    out_shape = static_shape(node.outputs[0])
    count: int | None = None
    second = val(1)
    if out_shape is not None:
        count = math.prod(out_shape)
    elif node.op == "ConstantOfShape" and first is not None:
        count = math.prod(ints(first))
    elif node.op == "Expand" and first is not None and second is not None:
        count = math.prod(np.broadcast_shapes(first.shape, tuple(ints(second))))
    elif node.op == "Tile" and first is not None and second is not None:
        count = first.size * math.prod(ints(second))
    elif node.op == "EyeLike" and first is not None:
        count = first.size
    elif node.op == "Range" and first is not None and second is not None and val(2) is not None:
        delta = float(np.asarray(val(2)).reshape(-1)[0])
        span = float(second.reshape(-1)[0]) - float(first.reshape(-1)[0])
        count = max(math.ceil(span / delta), 0) if delta else None
    return None if count is None else count * itemsize


def evaluation_model(
    nodes: list[gs.Node], known: dict[int, np.ndarray], opset: int, domains: list[onnx.OperatorSetIdProto]
) -> tuple[onnx.ModelProto, list[str]]:
    """One model computing every output of ``nodes`` (dependency order) from their constant inputs."""
    model = onnx.ModelProto()
    opsets = [onnx.helper.make_opsetid("", opset)]
    opsets += [imp for imp in domains if not is_default_domain(imp.domain)]
    model.opset_import.extend(opsets)
    model.ir_version = max(min(int(onnx.helper.find_min_ir_version_for(opsets, ignore_unknown=True)), 10), 4)
    graph = model.graph
    graph.name = "qgraph_fold_constants"
    produced = {id(t) for n in nodes for t in n.outputs}
    seen: set[int] = set()
    names: list[str] = []
    for node in nodes:
        for t in node.inputs:
            if not t.name or id(t) in produced or id(t) in seen:
                continue
            seen.add(id(t))
            if isinstance(t, gs.Constant):
                graph.initializer.append(OnnxExporter.export_tensor_proto(t))
            else:
                value = known[id(t)] if id(t) in known else const_value(t)
                graph.initializer.append(numpy_helper.from_array(np.asarray(value), t.name))
        graph.node.append(OnnxExporter.export_node(node))
        for t in node.outputs:
            if t.name:
                graph.output.append(onnx.ValueInfoProto(name=t.name))
                names.append(t.name)
    return model, names


def run_model(engine: str, model: onnx.ModelProto, names: list[str]) -> list[np.ndarray]:
    """Evaluate ``model`` (no inputs) with ``engine`` (``onnxruntime`` or ``reference``)."""
    if engine == "reference":
        from onnx.reference import ReferenceEvaluator

        return [np.asarray(v) for v in ReferenceEvaluator(model).run(names, {})]
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(names, {})]
