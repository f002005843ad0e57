"""The subgraphs that add AVX2's int16 pair saturation to a layer computed exactly (see `qgraph.runtime.kernels.pairs`).

For a layer ``Y = A · W`` on raw activation codes ``a`` and weight codes ``w``, the AVX2 kernels compute
``Σ_i sat16(p_i)`` where ``p_i = a_{2i} w_{2i} + a_{2i+1} w_{2i+1}``, so the saturated result is the exact one plus

    corr_n = Σ_{risky pairs i of channel n} (sat16(p_i) - p_i)

and only the pairs `qgraph.runtime.kernels.pairs.risky_pairs` lists can contribute. The subgraph gathers those pairs'
codes (``Gather`` on K; a convolution's codes are first unfolded channels-last, per kernel offset the channels its
risky pairs read and one strided ``Slice`` over the input padded with the zero point), forms ``p``, takes
``Clip(p) - p`` (exact in float32: |p| <= 65280), sums it per output channel with one ``CumSum`` in float64 over
the channel-sorted pairs (differences at segment ends; exact) and adds ``corr`` to the layer's output: scaled by
``s_a · s_w[n]`` (and Gemm's alpha) for a float output, as int32 for an integer accumulator. Cost:
O(rows · risky pairs), nothing for a layer without them.

Two scalar outputs per layer count the pair sums that saturated and the risky pair sums computed, so a measurement
can say how often each layer saturated on the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qgraph.graph import free_name

from .pairs import INT16_MAX, INT16_MIN, RiskyPairs

#: Lowest default-domain opset the correction subgraphs are written for (Clip bounds, CumSum and Pad as inputs).
MIN_OPSET = 11
_INT64_MAX = np.iinfo(np.int64).max


@dataclass
class ProtoEmitter:
    """Nodes and initializers for one GraphProto, with names free in the whole model."""

    taken: set[str]
    opset: int
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)

    def name(self, base: str) -> str:
        """``base``, or ``base_1``, ... (`qgraph.graph.free_name`): a name no node or tensor of the model has."""
        name = free_name(base, self.taken.__contains__)
        self.taken.add(name)
        return name

    def const(self, base: str, value: Any, dtype: Any = None) -> str:
        """An initializer holding ``value``; its name."""
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op: str, inputs: list[str], base: str, outputs: int = 1, **attrs: Any) -> str:
        """A node ``op(inputs)`` named after ``base``; its (first) output."""
        name = self.name(base)
        outs = [name] + [self.name(f"{base}:{i}") for i in range(1, outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, **attrs))
        return name

    def unsqueeze(self, x: str, axis: int, base: str) -> str:
        """``Unsqueeze`` (axes an attribute before opset 13, an input from it)."""
        if self.opset >= 13:
            return self.op("Unsqueeze", [x, self.const(f"{base}/axes", [axis], np.int64)], base)
        return self.op("Unsqueeze", [x], base, axes=[axis])


@dataclass(frozen=True)
class CorrectionInput:
    """What a correction reads: the activation codes, how to read them raw, and how to scale the result."""

    #: Tensor of activation codes (u8, or s8 shifted by 128 to the raw u8 the kernels multiply).
    codes: str
    signed: bool
    #: float: the layer's output is float (Q/DQ); scaled by ``act_scale`` x ``weight_scale`` (x ``alpha``).
    #: int32: an integer accumulator (MatMulInteger, ConvInteger): added as int32.
    output_kind: str
    act_scale: str | None = None
    weight_scale: np.ndarray | None = None
    alpha: float = 1.0


def _pair_terms(em: ProtoEmitter, unfolded: str, risky: RiskyPairs, index: tuple[np.ndarray, np.ndarray], axis: int,
                base: str, shape: tuple[int, ...]) -> str:
    """``Clip(p) - p`` for every risky pair, whose two codes are at ``index`` on ``axis`` of ``unfolded``."""
    g0 = em.op("Gather", [unfolded, em.const(f"{base}/k0", index[0], np.int64)], f"{base}/a0", axis=axis)
    g1 = em.op("Gather", [unfolded, em.const(f"{base}/k1", index[1], np.int64)], f"{base}/a1", axis=axis)
    w0 = em.const(f"{base}/w0", risky.w0.reshape(shape), np.float32)
    w1 = em.const(f"{base}/w1", risky.w1.reshape(shape), np.float32)
    p = em.op("Add", [em.op("Mul", [g0, w0], f"{base}/p0"), em.op("Mul", [g1, w1], f"{base}/p1")], f"{base}/pair")
    lo, hi = em.const(f"{base}/int16_min", np.float32(INT16_MIN)), em.const(f"{base}/int16_max", np.float32(INT16_MAX))
    return em.op("Sub", [em.op("Clip", [p, lo, hi], f"{base}/sat16"), p], f"{base}/clipped")


def _counters(em: ProtoEmitter, clipped: str, base: str) -> tuple[str, str]:
    """Two scalars: pair sums that saturated, and risky pair sums computed."""
    zero = em.const(f"{base}/zero", np.float32(0))
    hit = em.op("Cast", [em.op("Not", [em.op("Equal", [clipped, zero], f"{base}/exact")], f"{base}/hit")],
                f"{base}/hit_f", to=TensorProto.FLOAT)
    saturated = em.op("ReduceSum", [hit], f"{base}/saturated", keepdims=0)
    computed = em.op("Cast", [em.op("Size", [clipped], f"{base}/computed_n")], f"{base}/computed",
                     to=TensorProto.FLOAT)
    return saturated, computed


def _segment_sums(em: ProtoEmitter, clipped: str, risky: RiskyPairs, axis: int, base: str) -> str:
    """Per output channel, the sum of its pairs' ``Clip(p) - p`` (float64 CumSum, differences at segment ends)."""
    counts = np.bincount(risky.channel, minlength=risky.channels).astype(np.int64)
    ends = np.cumsum(counts)
    wide = em.op("Cast", [clipped], f"{base}/wide", to=TensorProto.DOUBLE)
    cum = em.op("CumSum", [wide, em.const(f"{base}/axis", np.int64(axis))], f"{base}/cumsum")
    first = em.op("Slice", [cum, em.const(f"{base}/s0", [0], np.int64), em.const(f"{base}/s1", [1], np.int64),
                            em.const(f"{base}/sax", [axis], np.int64)], f"{base}/first")
    zeros = em.op("Mul", [first, em.const(f"{base}/zero64", np.float64(0))], f"{base}/zeros")
    padded = em.op("Concat", [zeros, cum], f"{base}/from_zero", axis=axis)
    at_end = em.op("Gather", [padded, em.const(f"{base}/ends", ends, np.int64)], f"{base}/at_end", axis=axis)
    at_start = em.op("Gather", [padded, em.const(f"{base}/starts", ends - counts, np.int64)], f"{base}/at_start",
                     axis=axis)
    return em.op("Sub", [at_end, at_start], f"{base}/per_channel")


