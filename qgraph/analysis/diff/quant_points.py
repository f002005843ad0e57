"""The quantization points of a QDQ model and what each does to the values it quantizes.

A *quantization point* is one ``DequantizeLinear`` of the candidate model B with what feeds it: a
``QuantizeLinear`` of a float tensor (activations, or weights kept in float) or stored integer codes (weights
quantized offline). Its *float tensor* is named as in the reference model A: the Q input when A has a tensor of
that name, else the input of the matching consumer node in A (same node name, same input slot).

`PointStats` folds the float values of that tensor (A's weight, or A's activation on each evaluation sample)
into per-channel sums: values outside the representable range ``[(qmin - zp)·s, (qmax - zp)·s]`` are *clipped*;
the squared error of ``dequantize(quantize(x))`` against ``x`` is split into clipping and rounding noise; the
observed ``[min, max]`` gives the step the same zero point would need, ``needed = max(max⁺/(qmax - zp),
min⁻/(qmin - zp))``, and ``coarseness = s / needed`` (25 means the step is 25× wider than the values need).
Weights whose float values are not in A (e.g. A is the model before BatchNorm fusion) are read from their codes
alone: the fraction of codes at the limits (clipped at quantization time) and the largest code used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from qgraph.analysis.diff.flat_sides import flat_sides
from qgraph.analysis.diff.protos import ModelIndex, NodeRef
from qgraph.analysis.diff.structural import match_nodes
from qgraph.quant.math import QuantDtype, dtype_range
from qgraph.quant.qdq import is_dequantize, is_quantize

_ZP_DTYPES = {np.dtype(d.numpy_dtype).name: d for d in QuantDtype if d not in (QuantDtype.INT4, QuantDtype.UINT4)}


@dataclass
class QuantPoint:
    """One Q/DQ pair (or DQ of stored codes) of model B, located in model A."""

    tensor: str  # the float tensor it quantizes, named as in A
    node: str  # the (first) node of B that reads the dequantized value
    kind: str  # "activation" | "weight" | "bias" (int32 codes: scale = input scale × weight scale)
    dq_node: str
    q_node: str | None
    scale: np.ndarray  # float32, shape () or (C,)
    zero_point: np.ndarray  # shape () or (C,)
    dtype: QuantDtype
    axis: int | None  # channel axis when per channel
    consumers: list[tuple[str, int]] = field(default_factory=list)  # (B node, input slot) reading the DQ output
    codes: np.ndarray | None = None  # stored integer weights (offline-quantized)
    in_reference: bool = True  # whether A has the float tensor (else: codes-only analysis)
    note: str = ""
    scope: str = ""  # the If/Loop body holding the pair (``<node>.<attr>``, nested joined by "/"); "" = top graph
    path: tuple[tuple[str, str], ...] = ()  # (first output of the If/Loop, attribute) from the top graph down
    # (low, high): the side clips only where the activation reading the pair is flat (`qgraph.analysis.diff.flat_sides`)
    flat: tuple[bool, bool] = (False, False)
    quantized: str = ""  # the tensor B's QuantizeLinear reads, named as in B ("" for stored codes)

    def rescaling(self, rescaled: Mapping[str, tuple[int, np.ndarray]] | None) -> tuple[int, np.ndarray] | None:
        """How B's quantized values relate to A's ``tensor`` (`qgraph.quant.rescaling`): the record of the tensor B
        quantizes (a SmoothQuant ``x/smoothed`` that A does not have), else that of ``tensor``; None: same scale."""
        if not rescaled:
            return None
        return rescaled.get(self.quantized) or rescaled.get(self.tensor)

    @property
    def qrange(self) -> tuple[int, int]:
        """Saturation range of the integer type (runtimes clip to the full range)."""
        return dtype_range(self.dtype)

    @property
    def channels(self) -> int:
        """Number of channels (1 when per tensor)."""
        return int(self.scale.size) if self.axis is not None else 1


def _value(index: ModelIndex, name: str) -> np.ndarray | None:
    if not name:
        return None
    init = index.initializers.get(name)
    if init is not None:
        return numpy_helper.to_array(init)
    prod = index.producer.get(name)
    if prod is not None and prod.node.op_type == "Constant" and not prod.scope:
        for attr in prod.node.attribute:
            if attr.name == "value":
                return numpy_helper.to_array(attr.t)
    return None


def _attr(node: onnx.NodeProto, name: str, default: int | None) -> int | None:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _qdtype(zp: np.ndarray | None, codes: np.ndarray | None) -> QuantDtype | None:
    arr = zp if zp is not None else codes
    if arr is None:
        return QuantDtype.UINT8  # ONNX: no zero point means uint8
    return _ZP_DTYPES.get(arr.dtype.name)


def find_points(a: ModelIndex, b: ModelIndex) -> tuple[list[QuantPoint], list[str]]:
    """Every analysable quantization point of B's top graph, and notes on those that are not."""
    a_tensors = set(a.producer) | set(a.initializers) | set(a.graph_inputs)
    # Consumers are located in A by the structural matching (names first, then wiring), so renamed nodes work.
    a_of_b = {ib_ref.key: a_ref for i, a_ref in match_nodes(a, b).items() for ib_ref in (b.nodes[i],)}
    points: list[QuantPoint] = []
    notes: list[str] = []
    for ref in b.nodes:
        if ref.scope or not is_dequantize(ref.node.op_type, ref.node.domain):
            continue
        point = _point(ref, a_of_b, b, a_tensors)
        if isinstance(point, str):
            notes.append(f"{ref.key}: {point}")
        else:
            points.append(point)
    return points, notes


