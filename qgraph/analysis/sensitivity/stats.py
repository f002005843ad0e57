"""Range and clipping statistics of quantized nodes' activation inputs, and MatMul FLOPs in INT8."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qgraph.data import Feed
from qgraph.graph import GraphHandle, ProtoNames, insert_after_producers
from qgraph.quant.dynamic_graph import dynamic_units
from qgraph.quant.qdq_graph import float_source, is_dq, qparams
from qgraph.runtime.compare import make_session, session_run


# ----------------------------------------------------------------------------- range / clipping statistics
def range_stats(qdq: onnx.ModelProto, batches: Sequence[Feed], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per node in ``names``: clipping and quantization SQNR of each activation input, on the INT8 model.

    Reduced inside onnxruntime, so memory stays that of one inference: for every float tensor ``x`` entering an
    activation QuantizeLinear whose DequantizeLinear ``fq`` feeds a node of ``names``, the graph also computes
    min(x), max(x), sum(x²), sum((fq - x)²) and the count of values outside the pair's representable range, as
    scalar outputs (``x`` is clamped at 0 first where the quantizer folded a Relu into the pair).
    """
    handle = GraphHandle(qdq)
    found = _pairs_feeding(handle, set(names))
    if not found:
        return {}
    per_tensor, node_inputs = found
    model = handle.to_onnx()
    reductions = _add_reductions(model, per_tensor)
    session = make_session(model, mem_pattern=False)
    stats = {n: {"min": math.inf, "max": -math.inf, "clipped": 0, "count": 0, "sig": 0.0, "err": 0.0}
             for n in per_tensor}
    fetch = [out for outs in reductions.values() for out in outs]
    for feed in batches:
        values = dict(zip(fetch, session_run(session, fetch, feed), strict=True))
        for name, (lo_o, hi_o, sig_o, err_o, clip_o, size_o) in reductions.items():
            st = stats[name]
            st["min"], st["max"] = min(st["min"], float(values[lo_o])), max(st["max"], float(values[hi_o]))
            st["sig"] += float(values[sig_o])
            st["err"] += float(values[err_o])
            st["clipped"] += int(values[clip_o])
            st["count"] += int(values[size_o])
    return _rows(node_inputs, stats, per_tensor)


_Pair = tuple[str, str, Any, bool]  # float source tensor, DQ output tensor, QParams, relu folded


def _pairs_feeding(handle: GraphHandle, wanted: set[str]) -> tuple[dict[str, _Pair], dict[str, list[str]]] | None:
    per_tensor: dict[str, _Pair] = {}
    node_inputs: dict[str, list[str]] = {}
    for node in handle.index.nodes:
        if node.name not in wanted:
            continue
        for t in node.inputs:
            dq = handle.producer(t)
            if dq is None or not is_dq(dq):
                continue
            q = handle.producer(dq.inputs[0])
            src = float_source(handle, t)
            if q is None or src.tensor is None or src.weight_dq is not None:
                continue
            params = qparams(handle, q)
            if params is None:
                continue
            per_tensor.setdefault(q.inputs[0].name, (q.inputs[0].name, dq.outputs[0].name, params, src.relu))
            node_inputs.setdefault(node.name, []).append(q.inputs[0].name)
    return (per_tensor, node_inputs) if per_tensor else None


def _add_reductions(model: onnx.ModelProto, per_tensor: dict[str, _Pair]) -> dict[str, tuple[str, ...]]:
    """Append the reduction nodes of `range_stats` to ``model`` (in place); output names per source tensor."""
    g = model.graph
    out: dict[str, tuple[str, ...]] = {}
    after: dict[str, list[onnx.NodeProto]] = {}  # DQ output -> the reductions that read it
    space = ProtoNames(model).prefix("qgraph_stats")  # a namespace no name of the model is in
    for k, (name, (src, fq, params, relu)) in enumerate(per_tensor.items()):
        p = f"{space}{k}/"
        nodes: list[onnx.NodeProto] = []
        x = src
        if relu:
            nodes.append(helper.make_node("Relu", [src], [p + "x"]))
            x = p + "x"
        lo, hi = params.representable
        g.initializer.extend([numpy_helper.from_array(np.array(lo, np.float32), p + "lo"),
                              numpy_helper.from_array(np.array(hi, np.float32), p + "hi")])
        if params.scale.dtype == np.float32:  # float32 activations (the usual case): no copies
            x32, fq32 = x, fq
        else:  # float16/bfloat16 activations: reduce in float32 (sums of squares overflow float16)
            x32, fq32 = p + "x32", p + "fq32"
            nodes.extend([helper.make_node("Cast", [x], [x32], to=TensorProto.FLOAT),
                          helper.make_node("Cast", [fq], [fq32], to=TensorProto.FLOAT)])
        nodes.extend([
            helper.make_node("Sub", [fq32, x32], [p + "e"]),
            helper.make_node("Less", [x32, p + "lo"], [p + "below"]),
            helper.make_node("Greater", [x32, p + "hi"], [p + "above"]),
            helper.make_node("Or", [p + "below", p + "above"], [p + "outside"]),
            helper.make_node("Cast", [p + "outside"], [p + "outside_f"], to=TensorProto.FLOAT),
            helper.make_node("Size", [x32], [p + "size"]),
        ])
        names = []
        for op, src_name, tag in (("ReduceMin", x32, "min"), ("ReduceMax", x32, "max"),
                                  ("ReduceSumSquare", x32, "sig"), ("ReduceSumSquare", p + "e", "err"),
                                  ("ReduceSum", p + "outside_f", "clip")):
            # All axes, no keepdims: a scalar (ReduceSum takes its axes as an input from opset 13, the rest
            # from 18; leaving them out reduces everything at any opset).
            nodes.append(helper.make_node(op, [src_name], [p + tag], keepdims=0))
            names.append(p + tag)
        names.append(p + "size")
        for n_out in names:
            g.output.append(helper.make_value_info(n_out, onnx.TypeProto()))
        out[name] = tuple(names)
        after.setdefault(fq, []).extend(nodes)
    # Right after the DequantizeLinear they read: each activation is reduced as soon as it exists and can be freed.
    insert_after_producers(g, after)
    return out


