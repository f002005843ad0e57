"""Shared helpers for QDQ models: find Q/DQ pairs by the tensors they quantize, measure onnxruntime fusion.

``insert_qdq`` names its nodes predictably (``<tensor>/q``, ``<tensor>/dq``); `find_qdq_pairs` does not rely on
names, it follows ``QuantizeLinear -> DequantizeLinear`` edges, so it works on any QDQ model (float fallback and
diff use it to match layers). `ort_fusion_report` saves onnxruntime's optimized graph and counts what is left:
QuantizeLinear/DequantizeLinear nodes that survived fusion, integer kernels, float compute ops.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from qgraph.graph.ops import proto_scopes

#: Integer kernels onnxruntime's CPU optimizer produces from QDQ groups.
INTEGER_OPS = frozenset(
    {
        "QLinearConv",
        "QLinearMatMul",
        "QGemm",
        "QLinearAdd",
        "QLinearMul",
        "QLinearConcat",
        "QLinearAveragePool",
        "QLinearGlobalAveragePool",
        "QLinearLeakyRelu",
        "QLinearSigmoid",
        "QLinearSoftmax",
        "QLinearWhere",
        "MatMulIntegerToFloat",
        "DynamicQuantizeMatMul",
        "MatMulInteger",
        "ConvInteger",
        "QAttention",
        "MatMulNBits",
    }
)
#: Float compute ops that, left between integer ops, are "float islands".
FLOAT_COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Add", "Mul", "Concat", "FusedConv"})


#: Domains whose QuantizeLinear/DequantizeLinear are the ONNX ones (onnxruntime's contrib ops have the same form).
QDQ_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft"})


def is_quantize(op: str, domain: str | None = "") -> bool:
    """Whether ``op`` in ``domain`` is a QuantizeLinear (the one recognizer every module uses)."""
    return op == "QuantizeLinear" and (domain or "") in QDQ_DOMAINS


def is_dequantize(op: str, domain: str | None = "") -> bool:
    """Whether ``op`` in ``domain`` is a DequantizeLinear."""
    return op == "DequantizeLinear" and (domain or "") in QDQ_DOMAINS


def has_qdq(model: onnx.ModelProto) -> bool:
    """Whether ``model`` holds a QuantizeLinear/DequantizeLinear anywhere (top graph and If/Loop bodies)."""
    return any(is_quantize(n.op_type, n.domain) or is_dequantize(n.op_type, n.domain)
               for g in proto_scopes(model.graph) for n in g.node)


def has_quantization(model: onnx.ModelProto) -> bool:
    """Whether ``model`` is quantized at all: Q/DQ (`has_qdq`), integer ops (`INTEGER_OPS`) or run-time
    ``DynamicQuantizeLinear``, anywhere."""
    return has_qdq(model) or any(n.op_type in INTEGER_OPS or n.op_type == "DynamicQuantizeLinear"
                                 for g in proto_scopes(model.graph) for n in g.node)


@dataclass(frozen=True)
class QDQPair:
    """A ``QuantizeLinear -> DequantizeLinear`` pair on float tensor ``tensor`` (``dq_output`` is its DQ twin)."""

    tensor: str
    q_node: str
    dq_node: str
    dq_output: str
    scale: np.ndarray | None
    zero_point: np.ndarray | None


def find_qdq_pairs(model: onnx.ModelProto) -> list[QDQPair]:
    """Every Q -> DQ pair of the top graph, in node order (O(N))."""
    inits = {t.name: t for t in model.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def value(name: str) -> np.ndarray | None:
        t = inits.get(name)
        return numpy_helper.to_array(t) if t is not None else None

    pairs = []
    for q in model.graph.node:
        if not is_quantize(q.op_type, q.domain):
            continue
        for dq in consumers.get(q.output[0], []):
            if is_dequantize(dq.op_type, dq.domain):
                scale = value(q.input[1]) if len(q.input) > 1 else None
                zp = value(q.input[2]) if len(q.input) > 2 and q.input[2] else None
                pairs.append(QDQPair(q.input[0], q.name, dq.name, dq.output[0], scale, zp))
    return pairs


@dataclass
class FusionReport:
    """What is left after onnxruntime's graph optimizer ran on a QDQ model."""

    ops: Counter[str] = field(default_factory=Counter)

    @property
    def quantize(self) -> int:
        """Remaining QuantizeLinear nodes (DynamicQuantizeLinear not counted)."""
        return self.ops["QuantizeLinear"]

    @property
    def dequantize(self) -> int:
        """Remaining DequantizeLinear nodes."""
        return self.ops["DequantizeLinear"]

    @property
    def integer(self) -> dict[str, int]:
        """Fused integer kernels by op type."""
        return {op: c for op, c in sorted(self.ops.items()) if op in INTEGER_OPS}

    @property
    def float_compute(self) -> dict[str, int]:
        """Float Conv/MatMul/Gemm/Add/Mul/Concat left (islands when the model is meant to be integer)."""
        return {op: c for op, c in sorted(self.ops.items()) if op in FLOAT_COMPUTE_OPS}


def ort_fusion_report(model: onnx.ModelProto | str | Path, level: str = "extended") -> FusionReport:
    """Load ``model`` in onnxruntime (CPU) at ``level`` (``basic``, ``extended``, ``all``) and count the ops
    of the optimized graph it saves."""
    import onnxruntime as ort

    levels = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    with tempfile.TemporaryDirectory(prefix="qgraph-fusion-") as tmp:
        out = str(Path(tmp) / "optimized.onnx")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = levels[level]
        opts.optimized_model_filepath = out
        opts.log_severity_level = 3
        src = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
        ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
        optimized = onnx.load(out, load_external_data=False)
    return FusionReport(Counter(n.op_type for n in optimized.graph.node))
