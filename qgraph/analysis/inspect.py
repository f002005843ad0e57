"""Model facts and analyses for ``qgraph inspect``.

Facts: opset, IR, ops, I/O, weights, subgraphs, external data. Analyses (``result["analysis"]``):

- ``qdq_coverage``: quantizable nodes in integer / partly / float (see `qgraph.analysis.diff.qdq`);
- ``batchnorm``: BatchNormalization nodes foldable into the Conv/ConvTranspose/Gemm/MatMul before them, and why
  the others are not (found on the graph handle's producer/consumer index);
- ``opset``: ops with no definition (or a deprecated one) at the model's or a target opset, and ops whose
  definition changes between the two (what opset conversion must rewrite);
- ``target``: ops without an int8 kernel or QDQ fusion on a target preset (they run in float there);
- ``extreme_ranges``: weights (and activations, with data) whose range is non-finite, huge (masking constants)
  or dominated by outliers: ``max|x| / spread`` of at least `OUTLIER_RATIO`, where the spread is the robust
  standard deviation ``1.4826 · median|x|`` for weights and the RMS for activations (streamed, no median), so
  per-tensor int8 would spend its levels on a few values;
- ``saturation``: u8×s8 layers whose int16 pair sums can overflow on x86 without VNNI.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qgraph.analysis.diff.numeric import (
    FLOAT_TYPES,
    estimate_bytes,
    plan_chunks,
    reiterable,
    stream_tensors,
    tensor_types,
)
from qgraph.analysis.diff.protos import ModelIndex
from qgraph.analysis.diff.qdq import qdq_coverage, saturation_risks
from qgraph.data import Feed
from qgraph.errors import QGraphError, RecipeError
from qgraph.graph import GraphHandle, check_model, proto_node_names
from qgraph.graph.ops import is_default_domain
from qgraph.graph.opsets import model_opset
from qgraph.io.model_io import external_data_files, load_model
from qgraph.quant.qdq import is_qdq

#: Ops with an int8 kernel or a QDQ fusion, and data-movement ops that pass int8 through, per runtime family.
#: A conservative approximation for planning; anything else runs in float between DequantizeLinear/QuantizeLinear.
_ORT_INT8 = frozenset({
    "Conv", "ConvTranspose", "MatMul", "Gemm", "Add", "Mul", "Concat", "AveragePool", "GlobalAveragePool",
    "Sigmoid", "LeakyRelu", "Softmax", "Where", "ReduceMean", "ArgMax",
    "MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Resize", "Gather", "Split", "Slice",
    "Pad", "DepthToSpace", "SpaceToDepth", "Expand", "Tile", "Identity", "Relu", "Clip",
})
_TRT_INT8 = frozenset({
    "Conv", "ConvTranspose", "MatMul", "Gemm", "Add", "Mul", "Sub", "AveragePool", "GlobalAveragePool", "MaxPool",
    "Concat", "Relu", "Clip", "LeakyRelu", "Sigmoid", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze",
    "Slice", "Resize", "Pad", "Identity",
})
TARGET_INT8_OPS: dict[str, frozenset[str]] = {
    "ort-x86-vnni": _ORT_INT8,
    "ort-x86-avx2": _ORT_INT8,
    "ort-arm": _ORT_INT8,
    "tensorrt": _TRT_INT8,
}
#: Ops that never decide where a model runs (Q/DQ nodes are left out of the count by `is_qdq`, any domain).
_IGNORED_FOR_TARGET = frozenset({"Constant", "Shape"})
#: Thresholds of the extreme-range analysis.
HUGE_VALUE = 1e4
OUTLIER_RATIO = 50.0
_MIN_OUTLIER_SIZE = 256


def _value_info(vi: onnx.ValueInfoProto) -> dict[str, Any]:
    tt = vi.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_string(tt.elem_type) if tt.elem_type else "?"
    shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
    return {"name": vi.name, "dtype": dtype.removeprefix("TensorProto."), "shape": shape}


def _walk(graph: onnx.GraphProto, path: str, ops: list[str], subgraphs: list[str], names: dict[int, list[str]]) -> None:
    """Ops and subgraph paths, nodes named as everywhere else (``names``: `qgraph.graph.proto_node_names`)."""
    for node, name in zip(graph.node, names[id(graph)], strict=True):
        ops.append(node.op_type if is_default_domain(node.domain) else f"{node.domain}.{node.op_type}")
        for attr in node.attribute:
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                sub = f"{path}/{name}.{attr.name}"
                subgraphs.append(sub)
                _walk(g, sub, ops, subgraphs, names)


def inspect_model(
    path: str | Path,
    *,
    opset: int | None = None,
    target: str | None = None,
    inputs: str | os.PathLike[str] | None = None,
    samples: int = 8,
) -> dict[str, Any]:
    """A JSON-ready summary and analysis of the model at ``path`` (see module docs)."""
    model = load_model(path)  # every unreadable/missing/foreign file becomes a ModelError here
    check_model(model)
    external = sorted(external_data_files(path))
    ops: list[str] = []
    subgraphs: list[str] = []
    scopes, naming = proto_node_names(model.graph)
    _walk(scopes[0][0], "", ops, subgraphs, {id(g): names for g, names in scopes})  # `scopes` holds the wrappers
    init_names = {t.name for t in model.graph.initializer}
    init_bytes = sum(
        int(onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize) * _numel(t) for t in model.graph.initializer
    )
    feeds = None
    if inputs is not None:
        from qgraph.analysis.diff import feeds_for

        feeds = feeds_for(model, inputs, samples)
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
        # how qgraph names unnamed nodes and repeated names here (the names its reports show, recipes select)
        "node_naming": naming.notice(),
        "external_data": external,
        "metadata": {p.key: p.value for p in model.metadata_props},
        "analysis": analyze_model(model, opset=opset, target=target, feeds=feeds),
    }


def _numel(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= int(d)
    return n


# --------------------------------------------------------------------------------------------- analyses
def analyze_model(
    model: onnx.ModelProto,
    *,
    opset: int | None = None,
    target: str | None = None,
    feeds: Iterable[Feed] | None = None,
) -> dict[str, Any]:
    """Every analysis of the module docs, as a JSON-ready dict."""
    if target is not None and target not in TARGET_INT8_OPS:
        raise RecipeError(f"unknown target preset {target!r}; choose one of {', '.join(TARGET_INT8_OPS)}.")
    idx = ModelIndex.build(model)
    ops = Counter(r.op for r in idx.nodes)
    return {
        "qdq_coverage": qdq_coverage(idx).to_dict(),
        "batchnorm": foldable_batchnorms(GraphHandle(model)),
        "opset": opset_support(model, ops, opset),
        "target": target_support(Counter(r.op for r in idx.nodes if not is_qdq(r.node.op_type, r.node.domain)),
                                 target) if target else None,
        "extreme_ranges": extreme_weights(idx) + (extreme_activations(model, feeds) if feeds is not None else []),
        # int16 saturation is a property of x86 u8xs8 kernels without VNNI only: not asked for other targets.
        "saturation": [r.to_dict() for r in saturation_risks(idx)] if target in (None, "ort-x86-avx2") else None,
    }


_BN_HOSTS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def foldable_batchnorms(handle: GraphHandle) -> dict[str, Any]:
    """BatchNormalization nodes that can fold into their producer, and the reason for each that cannot."""
    idx = handle.index
    foldable: list[str] = []
    blocked: list[dict[str, str]] = []
    for node in idx.nodes:
        if node.op != "BatchNormalization" or not is_default_domain(node.domain):
            continue
        reason = ""
        x = node.inputs[0]
        prod = idx.producer.get(x.name)
        if node.attrs.get("training_mode", 0):
            reason = "training_mode=1"
        elif any(handle.constant_value(t) is None for t in node.inputs[1:5]):
            reason = "scale/bias/mean/var are not constants"
        elif prod is None:
            reason = f"input {x.name!r} is a graph input"
        elif prod.op not in _BN_HOSTS:
            reason = f"follows {prod.op} ({prod.name}); folds only into {'/'.join(_BN_HOSTS)}"
        elif len(prod.inputs) < 2 or handle.constant_value(prod.inputs[1]) is None:
            reason = f"{prod.op} {prod.name!r} has a non-constant weight"
        elif len(idx.consumers.get(x.name, [])) != 1 or x.name in idx.graph_outputs:
            reason = f"{prod.op} output {x.name!r} is also used elsewhere"
        if reason:
            blocked.append({"node": node.name, "reason": reason})
        else:
            foldable.append(node.name)
    return {"total": len(foldable) + len(blocked), "foldable": len(foldable), "foldable_nodes": foldable,
            "not_foldable": blocked}


def opset_support(model: onnx.ModelProto, ops: Counter[str], target_opset: int | None = None) -> dict[str, Any]:
    """Ops undefined or deprecated at the model's opset and at ``target_opset``, and definition changes."""
    current = model_opset(model, 0)
    wanted = target_opset or current
    unsupported: list[dict[str, Any]] = []
    changes: list[dict[str, Any]] = []
    custom = sorted(op for op in ops if "." in op)
    for op in sorted(op for op in ops if "." not in op):
        here = _schema(op, current)
        there = _schema(op, wanted)
        if there is None:
            unsupported.append({"op": op, "count": ops[op], "reason": f"not defined at opset {wanted}"})
        elif there.deprecated:
            unsupported.append({"op": op, "count": ops[op],
                                "reason": f"deprecated since opset {there.since_version}"})
        elif here is not None and here.since_version != there.since_version:
            changes.append({"op": op, "count": ops[op], "from": here.since_version, "to": there.since_version})
    blockers = conversion_blockers(model, wanted) if wanted != current else []
    return {"model_opset": current, "target_opset": wanted, "unsupported": unsupported,
            "blockers": blockers, "version_changes": changes, "custom_domain_ops": custom}


