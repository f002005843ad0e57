"""Model-level helpers: value types from shape inference, the default-domain opset and the IR version."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from qgraph.graph import is_default_domain

from .context import iter_graphs

#: Highest IR version onnxruntime 1.31 loads.
MAX_IR = 13
#: element types that need a newer IR version than their opset alone implies
_TYPE_IR = {
    TensorProto.FLOAT8E4M3FN: 9,
    TensorProto.FLOAT8E4M3FNUZ: 9,
    TensorProto.FLOAT8E5M2: 9,
    TensorProto.FLOAT8E5M2FNUZ: 9,
    TensorProto.UINT4: 10,
    TensorProto.INT4: 10,
    TensorProto.FLOAT4E2M1: 11,
}


def opset_of(model: onnx.ModelProto) -> int:
    """The model's default-domain opset (1 when the model imports none)."""
    for imp in model.opset_import:
        if is_default_domain(imp.domain):
            return int(imp.version)
    return 1


def collect_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Name -> TypeProto of every value (all graphs), from shape inference when it succeeds."""
    inferred = model
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception:
        try:
            inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
        except Exception:
            inferred = model
    types: dict[str, onnx.TypeProto] = {}
    for g in iter_graphs(inferred.graph):
        for vi in list(g.value_info) + list(g.input) + list(g.output):
            if vi.type.WhichOneof("value") is not None:
                types.setdefault(vi.name, vi.type)
        for t in g.initializer:
            types.setdefault(t.name, helper.make_tensor_type_proto(t.data_type, list(t.dims)))
        for n in g.node:
            if n.op_type == "Constant" and n.output and n.output[0] not in types:
                for a in n.attribute:
                    if a.name == "value":
                        types[n.output[0]] = helper.make_tensor_type_proto(a.t.data_type, list(a.t.dims))
    return types


def _feature_ir(model: onnx.ModelProto) -> int:
    ir = 3
    for g in iter_graphs(model.graph):
        inputs = {i.name for i in g.input}
        for t in g.initializer:
            if t.name not in inputs:
                ir = max(ir, 4)
            ir = max(ir, _TYPE_IR.get(t.data_type, 3))
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            tt = vi.type
            kind = tt.WhichOneof("value")
            if kind in ("optional_type",):
                ir = max(ir, 8)
            if kind == "tensor_type":
                ir = max(ir, _TYPE_IR.get(tt.tensor_type.elem_type, 3))
    if len(model.functions):
        ir = max(ir, 8)
    return ir


def fix_ir_version(model: onnx.ModelProto, lowering: bool) -> None:
    """Set ``model.ir_version`` to what its opset imports and features need (never above `MAX_IR`).

    When lowering, the IR version goes down to that minimum; when raising it goes up only as far as needed.
    """
    need = max(helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True), _feature_ir(model))
    if lowering:
        model.ir_version = min(max(need, 3), MAX_IR)
    else:
        model.ir_version = min(max(need, model.ir_version if model.ir_version <= MAX_IR else need), MAX_IR)
