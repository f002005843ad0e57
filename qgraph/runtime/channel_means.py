"""Per-channel output means of many tensors on calibration data, reduced inside onnxruntime (weight correction).

`channel_means` gives each requested tensor ``y``, right after its producer (so it can be freed at once),
``ReduceMean`` over everything but the channel axis and its element count; a run returns ``C`` numbers per tensor
whatever the activation size. Means over batches are weighted by rows. `ChannelMeans` keeps the session (or the
slices' sessions of a long graph) for more runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from qgraph.data import Feed
from qgraph.errors import DataError
from qgraph.graph import ProtoNames, insert_after_producers
from qgraph.graph.detach import placeholders_as_inputs, with_weights
from qgraph.graph.opsets import model_opset
from qgraph.runtime.compare import make_session, session_runs
from qgraph.runtime.segments import observe_segmented, plan_segments, segmentable, sink_constants

__all__ = ["JOIN_EVERY", "SLICE_ABOVE", "SLICE_NODES", "ChannelMeans", "augment", "channel_means"]

#: Stem of the namespace the helper nodes live in (`qgraph.graph.ProtoNames.prefix`: ``qgraph_layer_1/`` when the
#: model already uses ``qgraph_layer/``).
_STEM = "qgraph_layer"
_NO_OPTIMIZATION = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # what `make_session` runs with
#: `channel_means` runs graphs over this many nodes slice by slice, in slices of `SLICE_NODES`. Higher than
#: calibration's threshold: a ~20k-node graph (a 1,000-layer chain with a float twin per layer, what bias correction
#: once measured) initializes no faster in 4,000-node slices (measured: 14 sessions 56 s vs 6 sessions 47 s on a
#: loaded machine) and pays a run per slice per batch.
SLICE_ABOVE = 32_000
SLICE_NODES = 16_000


def _mean_nodes(name: str, p: str, one: str, channels: int, channel_first: bool, opset: int, count: bool) -> tuple[
        list[onnx.NodeProto], list[onnx.TensorProto], tuple[str, str]]:
    """Per-channel mean (cast to double: exact) and (with ``count``) element count (as a 1-vector) of tensor
    ``name``; helper names start with ``p``, ``one`` names the shared constant ``[1]``."""
    shape = [0, channels, -1] if channel_first else [-1, channels]
    axes = [0, 2] if channel_first else [0]
    inits = [numpy_helper.from_array(np.array(shape, np.int64), p + "shape")]
    nodes = [helper.make_node("Reshape", [name, p + "shape"], [p + "flat"])]
    if opset >= 18:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), p + "axes"))
        nodes.append(helper.make_node("ReduceMean", [p + "flat", p + "axes"], [p + "mean"], keepdims=0))
    else:
        nodes.append(helper.make_node("ReduceMean", [p + "flat"], [p + "mean"], axes=axes, keepdims=0))
    nodes.append(helper.make_node("Cast", [p + "mean"], [p + "mean64"], to=onnx.TensorProto.DOUBLE))
    if not count:
        return nodes, inits, (p + "mean64", "")
    nodes.append(helper.make_node("Size", [name], [p + "size"]))
    nodes.append(helper.make_node("Reshape", [p + "size", one], [p + "size1"]))
    return nodes, inits, (p + "mean64", p + "size1")


def augment(model: onnx.ModelProto, after: dict[str, list[onnx.NodeProto]],
            inits: list[onnx.TensorProto], outputs: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` with ``after[t]`` inserted right after the producer of ``t`` and ``outputs`` declared."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    insert_after_producers(g, after)
    g.initializer.extend(inits)
    declared = {o.name for o in g.output}
    g.output.extend(helper.make_value_info(o, onnx.TypeProto()) for o in outputs if o not in declared)
    return out


def channel_means(model: onnx.ModelProto, tensors: dict[str, tuple[int, bool]], batches: Iterable[Feed],
                  weights: Mapping[str, npt.NDArray[Any]] | None = None) -> dict[str, npt.NDArray[np.float64]]:
    """Per-channel mean of each tensor over every batch: ``tensors[name] = (channels, channel_first)`` (axis 1 for
    Conv outputs, the last axis for Gemm/MatMul). One streamed run; `DataError` on NaN/Inf. ``weights``: the
    values of a weightless ``model``'s placeholders, read in place by the session
    (`qgraph.runtime.compare.make_session`). `ChannelMeans` keeps the session for more runs."""
    return ChannelMeans(model, tensors, weights)(batches) if tensors else {}


class ChannelMeans:
    """`channel_means` of one model, its session built once: each call is one streamed run over ``batches``."""

    def __init__(self, model: onnx.ModelProto, tensors: dict[str, tuple[int, bool]],
                 weights: Mapping[str, npt.NDArray[Any]] | None = None, same_rows: Mapping[str, str] | None = None,
                 counts: Mapping[str, str] | None = None, labels: Mapping[str, str] | None = None) -> None:
        # ``same_rows[t] = u``: tensor t always has as many rows (elements per channel) as u, which is counted for
        # both (the offsets of one convolution's rows): two nodes fewer per such tensor in every run.
        # ``counts[t] = c``: the graph computes t's weight (rows x channels, int64 [1]) in tensor c: t is already a
        # mean over rows that are not its elements (`qgraph.runtime.row_means`). ``labels[t]``: what a message
        # calls tensor t (a helper tensor by the model tensor it measures)
        self.labels = dict(labels or {})
        like = {t: u for t, u in (same_rows or {}).items() if t in tensors and u in tensors and u != t
                and u not in (same_rows or {})}
        opset = model_opset(model, 1)
        self.channels = [c for c, _ in tensors.values()]
        after: dict[str, list[onnx.NodeProto]] = {}
        space = ProtoNames(model).prefix(_STEM)
        one = space + "one"
        inits: list[onnx.TensorProto] = [numpy_helper.from_array(np.array([1], np.int64), one)]
        means: list[str] = []
        sizes: list[str] = []
        for k, (name, (c, first)) in enumerate(tensors.items()):
            nodes, consts, (mean_o, size_o) = _mean_nodes(name, f"{space}{k}/", one, c, first, opset,
                                                          name not in like and name not in (counts or {}))
            size_o = (counts or {}).get(name, size_o)
            after.setdefault(name, []).extend(nodes)
            inits.extend(consts)
            means.append(mean_o)
            if size_o:
                sizes.append(size_o)
        self.tensors = tensors
        counted = [t for t in tensors if t not in like]
        position = {t: k for k, t in enumerate(counted)}
        #: per tensor, the counted tensor its rows come from; and the channels of each counted tensor
        self.rows_from = np.array([position[like.get(t, t)] for t in tensors], np.intp)
        self.counted_channels = np.array([tensors[t][0] for t in counted], np.float64)
        self.run = _MeansRun(augment(model, after, inits, []), (means, sizes), (space + "means", space + "sizes"),
                             weights, self.channels)

    def __call__(self, batches: Iterable[Feed]) -> dict[str, npt.NDArray[np.float64]]:
        """Per-channel means of every tensor over ``batches`` (one streamed run)."""
        channels = self.channels
        ends = np.cumsum(channels)
        sums = np.zeros(int(ends[-1]) if channels else 0, np.float64)
        rows = np.zeros(len(channels), np.float64)
        per_channel = np.repeat(np.arange(len(channels)), channels)

        def fold(mean: npt.NDArray[Any], size: npt.NDArray[Any]) -> None:
            nonlocal sums, rows
            n = (np.asarray(size, np.float64) / self.counted_channels)[self.rows_from]
            sums += np.asarray(mean, np.float64) * n[per_channel]
            rows += n

        self.run.each(batches, fold)
        totals = dict(zip(self.tensors, np.split(sums, ends[:-1]), strict=True))
        rows_of = dict(zip(self.tensors, rows, strict=True))
        out: dict[str, npt.NDArray[np.float64]] = {}
        for name, total in totals.items():
            mean = total / max(float(rows_of[name]), 1.0)
            if not np.all(np.isfinite(mean)):
                what = self.labels.get(name, f"tensor {name!r}")
                raise DataError(f"{what} holds NaN/Inf on the calibration data: its mean cannot be corrected; fix "
                                "the model or the data.")
            out[name] = mean
        return out


class _MeansRun:
    """``use(every mean joined, every size joined)`` for every batch, in order.

    One session: two Concat nodes join them, so a run fetches two outputs whatever the number of tensors (each
    fetched output costs onnxruntime and Python ~10 us: 2 x 2,000 outputs x 32 samples on a 1,000-layer chain).
    A graph over `SLICE_ABOVE` nodes (onnxruntime's session initialization is super-linear in the node count: 10 s
    for a 3,000-layer quantized chain with a float twin per layer, ~100 s at 10,000 layers) runs slice by slice
    (`qgraph.runtime.segments`) at the same optimization level (none), each slice handing out its own means (a
    Concat would carry every mean through every later slice); they are joined here: the same values. The slices'
    sessions, built on the first run, serve every run."""

    def __init__(self, model: onnx.ModelProto, parts: tuple[list[str], list[str]], joined: tuple[str, str],
                 weights: Mapping[str, npt.NDArray[Any]] | None, channels: list[int]) -> None:
        self.parts, self.joined = parts, joined
        self.nodes = len(model.graph.node)  # before the two Concats
        weights = dict(weights or {})
        self.session: Any = None
        means, sizes = parts
        if len(model.graph.node) <= SLICE_ABOVE or not segmentable(model):
            model.graph.node.extend([helper.make_node("Concat", means, [joined[0]], axis=0),  # our own copy
                                     helper.make_node("Concat", sizes, [joined[1]], axis=0)])
            model.graph.output.extend(helper.make_value_info(o, onnx.TypeProto()) for o in joined)
            self.session = make_session(model, mem_pattern=False, weights=weights)
            return
        # slices are built from protobufs: every weight written in
        self.model = placeholders_as_inputs(with_weights(model, weights) if weights else model)
        sink_constants(self.model)
        self.groups = _join_in_groups(self.model, parts, channels)
        self.plan = plan_segments(self.model, [*self.groups.means, *self.groups.sizes], SLICE_NODES)

    def each(self, batches: Iterable[Feed], use: Callable[[npt.NDArray[Any], npt.NDArray[Any]], None]) -> None:
        if self.session is not None:
            for means, sizes in session_runs(self.session, list(self.joined), batches):
                use(means, sizes)
            return
        got: dict[tuple[str, int | None], Any] = {}  # by sample: slice-major runs hand out every sample's first

        class _Keep:
            def __init__(self, name: str) -> None:
                self.name = name

            def update(self, x: Any, sample_index: int | None = None) -> None:
                got[self.name, sample_index] = x

        groups = self.groups

        def done(index: int) -> None:
            use(np.concatenate([got.pop((o, index)) for o in groups.means])[groups.mean_order],
                np.concatenate([got.pop((o, index)) for o in groups.sizes])[groups.size_order])

        observe_segmented(self.model, {o: _Keep(o) for o in [*groups.means, *groups.sizes]},
                          batches, SLICE_NODES, optimization=_NO_OPTIMIZATION,
                          after_feed=done, plan=self.plan)


#: In a sliced run, the means (and counts) of this many tensors are joined by a Concat where the last of them is
#: computed: a slice hands out a few joined outputs, not one per tensor (~10 us each, per sample).
JOIN_EVERY = 256


@dataclass
class _Groups:
    """The joined outputs of a sliced means run, and where each tensor's values are in their concatenation."""

    means: list[str] = field(default_factory=list)
    sizes: list[str] = field(default_factory=list)
    mean_order: npt.NDArray[np.intp] = field(default_factory=lambda: np.empty(0, np.intp))
    size_order: npt.NDArray[np.intp] = field(default_factory=lambda: np.empty(0, np.intp))