def _scaled(em: ProtoEmitter, sums: str, inp: CorrectionInput, channel_shape: tuple[int, ...], base: str) -> str:
    """The per-channel sums in the output's units: int32, or float times ``s_a · s_w · alpha``."""
    if inp.output_kind == "int32":
        return em.op("Cast", [sums], f"{base}/int32", to=TensorProto.INT32)
    out = em.op("Cast", [sums], f"{base}/float", to=TensorProto.FLOAT)
    if inp.act_scale is not None:
        out = em.op("Mul", [out, inp.act_scale], f"{base}/x_act_scale")
    assert inp.weight_scale is not None
    scale = (inp.weight_scale.astype(np.float64) * inp.alpha).astype(np.float32).reshape(channel_shape)
    return em.op("Mul", [out, em.const(f"{base}/weight_scale", scale)], f"{base}/correction")


def _raw_codes(em: ProtoEmitter, inp: CorrectionInput, base: str) -> str:
    """The codes as float32 the kernels multiply (s8 shifted by 128 to u8)."""
    codes = em.op("Cast", [inp.codes], f"{base}/codes", to=TensorProto.FLOAT)
    if inp.signed:
        codes = em.op("Add", [codes, em.const(f"{base}/shift", np.float32(128))], f"{base}/codes_u8")
    return codes


