"""Shape inference once per graph change, on an export without the weights (see `GraphHandle.shapes`)."""

from __future__ import annotations

import onnx

from .detach import is_placeholder
from .ops import Inferred, Shape, proto_scopes

#: Initializers at most this large stay in the model given to shape inference (Reshape targets etc.).
_SHAPE_INFERENCE_KEEP_BYTES = 4096


def static_shapes(model: onnx.ModelProto) -> Inferred:
    """Shapes and types of every tensor of the model (all scopes) after ONNX shape inference (data propagation on).

    Runs on an export whose large initializers are turned into typed graph inputs, so inference costs
    O(nodes) and copies no weights. Returns what inference could find; never raises.
    """
    graph = model.graph
    big = [t for t in graph.initializer if _big(t)]
    if big:
        small = [t for t in graph.initializer if not _big(t)]
        for t in big:
            graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        del graph.initializer[:]
        graph.initializer.extend(small)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:
        return {}
    shapes: Inferred = {}
    for g in proto_scopes(inferred.graph):
        for info in [*g.input, *g.output, *g.value_info]:
            if not info.type.HasField("tensor_type"):
                continue
            tt = info.type.tensor_type
            shape: Shape | None = None
            if tt.HasField("shape"):
                shape = tuple(int(d.dim_value) if d.HasField("dim_value") else None for d in tt.shape.dim)
            shapes[info.name] = (shape, int(tt.elem_type))
        for init in g.initializer:
            shapes[init.name] = (tuple(int(d) for d in init.dims), int(init.data_type))
    return shapes


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """A new model with ``model``'s nodes, inputs, outputs, value_info and functions, its small initializers and its
    large ones (or placeholders, or external data) as typed graph inputs: shape inference on it costs O(nodes) and
    copies no weights; ``model`` is not changed."""
    sk = onnx.ModelProto(ir_version=model.ir_version)
    sk.opset_import.extend(model.opset_import)
    sk.functions.extend(model.functions)
    g = sk.graph
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    g.value_info.extend(model.graph.value_info)
    declared = {v.name for v in model.graph.input}
    for t in model.graph.initializer:
        if not _big(t) and t.data_location != onnx.TensorProto.EXTERNAL:
            g.initializer.append(t)
        elif t.name not in declared:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return sk


def shapes_with_inputs(model: onnx.ModelProto, dims: dict[str, tuple[int, ...]]) -> Inferred:
    """`static_shapes` of ``model`` (changed in place: pass an export) with the graph inputs named in ``dims``
    given those sizes, e.g. a calibration sample's where the model's are symbolic (``p2o.DynamicDimension.0``).
    Stored intermediate and output shapes are dropped first, so symbolic sizes recorded by an exporter do not
    shadow the sizes inference now finds."""
    for info in model.graph.input:
        if info.name in dims:
            shape = info.type.tensor_type.shape
            shape.Clear()
            for d in dims[info.name]:
                shape.dim.add().dim_value = int(d)
    del model.graph.value_info[:]
    for out in model.graph.output:
        out.type.tensor_type.ClearField("shape")
    return static_shapes(model)


def _big(t: onnx.TensorProto) -> bool:
    return _proto_bytes(t) > _SHAPE_INFERENCE_KEEP_BYTES or is_placeholder(t)


def _proto_bytes(t: onnx.TensorProto) -> int:
    return len(t.raw_data) if t.HasField("raw_data") else t.ByteSize()


