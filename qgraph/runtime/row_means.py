"""The mean input *row* of weighted layers on calibration data, reduced inside onnxruntime (bias correction).

A layer ``y = W x + b`` (Conv, Gemm, MatMul) is linear in its input, so the mean over every output position of
``(W' - W) x`` is ``(W' - W)`` times the mean row of ``x``: for a matrix product the mean input row, for a Conv
the mean receptive field (im2col row, ``C_in x kernel`` values, laid out like the weight's ``(C_in, *kernel)``).
Bias correction needs nothing else: the mean output error of a quantized layer is ``(W_float - W_q) · mean row +
(b_float - b_q)`` (`qgraph.quant.layers.QuantLayer.mean_error`), so no float copy of any layer has to run.

`row_means` measures the rows in one streamed run (`qgraph.runtime.channel_means`, sliced for long graphs):

- a matrix product's rows are its input's last axis (a Gemm with ``transA``: transposed first): the input's
  mean over every other axis;
- a Conv whose rows are its input's pixels (kernel 1, stride 1, no padding) likewise, per input channel;
- a stride-1 Conv (any kernel, dilation and pads): kernel offset ``o`` on a spatial axis reads the input's rows
  ``[a_o, size - b_o)`` at every output position (the rest of its window is padding), with ``a_o`` and ``b_o``
  fixed by the kernel, dilation and pads, whatever the size. So per axis only the total and the sums of the first
  ``max a`` and last ``max b`` rows are needed (`_edges`: one ReduceSum over the input plus slices of a few rows),
  applied axis after axis; the box sum of each offset is then the sum up to its end less the sum up to its start
  (`_from_corners`). About one pass over the input, with no copy of it;
- a strided Conv: a strided Slice of the padded input per kernel offset (``k`` offsets) gives the values that
  offset multiplies at every output position, and their per-channel means are the mean row (``k / stride^nd``
  copies of the input, each freed once its mean is taken);
- where neither can be written (SAME auto_pad, whose pads depend on the input size; opset < 13 / 11) a *row bank*
  does it: a one-hot depthwise Conv (``group = C_in``, one output channel per input channel and kernel offset, the
  layer's own geometry) copies each offset's input value to every output position (``C_in · k²`` multiply-adds
  per position; the layer itself costs ``C_out · C_in · k / group``).

Measured on DNSMOS (speechmos wheel, 9 Convs and 3 MatMuls, 16 clips of 9 s, AVX512-VNNI host, Q/DQ run in float
without graph optimizations): the rows of every layer 4.6 s, where the model alone runs in 4.0 s; strided slices
for every Conv 7.3 s, row banks 7.4 s; float twins of every layer (what bias correction ran before) 8.3 s.

The same source (tensor and geometry) read by several layers is measured once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import helper, numpy_helper

from qgraph.data import Feed
from qgraph.graph import ProtoNames
from qgraph.graph.opsets import model_opset
from qgraph.runtime.channel_means import ChannelMeans, augment

__all__ = ["RowSource", "conv_rows", "matrix_rows", "row_means"]

_STEM = "qgraph_rows"
#: Conv attributes that place the receptive fields; the bank copies them.
_GEOMETRY = ("auto_pad", "dilations", "kernel_shape", "pads", "strides")


@dataclass(frozen=True)
class RowSource:
    """Where a layer's rows come from: its input ``tensor`` with ``channels`` values per position (Conv: input
    channels; matrix: row length), the Conv's ``kernel`` and geometry attributes (none for a matrix product), and
    whether a matrix's rows are its first axis (Gemm ``transA``)."""

    tensor: str
    channels: int
    kernel: tuple[int, ...] = ()
    geometry: tuple[tuple[str, Any], ...] = ()
    transposed: bool = False

    @property
    def is_conv(self) -> bool:
        """Whether the rows are a Conv's receptive fields."""
        return bool(self.kernel)

    @property
    def width(self) -> int:
        """Values per row: ``channels x kernel size``."""
        return self.channels * int(np.prod(self.kernel, dtype=np.int64)) if self.kernel else self.channels

    @property
    def pixelwise(self) -> bool:
        """A Conv whose rows are its input's pixels: kernel 1, stride 1, no padding."""
        attrs = dict(self.geometry)
        return (self.is_conv and self.width == self.channels
                and all(int(s) == 1 for s in attrs.get("strides", ()))
                and not any(int(p) for p in attrs.get("pads", ()))
                and str(attrs.get("auto_pad", "NOTSET")) in ("NOTSET", "VALID"))