def _point(ref: NodeRef, a_of_b: dict[str, NodeRef], b: ModelIndex, a_tensors: set[str]) -> QuantPoint | str:
    dq = ref.node
    if _attr(dq, "block_size", 0):
        return "blocked quantization is not analysed"
    scale = _value(b, dq.input[1]) if len(dq.input) > 1 else None
    zp = _value(b, dq.input[2]) if len(dq.input) > 2 else None
    if scale is None:
        return "its scale is not a constant"
    producer = b.producer.get(dq.input[0])
    codes = None
    q_node = None
    if producer is not None and is_quantize(producer.node.op_type, producer.node.domain):
        q_node, tensor = producer.key, producer.node.input[0]
        kind = "weight" if tensor in b.initializers else "activation"
    else:
        codes = _value(b, dq.input[0])
        if codes is None:
            return "its input is neither a QuantizeLinear output nor a constant"
        tensor, kind = "", "weight"
    qdtype = _qdtype(zp, codes)
    if qdtype is None:
        return f"integer type {(zp if zp is not None else codes).dtype} is not analysed"  # type: ignore[union-attr]
    consumers = [(c.key, i) for c in b.consumers.get(dq.output[0], []) for i, t in enumerate(c.node.input)
                 if t == dq.output[0]]
    if kind == "activation" and tensor not in a_tensors and dq.output[0] in a_tensors:
        tensor = dq.output[0]  # a graph (or body) output: B renamed the float tensor and its DQ took A's name
    if not tensor or tensor not in a_tensors:
        tensor = _from_consumers(a_of_b, consumers) or tensor or dq.input[0]
    if qdtype == QuantDtype.INT32:
        kind = "bias"
    per_channel = scale.ndim == 1 and scale.size > 1
    point = QuantPoint(
        tensor=tensor, node=consumers[0][0] if consumers else ref.key, kind=kind, dq_node=ref.key, q_node=q_node,
        scale=scale.astype(np.float32), zero_point=zp if zp is not None else np.zeros_like(scale, np.uint8),
        dtype=qdtype, axis=_attr(dq, "axis", 1) if per_channel else None, consumers=consumers, codes=codes,
    )
    point.in_reference = tensor in a_tensors
    point.quantized = producer.node.input[0] if q_node is not None and producer is not None else ""
    if kind == "activation":
        point.flat = flat_sides(b, dq.output[0], point.scale, point.zero_point, point.qrange)
    return point