def conversion_blockers(model: onnx.ModelProto, opset: int) -> list[str]:
    """The nodes that stop ``model`` from being rewritten for ``opset`` with the same results (empty when it
    converts), found by running the registered lower_opset/raise_opset pass on a copy."""
    from qgraph.pipeline.pass_api import PassContext, get_pass

    current = model_opset(model, opset)
    step = get_pass("lower_opset" if opset < current else "raise_opset")(opset=opset)
    try:
        step.run(GraphHandle(model), PassContext())
    except QGraphError as exc:
        lines = [ln.strip()[2:] for ln in exc.message.splitlines() if ln.strip().startswith("- ")]
        return lines or [exc.message]
    return []


def _schema(op: str, version: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op, version, "")
    except onnx.defs.SchemaError:
        return None


def target_support(ops: Counter[str], target: str) -> dict[str, Any]:
    """Ops of the model that run in float on ``target`` (no int8 kernel, no QDQ fusion)."""
    supported = TARGET_INT8_OPS[target]
    floats = {op: n for op, n in sorted(ops.items()) if op not in supported and op not in _IGNORED_FOR_TARGET}
    return {"target": target, "float_ops": floats, "float_nodes": sum(floats.values()),
            "int8_capable_nodes": sum(n for op, n in ops.items() if op in supported)}