def matrix_rows(tensor: str, k: int, transposed: bool = False) -> RowSource:
    """The rows of a matrix product's input ``tensor`` of row length ``k`` (``transposed``: Gemm ``transA``)."""
    return RowSource(tensor, k, transposed=transposed)


def conv_rows(tensor: str, channels: int, kernel: Sequence[int], attrs: Mapping[str, Any]) -> RowSource:
    """The receptive fields of a Conv reading ``tensor`` (``channels`` input channels) with ``kernel`` and its
    attributes ``attrs`` (only the geometry is kept; strings may be bytes, as onnx gives them)."""
    geometry = []
    for name in _GEOMETRY:
        if name in attrs:
            value = attrs[name]
            value = value.decode() if isinstance(value, bytes) else value
            geometry.append((name, tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else value))
    return RowSource(tensor, channels, tuple(int(k) for k in kernel), tuple(geometry))


def _bank(source: RowSource, p: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """The one-hot depthwise Conv of ``source`` (module docstring): nodes, its weight, its output."""
    k = source.width // source.channels
    one_hot = np.tile(np.eye(k, dtype=np.float32), (source.channels, 1, 1))  # [c, offset, offset]
    weight = numpy_helper.from_array(one_hot.reshape(source.channels * k, 1, *source.kernel), p + "one_hot")
    attrs: dict[str, Any] = {name: list(v) if isinstance(v, tuple) else v for name, v in source.geometry}
    attrs["kernel_shape"] = list(source.kernel)
    node = helper.make_node("Conv", [source.tensor, weight.name], [p + "rows"], name=p + "bank")
    node.attribute.extend(helper.make_attribute(name, value)
                          for name, value in {**attrs, "group": source.channels}.items())
    return [node], [weight], p + "rows"


def _taps(source: RowSource, p: str, opset: int
          ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], list[str]] | None:
    """The Conv's receptive fields as strided slices of its padded input, one ``[N, C_in, *out]`` per kernel
    offset: the values that offset multiplies, with no multiply. None where the slices cannot be written (SAME
    auto_pad, opset < 11: `_bank` then)."""
    attrs = dict(source.geometry)
    if opset < 11 or str(attrs.get("auto_pad", "NOTSET")) not in ("NOTSET", "VALID"):
        return None
    nd = len(source.kernel)
    strides = list(attrs.get("strides", (1,) * nd))
    dilations = list(attrs.get("dilations", (1,) * nd))
    pads = list(attrs.get("pads", (0,) * 2 * nd)) if str(attrs.get("auto_pad", "NOTSET")) == "NOTSET" else [0] * 2 * nd
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    x = source.tensor
    if any(pads):
        inits.append(numpy_helper.from_array(np.array([0, 0, *pads[:nd], 0, 0, *pads[nd:]], np.int64), p + "pads"))
        nodes.append(helper.make_node("Pad", [x, p + "pads"], [p + "padded"], name=p + "pad"))
        x = p + "padded"
    axes = list(range(2, 2 + nd))
    inits += [numpy_helper.from_array(np.array(axes, np.int64), p + "axes"),
              numpy_helper.from_array(np.array(strides, np.int64), p + "steps")]
    sliced = []
    for i, offset in enumerate(np.ndindex(*source.kernel)):
        # offset o of a kernel k reads o·d + s·j for every output j: from o·d up to (k - 1 - o)·d before the end
        starts = [o * d for o, d in zip(offset, dilations, strict=True)]
        ends = [-(k - 1 - o) * d if o < k - 1 else np.iinfo(np.int64).max
                for o, k, d in zip(offset, source.kernel, dilations, strict=True)]
        q = f"{p}tap{i}/"
        inits += [numpy_helper.from_array(np.array(starts, np.int64), q + "starts"),
                  numpy_helper.from_array(np.array(ends, np.int64), q + "ends")]
        nodes.append(helper.make_node("Slice", [x, q + "starts", q + "ends", p + "axes", p + "steps"], [q + "x"],
                                      name=q + "slice"))
        sliced.append(q + "x")
    return nodes, inits, sliced


