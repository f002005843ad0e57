"""QDQ structure: which quantizable nodes run in integer, which stayed float (and why), saturation risk.

QDQ is detected structurally, whatever the node names: an input produced by ``DequantizeLinear`` is a
quantized input. A quantizable node is *int8* when every input that carries data (activations and weights,
not biases) is quantized, *partial* when only some are, *float* otherwise. Integer ops written directly
(``QLinearConv``, ``MatMulInteger``, ``com.microsoft.QGemm``...) count as int8.

Saturation (x86 without VNNI, u8 activations × s8 weights): ``VPMADDUBSW`` multiplies adjacent pairs along
the reduction axis and adds each pair into a saturating int16, so ``a0·w0 + a1·w1`` must stay in
``[-32768, 32767]`` for all activation codes ``a0, a1 ∈ [qmin, qmax]``. The worst case of a weight pair is
``qmax·(max(w0,0) + max(w1,0))`` above and ``qmax·(min(w0,0) + min(w1,0))`` below (``qmin = 0`` for uint8).
With 7-bit weights (``reduce_range``: codes in [-64, 63]) no pair can overflow: ``255·128 = 32640``. Pairs
follow the kernel's reduction order: K of MatMul/Gemm, (kh, kw, c) for Conv. This reads any QDQ model; the
``insert_qdq`` pass reports the same risk from its calibrated ranges when it quantizes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from qgraph.analysis.diff.protos import ModelIndex, NodeRef, dtype_name
from qgraph.graph.ops import is_default_domain
from qgraph.quant.math import QuantDtype, dtype_range
from qgraph.quant.qdq import is_dequantize, is_quantize

#: Ops with an integer kernel or QDQ fusion in common runtimes, and which inputs carry data (None: all).
QUANTIZABLE_INPUTS: dict[str, tuple[int, ...] | None] = {
    "Conv": (0, 1),
    "ConvTranspose": (0, 1),
    "Gemm": (0, 1),
    "MatMul": (0, 1),
    "Add": None,
    "Mul": None,
    "Concat": None,
    "AveragePool": (0,),
    "GlobalAveragePool": (0,),
    "Sigmoid": (0,),
    "LeakyRelu": (0,),
    "Softmax": (0,),
    "Where": (1, 2),
    "ReduceMean": (0,),
}

#: Integer ops (operator-oriented or dynamic quantization formats): already running in integer.
INTEGER_OPS = frozenset(
    {
        "QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "com.microsoft.QGemm",
        "com.microsoft.QLinearAdd", "com.microsoft.QLinearMul", "com.microsoft.QLinearConcat",
        "com.microsoft.QLinearAveragePool", "com.microsoft.QLinearGlobalAveragePool",
        "com.microsoft.QLinearSigmoid", "com.microsoft.QLinearLeakyRelu", "com.microsoft.QLinearSoftmax",
        "com.microsoft.QLinearWhere", "com.microsoft.QLinearReduceMean", "com.microsoft.QLinearConvTranspose",
        "com.microsoft.DynamicQuantizeMatMul", "com.microsoft.MatMulIntegerToFloat", "com.microsoft.QAttention",
    }
)

_INT16_MIN, _INT16_MAX = dtype_range(QuantDtype.INT16)


@dataclass
class NodeQuant:
    """Quantization status of one quantizable node."""

    node: str
    op: str
    status: str  # "int8" | "partial" | "float"
    dtypes: str = ""  # e.g. "uint8×int8" for the quantized inputs
    reason: str = ""  # why the node stayed (partly) float, when known


@dataclass
class QdqCoverage:
    """Quantizable nodes of a model and how many of them run in integer."""

    nodes: list[NodeQuant] = field(default_factory=list)
    quantize_nodes: int = 0
    dequantize_nodes: int = 0

    def counts(self) -> Counter[str]:
        """Nodes per status."""
        return Counter(n.status for n in self.nodes)

    def by_op(self) -> dict[str, dict[str, int]]:
        """``{op: {"int8": n, "partial": n, "float": n}}`` sorted by op."""
        out: dict[str, dict[str, int]] = {}
        for n in self.nodes:
            out.setdefault(n.op, {"int8": 0, "partial": 0, "float": 0})[n.status] += 1
        return dict(sorted(out.items()))

    @property
    def fraction(self) -> float:
        """Share of quantizable nodes fully in integer (0 when there are none)."""
        return self.counts()["int8"] / len(self.nodes) if self.nodes else 0.0

    @property
    def wide(self) -> list[NodeQuant]:
        """Integer nodes reading a 16-bit activation (mixed precision, e.g. ``float_fallback`` ``to: a16w8``)."""
        return [n for n in self.nodes if n.status == "int8" and "16" in n.dtypes]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "quantizable": len(self.nodes),
            "counts": dict(sorted(self.counts().items())),
            "sixteen_bit_activations": len(self.wide),
            "fraction_int8": self.fraction,
            "quantize_nodes": self.quantize_nodes,
            "dequantize_nodes": self.dequantize_nodes,
            "by_op": self.by_op(),
            "nodes": [asdict(n) for n in self.nodes],
        }


def _dq_dtype(idx: ModelIndex, dq: NodeRef) -> str:
    """Integer dtype a DequantizeLinear reads: from its zero point, its constant input or the feeding Q."""
    inputs = list(dq.node.input)
    for name in ([inputs[2]] if len(inputs) > 2 and inputs[2] else []) + [inputs[0]]:
        elem = idx.elem_type(name)
        if elem is not None:
            return dtype_name(elem)
    q = idx.producer.get(inputs[0])
    if q is not None and is_quantize(q.node.op_type, q.node.domain):
        qin = list(q.node.input)
        if len(qin) > 2 and qin[2]:
            elem = idx.elem_type(qin[2])
            if elem is not None:
                return dtype_name(elem)
        for attr in q.node.attribute:
            if attr.name == "output_dtype" and attr.i:
                return dtype_name(attr.i)
        return "uint8"
    return "?"


def qdq_coverage(model_or_index: Any, reasons: Mapping[str, str] | None = None) -> QdqCoverage:
    """Classify every quantizable node of a model (``ModelProto`` or `ModelIndex`).

    ``reasons`` maps node names to why a pass left them float (e.g. from ``PassResult.skipped``).
    """
    idx = model_or_index if isinstance(model_or_index, ModelIndex) else ModelIndex.build(model_or_index)
    reasons = reasons or {}
    # com.microsoft Q/DQ count too (onnxruntime's 16-bit pairs below opset 21)
    cov = QdqCoverage(quantize_nodes=sum(is_quantize(r.node.op_type, r.node.domain) for r in idx.nodes),
                      dequantize_nodes=sum(is_dequantize(r.node.op_type, r.node.domain) for r in idx.nodes))
    for ref in idx.nodes:
        op = ref.op
        if op in INTEGER_OPS:
            cov.nodes.append(NodeQuant(ref.key, op, "int8", "integer op"))
            continue
        if op not in QUANTIZABLE_INPUTS:
            continue
        wanted = QUANTIZABLE_INPUTS[op]
        names = list(ref.node.input)
        positions = [i for i in (wanted if wanted is not None else range(len(names))) if i < len(names)]
        data = [names[i] for i in positions if names[i]]
        dtypes: list[str] = []
        plain: list[str] = []
        for t in data:
            prod = idx.producer.get(t)
            if prod is not None and is_dequantize(prod.node.op_type, prod.node.domain):
                dtypes.append(_dq_dtype(idx, prod))
            else:
                plain.append(t)
        status = "float" if not dtypes else ("partial" if plain else "int8")
        reason = ""
        if status != "int8":
            name = ref.name
            if name in reasons:
                reason = reasons[name]
            elif not cov.dequantize_nodes:
                reason = "no QDQ in the model"
            else:
                reason = "not quantized: " + ", ".join(plain[:3]) + (" ..." if len(plain) > 3 else "")
        cov.nodes.append(NodeQuant(ref.key, op, status, "×".join(dtypes), reason))
    return cov


@dataclass
class SaturationRisk:
    """A u8×s8 layer whose int16 pair sums can overflow (see module docs)."""

    node: str
    op: str
    weight: str
    activation_dtype: str
    weight_dtype: str
    pairs: int
    overflowing_pairs: int
    worst_pair_sum: int  # the pair sum farthest outside the int16 range (signed)
    max_weight_code: int

    @property
    def fraction(self) -> float:
        """Share of weight pairs that can overflow."""
        return self.overflowing_pairs / self.pairs if self.pairs else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {**asdict(self), "fraction": self.fraction}


def _reduction_rows(op: str, w: np.ndarray, trans_b: bool) -> np.ndarray | None:
    """Weights as ``[outputs, K]`` rows whose adjacent elements are the pairs a u8s8 kernel sums."""
    if op == "Conv" and w.ndim >= 3:  # onnxruntime runs u8 convolutions channels-last: K = (kh, kw, c)
        return np.moveaxis(w, 1, -1).reshape(w.shape[0], -1)
    if op == "Gemm" and w.ndim == 2:
        return w if trans_b else w.T
    if op == "MatMul" and w.ndim >= 2:
        return np.moveaxis(w, -2, -1).reshape(-1, w.shape[-2])
    return None


def saturation_risks(model_or_index: Any) -> list[SaturationRisk]:
    """Layers with u8 activations and s8 constant weights whose int16 pair sums can overflow.

    Only Conv, Gemm and MatMul in QDQ form are analysed (their weights are read from the constant input
    of the weight's DequantizeLinear). Sorted worst first (most overflowing pairs).
    """
    idx = model_or_index if isinstance(model_or_index, ModelIndex) else ModelIndex.build(model_or_index)
    risks: list[SaturationRisk] = []
    for ref in idx.nodes:
        op = ref.node.op_type
        if op not in ("Conv", "Gemm", "MatMul") or len(ref.node.input) < 2 or not is_default_domain(ref.node.domain):
            continue
        act, wdq = (idx.producer.get(t) for t in ref.node.input[:2])
        if act is None or wdq is None or not all(is_dequantize(n.node.op_type, n.node.domain) for n in (act, wdq)):
            continue
        a_dtype, w_dtype = _dq_dtype(idx, act), _dq_dtype(idx, wdq)
        if a_dtype != "uint8" or w_dtype != "int8":
            continue
        codes = idx.constant(wdq.node.input[0])
        if codes is None:
            continue
        trans_b = any(a.name == "transB" and a.i for a in ref.node.attribute)
        rows = _reduction_rows(op, codes.astype(np.int64), trans_b)
        if rows is None:
            continue
        if rows.shape[1] % 2:
            rows = np.pad(rows, ((0, 0), (0, 1)))
        w0, w1 = rows[:, 0::2], rows[:, 1::2]
        qmax = dtype_range(QuantDtype.UINT8)[1]  # the raw activation codes (checked uint8 above)
        high = qmax * (np.maximum(w0, 0) + np.maximum(w1, 0))
        low = qmax * (np.minimum(w0, 0) + np.minimum(w1, 0))
        over = (high > _INT16_MAX) | (low < _INT16_MIN)
        n_over = int(over.sum())
        if not n_over:
            continue
        hi, lo = int(high.max()), int(low.min())
        worst = hi if hi - _INT16_MAX >= _INT16_MIN - lo else lo
        risks.append(
            SaturationRisk(
                node=ref.key,
                op=op,
                weight=wdq.node.input[0],
                activation_dtype=a_dtype,
                weight_dtype=w_dtype,
                pairs=int(over.size),
                overflowing_pairs=n_over,
                worst_pair_sum=worst,
                max_weight_code=int(np.abs(rows).max()),
            )
        )
    risks.sort(key=lambda r: (-r.overflowing_pairs, r.node))
    return risks