def _range_entry(name: str, kind: str, lo: float, hi: float, spread: float, size: int, finite: bool) -> dict[str, Any]:
    absmax = max(abs(lo), abs(hi))
    ratio = absmax / spread if spread > 0 else 0.0
    reason = ""
    if not finite:
        reason = "non-finite values"
    elif absmax >= HUGE_VALUE:
        reason = f"|x| up to {absmax:.3g} (masking constant or overflow?)"
    elif size >= _MIN_OUTLIER_SIZE and ratio >= OUTLIER_RATIO:
        reason = f"outlier-dominated: max|x| is {ratio:.0f}x the typical magnitude"
    return {"tensor": name, "kind": kind, "min": lo, "max": hi, "spread": spread, "ratio": ratio, "size": size,
            "reason": reason}


def extreme_weights(idx: ModelIndex) -> list[dict[str, Any]]:
    """Float constants (initializers, Constant nodes) with extreme ranges, worst ratio first."""
    names = list(idx.initializers) + [t for r in idx.nodes if r.node.op_type == "Constant" for t in r.node.output]
    out: list[dict[str, Any]] = []
    for name in names:
        if idx.elem_type(name) not in FLOAT_TYPES:
            continue
        w = idx.constant(name)
        if w is None or w.size == 0:
            continue
        w64 = w.astype(np.float64)
        finite = bool(np.isfinite(w64).all())
        vals = w64[np.isfinite(w64)] if not finite else w64
        if vals.size == 0:
            out.append(_range_entry(name, "weight", math.nan, math.nan, 0.0, int(w.size), False))
            continue
        spread = 1.4826 * float(np.median(np.abs(vals))) or float(np.sqrt(np.mean(vals * vals)))  # sparse: RMS
        e = _range_entry(name, "weight", float(vals.min()), float(vals.max()), spread, int(w.size), finite)
        if e["reason"]:
            out.append(e)
    return sorted(out, key=lambda e: -e["ratio"])


def extreme_activations(
    model: onnx.ModelProto, feeds: Iterable[Feed], *, max_bytes: int = 256 << 20
) -> list[dict[str, Any]]:
    """Float activations with extreme ranges on ``feeds`` (streamed per chunk of tensors, O(1) per tensor)."""
    idx = ModelIndex.build(model)
    types = tensor_types(model)
    names = [t for r in idx.nodes if not r.scope and r.node.op_type != "Constant" for t in r.node.output
             if t and (types.get(t) is None or types[t][0] in FLOAT_TYPES)]
    names = list(dict.fromkeys(names))
    feeds = reiterable(feeds)
    chunks = [[names[i] for i in c] for c in plan_chunks([estimate_bytes(types.get(n), 1) for n in names], max_bytes)]
    stats: dict[str, list[float]] = {}  # name -> [min, max, sum_sq, count, nonfinite]
    for _, values in stream_tensors(model, chunks, feeds):
        for name, v in values.items():
            if v.dtype.kind != "f" or v.size == 0:
                continue
            v64 = v.astype(np.float64)
            good = np.isfinite(v64)
            s = stats.setdefault(name, [math.inf, -math.inf, 0.0, 0.0, 0.0])
            vals = v64[good]
            if vals.size:
                s[0], s[1] = min(s[0], float(vals.min())), max(s[1], float(vals.max()))
                s[2] += float(np.sum(vals * vals))
            s[3] += v.size
            s[4] += float(v.size - int(good.sum()))
        del values
    out = []
    for name, (lo, hi, sq, count, bad) in stats.items():
        if math.isinf(lo):
            lo = hi = math.nan
        e = _range_entry(name, "activation", lo, hi, math.sqrt(sq / count) if count else 0.0, int(count), bad == 0)
        if e["reason"]:
            out.append(e)
    return sorted(out, key=lambda e: -e["ratio"])
