"""Range and clipping statistics of quantized nodes' activation inputs, and MatMul FLOPs in INT8."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

from qgraph import GraphHandle
from qgraph.compare import make_session, session_run
from qgraph.data import Feed
from qgraph.fallback import fake_quantize, float_source, is_dq, qparams


# ----------------------------------------------------------------------------- range / clipping statistics
def range_stats(qdq: onnx.ModelProto, batches: Sequence[Feed], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per node in ``names``: clipping and quantization SQNR of each activation input, on the INT8 model.

    One instrumented session: the float tensors entering the nodes' activation QuantizeLinears become extra
    outputs, and each is fake-quantized in numpy with its pair's parameters.
    """
    handle = GraphHandle(qdq)
    wanted = set(names)
    per_tensor: dict[str, Any] = {}
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
            per_tensor.setdefault(q.inputs[0].name, (q.inputs[0], params, src.relu))
            node_inputs.setdefault(node.name, []).append(q.inputs[0].name)
    if not per_tensor:
        return {}
    known = {t.name for t in handle.graph.outputs} | {t.name for t in handle.graph.inputs}
    for name, (tensor, params, _) in per_tensor.items():
        if name not in known:
            if tensor.dtype is None:
                tensor.dtype = params.scale.dtype
            handle.graph.outputs.append(tensor)
            known.add(name)
    session = make_session(handle.to_onnx())
    out_names = [o.name for o in session.get_outputs()]
    stats = {
        n: {"min": math.inf, "max": -math.inf, "clipped": 0, "count": 0, "sig": 0.0, "err": 0.0} for n in per_tensor
    }
    for feed in batches:
        values = {**feed, **dict(zip(out_names, session_run(session, out_names, feed), strict=True))}
        for name, (_, params, relu) in per_tensor.items():
            x = np.asarray(values[name], dtype=np.float64)
            if relu:  # the quantizer folded a Relu into this pair: its clamp at 0 is not clipping
                x = np.maximum(x, 0.0)
            if x.size == 0:
                continue
            fq, clipped = fake_quantize(x, params)
            s = stats[name]
            s["min"], s["max"] = min(s["min"], float(x.min())), max(s["max"], float(x.max()))
            s["clipped"] += clipped
            s["count"] += x.size
            s["sig"] += float(np.sum(x * x))
            s["err"] += float(np.sum((fq - x) ** 2))
    out: dict[str, dict[str, Any]] = {}
    for node_name, tensors in node_inputs.items():
        rows = []
        for name in tensors:
            s, params = stats[name], per_tensor[name][1]
            lo, hi = params.representable
            rows.append(
                {
                    "tensor": name,
                    "observed_min": s["min"],
                    "observed_max": s["max"],
                    "representable_min": lo,
                    "representable_max": hi,
                    "scale": float(np.max(params.scale)),
                    "clip_fraction": s["clipped"] / s["count"] if s["count"] else 0.0,
                    "sqnr_db": _sqnr(s["sig"], s["err"]),
                }
            )
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
    else 1. A MatMul/Gemm counts as INT8 when both of its matrix inputs are read through DequantizeLinear.
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
    return rows
