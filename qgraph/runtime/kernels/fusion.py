"""Which Q/DQ layers onnxruntime's CPU optimizer fuses into integer kernels, and the constants of a model read lazily.

`fused_layers` asks onnxruntime itself: the graph its optimizer (``ORT_ENABLE_EXTENDED``) writes names each fused
kernel after the layer it replaces. `Constants` reads initializers and Constant outputs by name, in every scope.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from qgraph.graph.detach import with_weights
from qgraph.graph.ops import proto_scopes
from qgraph.quant.qdq import is_dequantize, is_quantize

#: Ops onnxruntime's CPU optimizer fuses Q/DQ layers into, whose u8 x s8 products go through the GEMM kernels.
FUSED_GEMM_OPS = frozenset({"QLinearConv", "QLinearMatMul", "MatMulIntegerToFloat", "QGemm", "DynamicQuantizeMatMul"})

#: `fused_layers` answers by the model's fusion key (`fusion_key`), a few models at most: a weight-correcting pass
#: emulates the same structure before and after changing only bias or weight codes (its fidelity guard), and each
#: answer costs an optimizing onnxruntime session (1-2 s on a 3,000-layer chain).
_FUSED: dict[str, frozenset[str]] = {}
_FUSED_KEPT = 4
#: Initializers up to this many elements enter the fusion key by value (scales, zero points, shapes, clip bounds).
_KEY_VALUE_ELEMENTS = 64


def fusion_key(model: onnx.ModelProto, weights: Mapping[str, np.ndarray] | None = None) -> str:
    """What onnxruntime's Q/DQ fusion of ``model`` can depend on: every node (name, op, domain, wiring,
    non-graph attributes), every initializer's name, type and shape, the values of every scale and zero point (per
    channel too) and of the other small ones (shapes, clip bounds), except a DequantizeLinear's data input (bias
    and weight codes: fusion only asks that they are constant). Two models with the same key fuse the same
    layers."""
    h = hashlib.sha256()
    codes: set[str] = set()
    grids: set[str] = set()
    for g in proto_scopes(model.graph):
        for n in g.node:
            h.update(repr((n.name, n.domain, n.op_type, tuple(n.input), tuple(n.output))).encode())
            for a in n.attribute:
                if a.type not in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                    h.update(a.SerializeToString())
            if is_dequantize(n.op_type, n.domain) and n.input:
                codes.add(n.input[0])
            if is_quantize(n.op_type, n.domain) or is_dequantize(n.op_type, n.domain):
                grids.update(n.input[1:])  # scales and zero points, per channel too: always by value
    for g in proto_scopes(model.graph):
        for vi in (*g.input, *g.output):
            h.update(vi.SerializeToString())
        for t in g.initializer:
            h.update(repr((t.name, t.data_type, tuple(t.dims))).encode())
            if t.name not in grids and (t.name in codes or int(np.prod(t.dims)) > _KEY_VALUE_ELEMENTS):
                continue
            if weights and t.name in weights:
                h.update(np.ascontiguousarray(weights[t.name]).tobytes())
            elif t.data_location == TensorProto.EXTERNAL:
                h.update(repr([(e.key, e.value) for e in t.external_data]).encode())
            else:
                h.update(np.ascontiguousarray(numpy_helper.to_array(t)).tobytes())
    return h.hexdigest()


def fused_layers(model: onnx.ModelProto, weights: Mapping[str, np.ndarray] | None = None) -> set[str]:
    """Names of the layers onnxruntime's CPU optimizer turns into u8/s8 GEMM-based integer kernels (every node
    must have a unique name); ``weights``: the values of a weightless model's placeholders. Remembered by
    `fusion_key` for the last few models."""
    key = fusion_key(model, weights)
    if key not in _FUSED:
        while len(_FUSED) >= _FUSED_KEPT:
            del _FUSED[next(iter(_FUSED))]
        _FUSED[key] = frozenset(_fused_layers(with_weights(model, weights) if weights else model))
    return set(_FUSED[key])


def _fused_layers(model: onnx.ModelProto) -> set[str]:
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="qgraph-fused-") as tmp:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        opts.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        opts.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        optimized = onnx.load(str(Path(tmp) / "optimized.onnx"), load_external_data=False)
    return {n.name for g in proto_scopes(optimized.graph) for n in g.node if n.op_type in FUSED_GEMM_OPS}


class Constants:
    """Initializers and Constant outputs of every scope, read lazily by name (a weightless model's placeholders
    from ``weights``)."""

    def __init__(self, model: onnx.ModelProto, weights: Mapping[str, np.ndarray] | None = None) -> None:
        self.weights = weights or {}
        self.protos: dict[str, onnx.TensorProto] = {}
        for g in proto_scopes(model.graph):
            for t in g.initializer:
                self.protos[t.name] = t
            for n in g.node:
                if n.op_type == "Constant" and n.output and n.attribute and n.attribute[0].name == "value":
                    self.protos[n.output[0]] = n.attribute[0].t
        self.cache: dict[str, np.ndarray] = {}

    def get(self, name: str) -> np.ndarray | None:
        """The value of constant ``name``, or None for anything else (an activation, a missing optional)."""
        if name in self.cache:
            return self.cache[name]
        if name in self.weights:
            return np.asarray(self.weights[name])
        t = self.protos.get(name)
        if t is None or t.data_location == TensorProto.EXTERNAL:
            return None
        value = numpy_helper.to_array(t)
        self.cache[name] = value
        return value