def _join_in_groups(model: onnx.ModelProto, parts: tuple[list[str], list[str]], channels: list[int]) -> _Groups:
    """Concat nodes in ``model`` (in place) joining every `JOIN_EVERY` means and counts in the order the graph
    computes them, and the orders that put the joined values back in ``parts``' order (Concat is exact)."""
    means, sizes = parts
    width = dict(zip(means, channels, strict=True))
    kinds = {**{m: 0 for m in means}, **{z: 1 for z in sizes}}
    out = _Groups()
    produced: tuple[list[str], list[str]] = ([], [])
    pending: tuple[list[str], list[str]] = ([], [])
    nodes: list[onnx.NodeProto] = []

    def flush() -> None:
        for kind, names, joined in ((0, pending[0], out.means), (1, pending[1], out.sizes)):
            if names:
                joined.append(f"{names[0]}/qgraph_joined")
                nodes.append(helper.make_node("Concat", list(names), [joined[-1]], axis=0))
                produced[kind].extend(names)
                names.clear()

    for node in model.graph.node:
        nodes.append(node)
        for t in node.output:
            if t in kinds:
                pending[kinds[t]].append(t)
        if len(pending[0]) + len(pending[1]) >= JOIN_EVERY:
            flush()
    flush()
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    starts = dict(zip(produced[0], np.cumsum([0] + [width[m] for m in produced[0]])[:-1], strict=True))
    out.mean_order = np.concatenate([np.arange(starts[m], starts[m] + width[m]) for m in means]).astype(np.intp)
    position = {z: k for k, z in enumerate(produced[1])}
    out.size_order = np.array([position[z] for z in sizes], np.intp)
    return out