def _rows(node_inputs: dict[str, list[str]], stats: dict[str, dict[str, Any]],
          per_tensor: dict[str, _Pair]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for node_name, tensors in node_inputs.items():
        rows = []
        for name in tensors:
            s, params = stats[name], per_tensor[name][2]
            lo, hi = params.representable
            rows.append({
                "tensor": name,
                "observed_min": s["min"],
                "observed_max": s["max"],
                "representable_min": lo,
                "representable_max": hi,
                "scale": float(np.max(params.scale)),
                "clip_fraction": s["clipped"] / s["count"] if s["count"] else 0.0,
                "sqnr_db": _sqnr(s["sig"], s["err"]),
            })
        out[node_name] = {
            "clip_fraction": max(r["clip_fraction"] for r in rows),
            "input_sqnr_db": min(r["sqnr_db"] for r in rows),
            "inputs": rows,
        }
    return out


def _sqnr(signal_power: float, error_power: float) -> float:
    if error_power == 0:
        return math.inf
    if signal_power == 0:
        return -math.inf
    return 10.0 * math.log10(signal_power / error_power)


def matmul_flops(
    model: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]] | None = None
) -> list[dict[str, Any]]:
    """FLOPs (2·M·K·N) of every MatMul/Gemm and whether it runs in INT8.

    Dynamic input dimensions take their size in ``input_shapes`` when given (e.g. one evaluation sample),
    else 1. A MatMul/Gemm counts as INT8 when both of its matrix inputs are read through DequantizeLinear, and so
    does a dynamically quantized MatMul (`qgraph.quant.dynamic_graph`).
    """
    shaped = onnx.ModelProto()
    shaped.CopyFrom(model)
    for vi in shaped.graph.input:
        dims = (input_shapes or {}).get(vi.name)
        if dims is not None and len(dims) == len(vi.type.tensor_type.shape.dim):
            for d, size in zip(vi.type.tensor_type.shape.dim, dims, strict=True):
                d.dim_value = int(size)
    inferred = onnx.shape_inference.infer_shapes(shaped)
    shapes: dict[str, list[int]] = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        shapes[vi.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in dims]
    for init in model.graph.initializer:
        shapes[init.name] = list(init.dims)
    handle = GraphHandle(model)
    rows = []
    for node in handle.index.nodes:
        if node.op not in ("MatMul", "Gemm") or len(node.inputs) < 2:
            continue
        a, b = shapes.get(node.inputs[0].name), shapes.get(node.inputs[1].name)
        if not a or not b:
            continue
        if node.op == "Gemm":
            m, k = (a[1], a[0]) if node.attrs.get("transA", 0) else (a[0], a[1])
            n = b[0] if node.attrs.get("transB", 0) else b[1]
            flops = 2 * m * k * n
        else:
            a2, b2 = ([1, *a] if len(a) == 1 else a), ([*b, 1] if len(b) == 1 else b)
            batch = np.broadcast_shapes(tuple(a2[:-2]), tuple(b2[:-2]))
            flops = 2 * int(np.prod(batch)) * a2[-2] * a2[-1] * b2[-1]
        int8 = all((p := handle.producer(t)) is not None and is_dq(p) for t in node.inputs[:2])
        rows.append({"name": node.name, "op": node.op, "flops": int(flops), "int8": int8})
    for unit in dynamic_units(handle):  # dynamically quantized MatMuls: INT8, their X quantized at run time
        x = shapes.get(unit.x.name)
        if x:
            k, n = unit.codes.shape
            rows.append({"name": unit.name, "op": unit.op, "flops": 2 * int(np.prod(x[:-1])) * k * n, "int8": True})
    return rows
