"""Sliced sessions: a long graph run on fused (deployed) kernels as consecutive slices, with the same numbers.

onnxruntime's session initialization grows faster than the graph: on a quantized MatMul/Add/Relu chain
(onnxruntime 1.32, one core) 7,000 nodes take 0.43 s and 28,000 nodes 4.0 s at ``ORT_ENABLE_ALL`` (1.5 s with no
optimization at all), so a guard that builds a session on the target's kernels for a 70,000-node graph spends
~18 s on each. Cut into slices of a few thousand nodes the same graph builds in time linear in its size.

A cut gives the same numbers as the whole graph only where no rewrite of onnxruntime's can span it. onnxruntime
fuses node units (the DequantizeLinear nodes an op reads, the op, the QuantizeLinear it feeds) and float patterns
(MatMul + Add, Conv + activation, LayerNorm, ...), and it drops a QuantizeLinear -> DequantizeLinear pair that
directly follows a DequantizeLinear (Q/DQ pairs in a row). So a cut goes only where every tensor crossing it is an
integer edge: the output of a QuantizeLinear that only DequantizeLinear nodes read and whose own input is not a
DequantizeLinear's output. Layout rewrites (NHWC, NCHWc) that would have cancelled a pair of transposes across such
a cut leave both in place: data movement, the same values. With no optimization (``anywhere``) every cut is exact.
Weight DequantizeLinear nodes move next to their readers first (`qgraph.runtime.segments.sink_constants`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import numpy_helper

from qgraph.runtime.compare import session_run
from qgraph.runtime.parallel import ordered_map
from qgraph.runtime.segments import (
    SLICE_MAJOR_SAMPLES,
    has_subgraphs,
    plan_segments,
    producers_and_last_reads,
    run_slice_major,
    segment_model,
    sink_constants,
)

__all__ = ["SLICE_ABOVE", "SLICE_NODES", "SlicedSession", "exact_starts", "inferred_types", "sliced_session"]

#: Graphs over this many nodes are run in slices of about `SLICE_NODES` (where exact cuts exist).
SLICE_ABOVE = 8000
SLICE_NODES = 4000

#: ``factory(slice model, the weights its placeholders take)``: a session for one slice.
SessionFactory = Callable[[onnx.ModelProto, Mapping[str, npt.NDArray[Any]]], Any]

_QUANTIZE = "QuantizeLinear"
_DEQUANTIZE = "DequantizeLinear"


def exact_starts(model: onnx.ModelProto, size: int = SLICE_NODES, anywhere: bool = False) -> list[int]:
    """Where slices of about ``size`` nodes start (0 first) in ``model``'s node list, cut only where every tensor
    crossing the cut is an integer edge (module docstring), or anywhere with ``anywhere``. O(nodes)."""
    nodes = model.graph.node
    producer, last_read = producers_and_last_reads(nodes)
    readers_dequantize: dict[str, bool] = {}  # every reader of the tensor is a DequantizeLinear
    for node in nodes:
        dequantize = node.op_type == _DEQUANTIZE
        for t in node.input:
            if t:
                readers_dequantize[t] = readers_dequantize.get(t, True) and dequantize
    # blocked[i] > 0: some tensor that may not be cut is produced before node i and read at or after it
    blocked = np.zeros(len(nodes) + 1, np.int64)
    for t, j in producer.items():
        k = last_read.get(t, -1)
        if k <= j or anywhere or _integer_edge(t, nodes, producer, readers_dequantize):
            continue
        blocked[j + 1] += 1
        blocked[k + 1] -= 1
    open_cut = np.cumsum(blocked) == 0
    starts = [0]
    for i in range(1, len(nodes)):
        if i - starts[-1] >= size and open_cut[i]:
            starts.append(i)
    return starts


def _integer_edge(t: str, nodes: Sequence[onnx.NodeProto], producer: Mapping[str, int],
                  readers_dequantize: Mapping[str, bool]) -> bool:
    node = nodes[producer[t]]
    if node.op_type != _QUANTIZE or not readers_dequantize.get(t, False):
        return False
    source = producer.get(node.input[0])
    return source is None or nodes[source].op_type != _DEQUANTIZE


class SlicedSession:
    """``model`` run as consecutive slices (``starts``: `exact_starts`), each a session of ``factory``, built on the
    first run. A slice's inputs have their ``types`` (`inferred_types`: fusions read shapes), else the dtypes of
    the values fed. Session-like: ``run``, ``get_inputs``, ``get_outputs``; ``run_many`` runs several feeds
    slice-major (what `qgraph.runtime.compare.session_runs` uses), and a ``single_use`` session frees each slice's
    session there once every feed went through it. A value is dropped once no later slice reads it."""

    def __init__(self, model: onnx.ModelProto, factory: SessionFactory, starts: Sequence[int],
                 weights: Mapping[str, npt.NDArray[Any]] | None = None,
                 types: Mapping[str, onnx.TypeProto] | None = None, single_use: bool = False) -> None:
        self.model = model
        self.single_use = single_use
        self.types = dict(types or {})
        self.factory = factory
        self.weights = dict(weights or {})
        self.outputs = [o.name for o in model.graph.output]
        self.segments, self.last_read = plan_segments(model, self.outputs, starts=starts)
        self.initializers = {t.name: t for t in model.graph.initializer}
        self._building = threading.Lock()  # samples run at once (`session_runs`): each slice is built once

    @property
    def slices(self) -> int:
        """How many slices (sessions) the graph runs in."""
        return len(self.segments)

    def get_inputs(self) -> list[onnx.ValueInfoProto]:
        """The model's data inputs (each has a ``name``)."""
        return [i for i in self.model.graph.input if i.name not in self.initializers]

    def get_outputs(self) -> list[onnx.ValueInfoProto]:
        """The model's outputs (each has a ``name``)."""
        return list(self.model.graph.output)

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[Any]:
        """The outputs ``output_names`` (default: all) for ``input_feed``, slice by slice."""
        values: dict[str, Any] = dict(input_feed)
        wanted = set(output_names or self.outputs)
        for seg in self.segments:
            if seg.session is None:
                with self._building:
                    if seg.session is None:
                        seg.session = self._build(seg, values)
            values.update(zip(seg.outputs, session_run(seg.session, seg.outputs,
                                                       {t: values[t] for t in seg.inputs}), strict=True))
            for name in [t for t in values if t not in wanted and self.last_read.get(t, -1) < seg.end]:
                del values[name]
        return [values[n] if n in values else numpy_helper.to_array(self.initializers[n])
                for n in (output_names or self.outputs)]

    def _build(self, seg: Any, values: Mapping[str, Any]) -> Any:
        """The session of slice ``seg``, its inputs typed from ``values`` where ``types`` has no entry."""
        proto = segment_model(self.model, seg, self.initializers, values, self.types)
        return self.factory(proto, {t: self.weights[t] for t in seg.initializers if t in self.weights})

    def run_many(self, output_names: Sequence[str] | None, feeds: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
        """`run` on every feed, in order (`qgraph.runtime.compare.session_runs` calls this): up to
        `SLICE_MAJOR_SAMPLES` feeds slice-major (`run_slice_major`: the same runs, so the same values), each
        slice's session freed once used when the session is ``single_use``; more feeds one after another."""
        if len(feeds) > SLICE_MAJOR_SAMPLES:
            return list(ordered_map(lambda feed: self.run(output_names, feed), feeds))
        names = list(output_names or self.outputs)
        wanted = set(names)
        with self._building:  # the slices' sessions are built and dropped here: no `run` meanwhile
            kept = run_slice_major(self.segments, self.last_read, feeds, self._build, keep=wanted.__contains__,
                                   release=self.single_use)
        return [[v[n] if n in v else numpy_helper.to_array(self.initializers[n]) for n in names] for v in kept]


def sliced_session(model: onnx.ModelProto, factory: SessionFactory, *,
                   weights: Mapping[str, npt.NDArray[Any]] | None = None, anywhere: bool = False,
                   above: int | None = None, size: int | None = None, single_use: bool = False,
                   typed: bool | None = None) -> Any:
    """A session for ``model`` from ``factory``: one for the whole graph up to ``above`` nodes (or with subgraphs, or
    no exact cut), else a `SlicedSession` over a reordered copy (the same computation). ``weights``: the values of
    a weightless model's placeholders, handed to ``factory`` per slice. ``above`` / ``size`` default to
    `SLICE_ABOVE` / `SLICE_NODES`. ``single_use``: the caller runs its feeds once (`SlicedSession.run_many`
    frees each slice's session as soon as every feed went through it). ``typed``: the slices' inputs get the
    whole graph's inferred shapes (`inferred_types`), so that onnxruntime's fusions inside each slice read them
    (default: unless ``anywhere``, where the values' dtypes are enough for the same numbers)."""
    weights = dict(weights or {})
    if len(model.graph.node) <= (SLICE_ABOVE if above is None else above) or has_subgraphs(model):
        return factory(model, weights)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    sink_constants(copy)
    starts = exact_starts(copy, size or SLICE_NODES, anywhere)
    if len(starts) == 1:
        return factory(model, weights)
    # with no rewrite to span a cut (``anywhere``) nothing reads the shapes: the slices type inputs from the values
    typed = not anywhere if typed is None else typed
    return SlicedSession(copy, factory, starts, weights, inferred_types(copy) if typed else None, single_use)


def inferred_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every tensor's type as ONNX shape inference gives it over the whole graph (empty where inference fails: the
    slices then type their inputs from the values, without shapes)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # onnx raises several types; the types are an optimization's hint only
        return {}
    g = inferred.graph
    return {v.name: v.type for v in [*g.input, *g.value_info, *g.output] if v.type.HasField("tensor_type")}