def _const(name: str, values: Sequence[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _edges(t: str, axis: int, rank: int, lo: list[int], hi: list[int], p: str
           ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """Along ``axis`` of ``t``: the sums over ``[0, a)`` for every ``a`` in ``lo`` and over ``[0, size - b)`` for
    every ``b`` in ``hi``, joined (``len(lo) + len(hi)`` values on that axis). Only the first ``max(lo)`` and the
    last ``max(hi)`` entries are read twice: one pass over ``t`` for its total."""
    nodes = [helper.make_node("ReduceSum", [t, p + "axis"], [p + "total"], keepdims=1)]
    inits = [_const(p + "axis", [axis])]
    head, tail = max(lo), max(hi)
    if head:  # prefix sums of the first rows: cum[a] = sum of rows [0, a) (a leading 0 by Pad)
        inits += [_const(p + "h_end", [head]), _const(p + "zero", [0]), _const(p + "lo", lo),
                  _const(p + "h_pad", [1 if i == axis else 0 for i in range(2 * rank)])]
        # an input shorter than ``head`` (an offset wholly in the padding): its prefix sums stop at the total
        nodes += [helper.make_node("Slice", [t, p + "zero", p + "h_end", p + "axis"], [p + "head"]),
                  helper.make_node("Pad", [p + "head", p + "h_pad"], [p + "head0"]),
                  helper.make_node("CumSum", [p + "head0", p + "axis"], [p + "prefix"]),
                  helper.make_node("Shape", [p + "head"], [p + "h_shape"]),
                  helper.make_node("Gather", [p + "h_shape", p + "axis"], [p + "h_rows"], axis=0),
                  helper.make_node("Min", [p + "lo", p + "h_rows"], [p + "lo_in"]),
                  helper.make_node("Gather", [p + "prefix", p + "lo_in"], [p + "low"], axis=axis)]
    else:  # every offset starts at row 0: the prefix sums are 0
        inits.append(_const(p + "lo", [0] * len(lo)))
        nodes += [helper.make_node("Sub", [p + "total", p + "total"], [p + "zeros"]),
                  helper.make_node("Gather", [p + "zeros", p + "lo"], [p + "low"], axis=axis)]
    if tail:  # suffix sums of the last rows: cum[tail - b] = sum of the last b rows (a trailing 0 by Pad)
        inits += [_const(p + "t_start", [-tail]), _const(p + "t_end", [np.iinfo(np.int64).max]),
                  _const(p + "hi", hi), _const(p + "none", [0]),
                  _const(p + "t_pad", [1 if i == rank + axis else 0 for i in range(2 * rank)])]
        # suffix[j] sums the tail's rows from j: the last b rows start at len - b (at 0 when fewer rows exist)
        nodes += [helper.make_node("Slice", [t, p + "t_start", p + "t_end", p + "axis"], [p + "tail"]),
                  helper.make_node("Pad", [p + "tail", p + "t_pad"], [p + "tail0"]),
                  helper.make_node("CumSum", [p + "tail0", p + "axis"], [p + "suffix"], reverse=1),
                  helper.make_node("Shape", [p + "tail"], [p + "t_shape"]),
                  helper.make_node("Gather", [p + "t_shape", p + "axis"], [p + "t_rows"], axis=0),
                  helper.make_node("Sub", [p + "t_rows", p + "hi"], [p + "from"]),
                  helper.make_node("Max", [p + "from", p + "none"], [p + "from_in"]),
                  helper.make_node("Gather", [p + "suffix", p + "from_in"], [p + "cut"], axis=axis),
                  helper.make_node("Sub", [p + "total", p + "cut"], [p + "high"])]
    else:
        inits.append(_const(p + "hi", [0] * len(hi)))
        nodes.append(helper.make_node("Gather", [p + "total", p + "hi"], [p + "high"], axis=axis))
    nodes.append(helper.make_node("Concat", [p + "low", p + "high"], [p + "ends"], axis=axis))
    return nodes, inits, p + "ends"


def _boxes(source: RowSource, p: str, opset: int
           ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str, str] | None:
    """A stride-1 Conv's mean row from box sums (module docstring): nodes, constants, the tensor of the boxes'
    edge sums over the output count ``[1, C_in x 2^nd x kernel]`` and its weight tensor (int64 [1]). None where
    this does not apply (a stride, SAME auto_pad, opset < 13: the slices or the bank then)."""
    attrs = dict(source.geometry)
    nd = len(source.kernel)
    auto_pad = str(attrs.get("auto_pad", "NOTSET"))
    if opset < 13 or auto_pad not in ("NOTSET", "VALID") or any(int(v) != 1 for v in attrs.get("strides", ())):
        return None
    dilations = list(attrs.get("dilations", (1,) * nd))
    pads = list(attrs.get("pads", (0,) * 2 * nd)) if auto_pad == "NOTSET" else [0] * 2 * nd
    spatial = list(range(2, 2 + nd))
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    t = source.tensor
    for i, (k, d) in enumerate(zip(source.kernel, dilations, strict=True)):
        # offset o reads input rows [a, size - b) of this axis (the rest of its window is padding)
        lo = [max(0, o * d - pads[i]) for o in range(k)]
        hi = [max(0, (k - 1 - o) * d - pads[nd + i]) for o in range(k)]
        more, consts, t = _edges(t, spatial[i], 2 + nd, lo, hi, f"{p}axis{i}/")
        nodes += more
        inits += consts
    # weight: output positions N x prod(size + pad begin + pad end - (k - 1) d), times the values per position
    width = source.channels * 2 ** nd * int(np.prod(source.kernel))
    grow = [pads[i] + pads[nd + i] - (k - 1) * d for i, (k, d) in enumerate(zip(source.kernel, dilations,
                                                                                    strict=True))]
    inits += [_const(p + "batch", [0]), _const(p + "flat", [1, -1]), _const(p + "grow", [0, *grow]),
              _const(p + "width", [width]), _const(p + "dims", [0, *spatial])]
    nodes += [helper.make_node("ReduceSum", [t, p + "batch"], [p + "summed"], keepdims=1),
              helper.make_node("Shape", [source.tensor], [p + "shape"]),
              helper.make_node("Gather", [p + "shape", p + "dims"], [p + "dims_n"], axis=0),
              helper.make_node("Add", [p + "dims_n", p + "grow"], [p + "out_dims"]),
              helper.make_node("ReduceProd", [p + "out_dims"], [p + "rows"], keepdims=1),
              helper.make_node("Mul", [p + "rows", p + "width"], [p + "count"]),
              helper.make_node("Cast", [p + "rows"], [p + "rows_f"], to=onnx.TensorProto.FLOAT),
              helper.make_node("Reshape", [p + "summed", p + "flat"], [p + "corners"]),
              helper.make_node("Div", [p + "corners", p + "rows_f"], [p + "per_row"])]
    return nodes, inits, p + "per_row", p + "count"


def _from_corners(corners: npt.NDArray[np.float64], source: RowSource) -> npt.NDArray[np.float64]:
    """The mean row ``(C_in x kernel)`` from `_boxes`' per-row edge sums: on each axis, the sum up to the end of
    each offset's rows less the sum up to their start."""
    box = corners.reshape(source.channels, *[2 * k for k in source.kernel])
    for i, k in enumerate(source.kernel):
        lo, hi = np.split(box, [k], axis=1 + i)
        box = hi - lo
    return np.ascontiguousarray(box.reshape(-1))


def row_means(model: onnx.ModelProto, sources: Sequence[RowSource], batches: Iterable[Feed],
              weights: Mapping[str, npt.NDArray[Any]] | None = None) -> list[npt.NDArray[np.float64]]:
    """The mean row ``(width,)`` of each source over every batch (module docstring): one streamed run of
    ``model`` with its helper nodes. `qgraph.errors.DataError` on NaN/Inf. ``weights``: the values of a weightless
    ``model``'s placeholders, read in place (`qgraph.runtime.channel_means.channel_means`)."""
    unique = list(dict.fromkeys(sources))
    space = ProtoNames(model).prefix(_STEM)
    after: dict[str, list[onnx.NodeProto]] = {}
    inits: list[onnx.TensorProto] = []
    tensors: dict[str, tuple[int, bool]] = {}
    measured: dict[RowSource, str] = {}
    by_offset: dict[RowSource, list[str]] = {}
    same_rows: dict[str, str] = {}
    counts: dict[str, str] = {}
    boxes: dict[RowSource, str] = {}
    opset = model_opset(model, 1)
    for i, source in enumerate(unique):
        p = f"{space}{i}/"
        if source.is_conv and not source.pixelwise:
            boxed = _boxes(source, p, opset)
            if boxed is not None:
                nodes, consts, name, count = boxed
                after.setdefault(source.tensor, []).extend(nodes)
                inits.extend(consts)
                tensors[name] = (source.width * 2 ** len(source.kernel), False)
                counts[name] = count
                boxes[source] = name
                continue
            taps = _taps(source, p, opset)
            if taps is not None:  # each offset's mean on its own (no copy joins them); all have the same rows
                nodes, consts, sliced = taps
                after.setdefault(source.tensor, []).extend(nodes)
                inits.extend(consts)
                tensors.update({t: (source.channels, True) for t in sliced})
                same_rows.update({t: sliced[0] for t in sliced[1:]})
                by_offset[source] = sliced
                continue
            nodes, consts, name = _bank(source, p)
            channel_first = True
        else:
            channel_first = source.is_conv
            want = (source.channels, channel_first)
            name = source.tensor
            consts = []
            if source.transposed:  # Gemm transA: [K, M] -> [M, K], rows on the last axis like a MatMul's
                nodes = [helper.make_node("Transpose", [name], [p + "rows"], name=p + "rows", perm=[1, 0])]
                name = p + "rows"
            elif tensors.get(name, want) != want:  # the same tensor read another way: a name of its own
                nodes = [helper.make_node("Identity", [name], [p + "rows"], name=p + "rows")]
                name = p + "rows"
            else:
                nodes = []
        after.setdefault(source.tensor, []).extend(nodes)
        inits.extend(consts)
        tensors[name] = (source.width, channel_first)
        measured[source] = name
    if any(after.values()):
        model = augment(model, after, inits, [])
    owner = {**{name: s.tensor for s, name in measured.items()}, **{name: s.tensor for s, name in boxes.items()},
             **{t: s.tensor for s, sliced in by_offset.items() for t in sliced}}
    labels = {name: f"layer input {tensor!r}" for name, tensor in owner.items()}
    means = ChannelMeans(model, tensors, weights, same_rows=same_rows, counts=counts, labels=labels)(batches)
    rows = {s: means[name] for s, name in measured.items()}
    rows.update({s: _from_corners(means[name], s) for s, name in boxes.items()})
    for s, sliced in by_offset.items():  # [offset, C_in] -> the weight's [C_in, offset]
        rows[s] = np.ascontiguousarray(np.stack([means[t] for t in sliced]).T.reshape(-1))
    return [rows[s] for s in sources]