def matmul_correction(em: ProtoEmitter, inp: CorrectionInput, risky: RiskyPairs, base: str, count: bool = True
                      ) -> tuple[str, str, str]:
    """The correction for ``codes (..., K) · W (K, N)``: a ``(..., N)`` tensor to add to the output, and the two
    counters (empty names without ``count``)."""
    codes = _raw_codes(em, inp, base)
    clipped = _pair_terms(em, codes, risky, (risky.first, risky.first + 1), -1, base, (-1,))
    counters = _counters(em, clipped, base) if count else ("", "")
    sums = _segment_sums(em, clipped, risky, -1, base)
    return _scaled(em, sums, inp, (-1,), base), *counters


@dataclass(frozen=True)
class ConvGeometry:
    """A convolution's window: kernel, strides, dilations, explicit pads (begins then ends), groups."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[int, ...]
    group: int
    channels: int  # input channels C


def conv_correction(em: ProtoEmitter, inp: CorrectionInput, risky: RiskyPairs, geo: ConvGeometry,
                    zero_point: float, out_channels: int, output: str, base: str, count: bool = True
                    ) -> tuple[str, str, str]:
    """The correction for a convolution reading ``codes (N, C, *spatial)``: a tensor shaped like ``output``, and
    the two counters. The codes the risky pairs read are unfolded channels-last per kernel offset (padding reads
    the zero point)."""
    spatial = len(geo.kernel)
    codes = _raw_codes(em, inp, base)
    pad_value = zero_point + (128.0 if inp.signed else 0.0)
    pads = [0, 0, *geo.pads[:spatial], 0, 0, *geo.pads[spatial:]]
    padded = em.op("Pad", [codes, em.const(f"{base}/pads", pads, np.int64),
                           em.const(f"{base}/pad_value", np.float32(pad_value))], f"{base}/padded")
    per_group_in = geo.channels // geo.group
    per_group_out = out_channels // geo.group
    group_start = (risky.channel // per_group_out) * per_group_in

    def unfolded_index(k: np.ndarray) -> np.ndarray:  # a group's K position (offset, c) -> offset * C + channel
        offset, local = np.divmod(k, per_group_in)
        out: np.ndarray = offset * geo.channels + group_start + local
        return out

    wanted = (unfolded_index(risky.first), unfolded_index(risky.first + 1))
    # Only the (offset, channel) positions some risky pair reads are unfolded (YOLOv8n: 31 % of a full im2col):
    # per kernel offset, its channels gathered from the padded codes, then the offset's strided window.
    positions = np.unique(np.concatenate(wanted))
    axes = em.const(f"{base}/axes", list(range(2, 2 + spatial)), np.int64)
    steps = em.const(f"{base}/steps", list(geo.strides), np.int64)
    windows = []
    for j, off in enumerate(np.ndindex(*geo.kernel)):
        channels = positions[positions // geo.channels == j] % geo.channels
        if not channels.size:
            continue
        picked = em.op("Gather", [padded, em.const(f"{base}/channels", channels, np.int64)], f"{base}/picked",
                       axis=1)
        starts = [o * d for o, d in zip(off, geo.dilations, strict=True)]
        ends = [-((k - 1 - o) * d) or _INT64_MAX for k, o, d in zip(geo.kernel, off, geo.dilations, strict=True)]
        piece = em.op("Slice", [picked, em.const(f"{base}/start", starts, np.int64),
                                em.const(f"{base}/end", ends, np.int64), axes, steps], f"{base}/window")
        windows.append(em.op("Reshape", [piece, em.const(f"{base}/flat", [0, int(channels.size), -1], np.int64)],
                             f"{base}/offset"))
    unfolded = em.op("Concat", windows, f"{base}/unfolded", axis=1) if len(windows) > 1 else windows[0]
    # the positions in offset-then-channel order, as concatenated: each wanted position's place among them
    index = (np.searchsorted(positions, wanted[0]), np.searchsorted(positions, wanted[1]))
    clipped = _pair_terms(em, unfolded, risky, index, 1, base, (-1, 1))
    counters = _counters(em, clipped, base) if count else ("", "")
    sums = _segment_sums(em, clipped, risky, 1, base)
    flat = _scaled(em, sums, inp, (-1, 1), base)
    shaped = em.op("Reshape", [flat, em.op("Shape", [output], f"{base}/out_shape")], f"{base}/shaped")
    return shaped, *counters