def _from_consumers(a_of_b: dict[str, NodeRef], consumers: list[tuple[str, int]]) -> str | None:
    """A's input at the same slot of the matching node (e.g. the float weight of a Conv)."""
    for key, slot in consumers:
        node = a_of_b.get(key)
        if node is not None and slot < len(node.node.input) and node.node.input[slot]:
            return str(node.node.input[slot])
    return None


# --------------------------------------------------------------------------------------------- statistics
def channels_first(x: np.ndarray, axis: int | None) -> np.ndarray:
    """``x`` as ``[channels, values]`` (one row when ``axis`` is None)."""
    if axis is None or x.ndim == 0:
        return x.reshape(1, -1)
    return np.moveaxis(x, axis % x.ndim, 0).reshape(x.shape[axis % x.ndim], -1)


@dataclass
class PointStats:
    """Per-channel sums over the values a point quantizes (see module docs)."""

    channels: int
    count: np.ndarray = field(init=False)
    signal: np.ndarray = field(init=False)
    rounding: np.ndarray = field(init=False)
    clipping: np.ndarray = field(init=False)
    clipped: np.ndarray = field(init=False)
    lo: np.ndarray = field(init=False)
    hi: np.ndarray = field(init=False)
    codes_only: bool = False
    max_code: np.ndarray | None = None  # codes-only: largest |code - zp| per channel
    nonfinite: int = 0
    flat_clipped: int = 0  # values beyond a flat side (`QuantPoint.flat`): exact after the activation, not counted
    ndim: int | None = None  # rank and dtype of the values seen (for probes that re-apply the pair)
    value_dtype: str = "float32"

    def __post_init__(self) -> None:
        c = self.channels
        self.count, self.signal, self.rounding = np.zeros(c), np.zeros(c), np.zeros(c)
        self.clipping, self.clipped = np.zeros(c), np.zeros(c)
        self.lo, self.hi = np.full(c, np.inf), np.full(c, -np.inf)

    def add(self, point: QuantPoint, x: np.ndarray) -> None:
        """Fold the float values ``x`` (any shape; channels along ``point.axis``)."""
        self.ndim, self.value_dtype = np.ndim(x), np.asarray(x).dtype.name
        xs = channels_first(np.asarray(x, dtype=np.float64), point.axis)
        if xs.shape[0] != self.channels:
            raise ValueError(f"{point.tensor}: {xs.shape[0]} channels on axis {point.axis}, scale has "
                             f"{self.channels}")
        finite = np.isfinite(xs)
        if not finite.all():
            self.nonfinite += int((~finite).sum())
            xs = np.where(finite, xs, 0.0)
        s = point.scale.astype(np.float64).reshape(-1, 1)
        z = point.zero_point.astype(np.float64).reshape(-1, 1)
        qmin, qmax = point.qrange
        q = np.rint(xs.astype(np.float32) / s.astype(np.float32)).astype(np.float64) + z
        below, above = q < qmin, q > qmax
        flat = (below if point.flat[0] else False) | (above if point.flat[1] else False)
        clipped = (below | above) & ~flat
        err = np.where(flat, 0.0, (np.clip(q, qmin, qmax) - z) * s - xs)  # a flat side's clip changes no code
        self.flat_clipped += int(np.count_nonzero(flat))
        sq = err * err
        self.count += xs.shape[1]
        self.signal += (xs * xs).sum(axis=1)
        self.clipping += np.where(clipped, sq, 0.0).sum(axis=1)
        self.rounding += np.where(clipped, 0.0, sq).sum(axis=1)
        self.clipped += clipped.sum(axis=1)
        if xs.shape[1]:
            self.lo = np.minimum(self.lo, xs.min(axis=1))
            self.hi = np.maximum(self.hi, xs.max(axis=1))

    def add_codes(self, point: QuantPoint, codes: np.ndarray) -> None:
        """Codes-only analysis of stored weights: their dequantized values, rounding noise ``s²/12`` per value,
        codes at the type's limits counted as clipped."""
        self.codes_only = True
        cs = channels_first(codes.astype(np.float64), point.axis)
        s = point.scale.astype(np.float64)
        z = point.zero_point.astype(np.float64).reshape(-1)
        qmin, qmax = point.qrange
        deq = (cs - z.reshape(-1, 1)) * s.reshape(-1, 1)
        self.count += cs.shape[1]
        self.signal += (deq * deq).sum(axis=1)
        # A channel whose codes all sit at the zero point stored zeros (the quantizer's scale for an all-zero
        # channel is a placeholder): it is exact, not s²/12 of noise on a zero signal (an infinite ratio).
        live = np.any(cs != z.reshape(-1, 1), axis=1)
        self.rounding += np.where(live, cs.shape[1] * np.broadcast_to(s * s / 12.0, self.channels), 0.0)
        # The largest value of a channel sits at the limit by construction (min/max ranges): count the rest.
        at_limit = ((cs <= qmin) | (cs >= qmax)).sum(axis=1)
        self.clipped += np.maximum(at_limit - 1, 0)
        self.lo = np.minimum(self.lo, deq.min(axis=1))
        self.hi = np.maximum(self.hi, deq.max(axis=1))
        self.max_code = np.abs(cs - z.reshape(-1, 1)).max(axis=1)

    # ---------------------------------------------------------------- derived numbers
    @property
    def noise(self) -> np.ndarray:
        """Squared error per channel (clipping + rounding)."""
        return np.asarray(self.clipping + self.rounding)

    def noise_ratio(self) -> float:
        """Total noise power over total signal power (inf for noise on a zero signal)."""
        n, s = float(self.noise.sum()), float(self.signal.sum())
        return n / s if s > 0 else (0.0 if n == 0 else math.inf)

    def channel_noise_ratio(self) -> np.ndarray:
        """Noise power over signal power per channel."""
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(self.signal > 0, self.noise / np.where(self.signal > 0, self.signal, 1.0),
                         np.where(self.noise > 0, np.inf, 0.0))
        return np.asarray(r)

    def clip_fraction(self, channel: int | None = None) -> float:
        """Fraction of values outside the representable range (of one channel, or all)."""
        if channel is not None:
            return float(self.clipped[channel] / self.count[channel]) if self.count[channel] else 0.0
        total = float(self.count.sum())
        return float(self.clipped.sum()) / total if total else 0.0

    def coarseness(self, point: QuantPoint) -> np.ndarray:
        """Step over the step the observed range needs with the same zero point (per channel)."""
        if self.codes_only and self.max_code is not None:
            qmin, qmax = point.qrange
            z = point.zero_point.astype(np.float64).reshape(-1)
            room = np.maximum(qmax - z, z - qmin)
            return np.asarray(np.where(self.max_code > 0, room / np.maximum(self.max_code, 1), 1.0))
        qmin, qmax = point.qrange
        z = point.zero_point.astype(np.float64).reshape(-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            up = np.where(qmax > z, np.maximum(self.hi, 0.0) / np.maximum(qmax - z, 1e-30), 0.0)
            down = np.where(qmin < z, np.minimum(self.lo, 0.0) / np.minimum(qmin - z, -1e-30), 0.0)
        needed = np.maximum(up, down)
        s = np.broadcast_to(point.scale.astype(np.float64).reshape(-1), needed.shape)
        return np.asarray(np.where(needed > 0, s / np.where(needed > 0, needed, 1.0), 1.0))

    def calibrated_range(self, point: QuantPoint) -> tuple[np.ndarray, np.ndarray]:
        """``[(qmin - zp)·s, (qmax - zp)·s]`` per channel."""
        qmin, qmax = point.qrange
        s = point.scale.astype(np.float64).reshape(-1)
        z = point.zero_point.astype(np.float64).reshape(-1)
        return (qmin - z) * s, (qmax - z) * s
