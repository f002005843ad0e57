"""Q/DQ recognition and pairs on protos (the one place for both), and onnxruntime's fusion report.

`is_quantize` / `is_dequantize` (and `is_qdq`) recognise the nodes with the domain check (ONNX or com.microsoft);
`pair_quantize`, `pairs_reading` and `float_behind` walk ``Q -> DQ`` pairs (`qgraph.quant.qdq_graph` has the same
on the graphsurgeon graph); the integer ranges of the codes are `qgraph.quant.math.dtype_range`.

``insert_qdq`` names its nodes predictably (``<tensor>/q``, ``<tensor>/dq``); `find_qdq_pairs` does not rely on
names, it follows ``QuantizeLinear -> DequantizeLinear`` edges, so it works on any QDQ model (float fallback and
diff use it to match layers). `ort_fusion_report` saves onnxruntime's optimized graph and counts what is left:
QuantizeLinear/DequantizeLinear nodes that survived fusion, integer kernels, float compute ops.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
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


def is_dynamic_quantize(op: str, domain: str | None = "") -> bool:
    """Whether ``op`` in ``domain`` is an ONNX ``DynamicQuantizeLinear`` (default domain only)."""
    return op == "DynamicQuantizeLinear" and (domain or "") in ("", "ai.onnx")


def is_qdq(op: str, domain: str | None = "", *, dynamic: bool = False) -> bool:
    """Whether ``op`` in ``domain`` is a QuantizeLinear or DequantizeLinear (or, with ``dynamic``, a
    DynamicQuantizeLinear): the node kinds a rewrite of compute ops leaves alone."""
    return is_quantize(op, domain) or is_dequantize(op, domain) or (dynamic and is_dynamic_quantize(op, domain))


# The pair walker on protos (`qgraph.quant.qdq_graph` has its twin on graphsurgeon graphs). ``producer`` maps a
# tensor name to the node writing it, ``consumers`` to the nodes reading it (one scope; build them once per walk).


def pair_quantize(dq: onnx.NodeProto, producer: Mapping[str, onnx.NodeProto]) -> onnx.NodeProto | None:
    """The QuantizeLinear of the pair DequantizeLinear ``dq`` closes: the producer of its input when that is a
    QuantizeLinear; None for a DQ of a constant or of an integer input (a stored weight)."""
    q = producer.get(dq.input[0]) if dq.input else None
    return q if q is not None and is_quantize(q.op_type, q.domain) else None


def pairs_reading(tensor: str, consumers: Mapping[str, Sequence[onnx.NodeProto]]
                  ) -> list[tuple[onnx.NodeProto, onnx.NodeProto]]:
    """``(Q, DQ)`` for every pair quantizing ``tensor``: a QuantizeLinear reading it as its data input, and each
    DequantizeLinear reading that Q's output, in consumer order."""
    return [(q, dq) for q in consumers.get(tensor, ()) if is_quantize(q.op_type, q.domain) and q.input[0] == tensor
            for dq in consumers.get(q.output[0], ()) if is_dequantize(dq.op_type, dq.domain)]


def float_behind(tensor: str, producer: Mapping[str, onnx.NodeProto], limit: int = 64) -> str:
    """The float tensor behind ``tensor``'s ``DQ(Q(x))`` chains (``tensor`` itself when it is not a pair's output,
    or when its DequantizeLinear reads no QuantizeLinear). ``limit`` bounds the walk on malformed chains."""
    for _ in range(limit):
        dq = producer.get(tensor)
        if dq is None or not is_dequantize(dq.op_type, dq.domain):
            return tensor
        q = pair_quantize(dq, producer)
        if q is None:
            return tensor
        tensor = q.input[0]
    return tensor


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
