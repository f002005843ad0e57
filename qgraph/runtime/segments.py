"""Segmented runs of very large graphs: onnxruntime sessions over consecutive slices of the graph.

onnxruntime's session initialization is super-linear in the number of nodes of long graphs (a 60k-node chain
takes ~4x as long as a 30k-node one), so a single calibration session over a 100k-node model dominates the
whole pass. Above `SEGMENT_THRESHOLD` nodes the topologically sorted node list is cut into slices of
`SEGMENT_NODES`; each slice becomes a small model whose inputs are the tensors it reads from earlier slices and
whose outputs are the tensors later slices read plus the tensors being calibrated. Each sample flows through
the slices in order; a value is dropped as soon as no later slice reads it, so memory stays bounded by the
widest cut. Sessions are built on the first sample (input element types are taken from the actual values). Up to
`SLICE_MAJOR_SAMPLES` samples run slice-major: each slice's session serves every sample, several at once, and is
freed before the next one is built, so one slice's session is alive at a time (a whole long graph's sessions cost
onnxruntime ~4-5 KB per node); the same runs, so the same values.
Graphs with If/Loop/Scan nodes are not segmented (their bodies read outer-scope tensors implicitly).
:func:`qgraph.calibrate.observe` switches to this runner by itself for graphs that qualify, and so does
`qgraph.runtime.channel_means` (weight correction): with the same optimization level, a slice computes
every node exactly as the whole graph's session would.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import helper

from qgraph.errors import DataError, ModelError
from qgraph.runtime.compare import session_run
from qgraph.runtime.parallel import IN_FLIGHT_BYTES, array_bytes, ordered_map

SEGMENT_THRESHOLD = 8000
SEGMENT_NODES = 4000
#: Up to this many samples run slice-major (`run_slice_major`): every sample through one slice, whose session is
#: then freed. More stream through every slice one sample at a time, the slices' sessions all kept.
SLICE_MAJOR_SAMPLES = 64
#: Past this many bytes of values held across a cut by all samples together, slice-major runs finish the samples
#: one at a time.
SLICE_MAJOR_BYTES = IN_FLIGHT_BYTES


@dataclass
class _Segment:
    nodes: list[onnx.NodeProto]
    inputs: list[str]
    outputs: list[str]
    initializers: list[str]
    end: int = 0  # index one past the slice's last node
    session: Any = None


def segmentable(model: onnx.ModelProto) -> bool:
    """Large enough to be worth it and free of subgraphs."""
    return len(model.graph.node) > SEGMENT_THRESHOLD and not has_subgraphs(model)


def has_subgraphs(model: onnx.ModelProto) -> bool:
    """Whether a top-level node holds a graph (If/Loop/Scan): its body reads outer-scope tensors implicitly."""
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in model.graph.node for a in n.attribute
    )


def producers_and_last_reads(nodes: Sequence[onnx.NodeProto]) -> tuple[dict[str, int], dict[str, int]]:
    """Per tensor, the index of the node that produces it and of the last node that reads it (O(nodes))."""
    producer: dict[str, int] = {}
    last_read: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for t in node.input:
            if t:
                last_read[t] = i
        for t in node.output:
            if t:
                producer[t] = i
    return producer, last_read


def plan_segments(
    model: onnx.ModelProto, targets: Iterable[str], size: int | None = None, starts: Sequence[int] | None = None
) -> tuple[list[_Segment], dict[str, int]]:
    """Cut the (topologically sorted) node list into slices with their boundary tensors (O(N)); also returns
    the index of the last node reading each tensor. Slices of ``size`` nodes, or starting at ``starts`` (the first
    0, increasing)."""
    nodes = list(model.graph.node)
    starts = list(starts) if starts is not None else list(range(0, len(nodes), size or SEGMENT_NODES))
    inits = {t.name for t in model.graph.initializer}
    wanted = set(targets)
    produced, last_use = producers_and_last_reads(nodes)
    segments: list[_Segment] = []
    for a, b in zip(starts, [*starts[1:], len(nodes)], strict=True):
        chunk = nodes[a:b]
        inputs: dict[str, None] = {}
        used_inits: dict[str, None] = {}
        for node in chunk:
            for t in node.input:
                if not t:
                    continue
                if t in inits:
                    used_inits[t] = None
                elif produced.get(t, -1) < a:
                    inputs[t] = None
        outputs = [t for node in chunk for t in node.output if t and (t in wanted or last_use.get(t, -1) >= b)]
        if outputs:  # a slice nothing later reads and nothing to calibrate in: skip it
            segments.append(_Segment(chunk, list(inputs), outputs, list(used_inits), b))
    return segments, last_use


def segment_model(
    base: onnx.ModelProto, seg: _Segment, inits: Mapping[str, onnx.TensorProto], values: Mapping[str, Any],
    types: Mapping[str, onnx.TypeProto] | None = None,
) -> onnx.ModelProto:
    """The model of slice ``seg`` of ``base``: its nodes and initializers; an input typed as ``types`` has it (the
    whole graph's inferred shapes: onnxruntime's fusions read them), else as the value ``values`` holds."""
    m = onnx.ModelProto()
    m.ir_version = base.ir_version
    m.opset_import.extend(base.opset_import)
    m.functions.extend(base.functions)
    g = m.graph
    g.name = "segment"
    g.node.extend(seg.nodes)
    g.initializer.extend(inits[t] for t in seg.initializers)
    for t in seg.inputs:
        known = (types or {}).get(t)
        if known is not None:
            g.input.append(helper.make_value_info(t, known))
            continue
        arr = np.asarray(values[t])
        g.input.append(helper.make_tensor_value_info(t, helper.np_dtype_to_tensor_dtype(arr.dtype), None))
    for t in seg.outputs:
        g.output.add().name = t
    return m


def observe_segmented(
    model: onnx.ModelProto,
    observers: Mapping[str, Any],
    data: Iterable[Mapping[str, npt.NDArray[Any]]],
    size: int | None = None,
    *,
    optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    providers: Sequence[str] | None = None,
    after_feed: Callable[[int], None] | None = None,
    plan: tuple[list[_Segment], dict[str, int]] | None = None,
    progress: Callable[[int, int | None], None] | None = None,
) -> int:
    """Feed ``observers`` (tensor name -> object with ``update(x, sample_index)``) for every sample of ``data``,
    running the graph slice by slice; returns the number of samples.  ``after_feed(index)`` is called once
    each sample has gone through every slice (progress). ``plan``: `plan_segments` of ``model`` for these
    observers, kept by the caller: its slices' sessions, built on the first run, serve every later run. Up to
    `SLICE_MAJOR_SAMPLES` samples run slice-major instead (`run_slice_major`: one slice's session at a time,
    samples side by side, each session freed once every sample went through it; ``after_feed`` then follows the
    last slice). ``progress(done, total or None)``: samples done, after each sample; slice-major, the share of the
    work done after each slice, in samples."""
    segments, last_use = plan if plan is not None else plan_segments(model, observers, size)
    inits = {t.name: t for t in model.graph.initializer}

    def build(seg: _Segment, values: Mapping[str, Any]) -> Any:
        return _segment_session(model, seg, inits, values, optimization, providers)

    def seen(index: int, name: str, arr: Any) -> None:
        if name in observers:
            observers[name].update(arr, index)

    source = iter(data)
    head = [{k: np.asarray(v) for k, v in feed.items()} for feed in itertools.islice(source, SLICE_MAJOR_SAMPLES + 1)]
    if not head:
        raise DataError("the calibration data is empty: it yielded no feed dict; provide at least one sample")
    if len(head) <= SLICE_MAJOR_SAMPLES:  # few samples: one slice's session at a time, samples side by side
        for index, first in enumerate(head):
            for name, arr in first.items():
                seen(index, name, arr)
        n = len(head)
        shares = (lambda k, of: progress(n * k // of, n)) if progress is not None else None
        run_slice_major(segments, last_use, head, build, seen=seen, after_slice=shares)
        if after_feed is not None:
            for index in range(n):
                after_feed(index)
        return n
    count = 0
    for index, sample in enumerate(itertools.chain(head, source)):
        values: dict[str, Any] = {k: np.asarray(v) for k, v in sample.items()}
        for name, arr in values.items():
            seen(index, name, arr)
        for seg in segments:
            if seg.session is None:
                seg.session = build(seg, values)
            _through(seg, [(index, values)], last_use, _never, seen)
        count = index + 1
        if after_feed is not None:
            after_feed(index)
        if progress is not None:
            progress(count, None)
    return count


def _never(name: str) -> bool:
    """No value is kept past its last reader (`run_slice_major`'s default ``keep``)."""
    return False


def run_slice_major(
    segments: Sequence[_Segment],
    last_use: Mapping[str, int],
    feeds: Sequence[Mapping[str, Any]],
    build: Callable[[_Segment, Mapping[str, Any]], Any],
    keep: Callable[[str], bool] = _never,
    seen: Callable[[int, str, Any], None] | None = None,
    release: bool = True,
    after_slice: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``feeds`` through ``segments`` one slice at a time: build the slice's session (``build(segment, the first
    sample's values)``), run every sample through it, several at once (`qgraph.runtime.parallel.ordered_map`),
    then drop the session (``release``), so at most one slice's session exists at a time (onnxruntime holds
    ~4-5 KB per node of a built session). The same runs as slice after slice per sample, so the same bits.
    ``seen(index, name, value)`` gets each slice output in sample order; a value is dropped once no later slice
    reads it and ``keep(name)`` is false; ``after_slice(slices done, slices)`` follows each slice. When the values
    every sample holds at a cut outgrow `SLICE_MAJOR_BYTES`, the samples finish the remaining slices one at a time
    instead (each dropping its values as it goes; those slices' sessions kept until every sample is through).
    Returns each sample's kept values."""
    values: list[dict[str, Any]] = [dict(f) for f in feeds]
    items = list(enumerate(values))
    for done, seg in enumerate(segments, 1):
        if not values:
            break
        if seg.session is None:
            seg.session = build(seg, values[0])
        _through(seg, items, last_use, keep, seen)
        if release:
            seg.session = None
        if after_slice is not None:
            after_slice(done, len(segments))
        if done < len(segments) and sum(array_bytes(v.values()) for v in values) > SLICE_MAJOR_BYTES:
            rest = segments[done:]
            for item in items:
                for later in rest:
                    if later.session is None:
                        later.session = build(later, item[1])
                    _through(later, [item], last_use, keep, seen)
            for later in rest if release else ():
                later.session = None
            if after_slice is not None:
                after_slice(len(segments), len(segments))
            break
    return values


def _through(seg: _Segment, items: list[tuple[int, dict[str, Any]]], last_use: Mapping[str, int],
             keep: Callable[[str], bool], seen: Callable[[int, str, Any], None] | None) -> None:
    """``items`` ``(sample index, its values)`` through slice ``seg`` (its session built), several at once: each
    sample's values gain the slice's outputs (``seen``, in sample order) and lose what no later slice reads."""
    session = seg.session

    def one(item: tuple[int, dict[str, Any]]) -> list[Any]:
        try:
            return session_run(session, seg.outputs, {t: item[1][t] for t in seg.inputs})
        except Exception as exc:
            raise DataError(f"sample {item[0]}: onnxruntime failed to run the model: {exc}") from exc

    runs = map(one, items) if len(items) == 1 else ordered_map(one, items)  # one sample: no thread hand-off
    for (index, held), outs in zip(items, runs, strict=True):
        for name, arr in zip(seg.outputs, outs, strict=True):
            held[name] = arr
            if seen is not None:
                seen(index, name, arr)
        for name in [t for t in held if not keep(t) and last_use.get(t, -1) < seg.end]:
            del held[name]


def _segment_session(model: onnx.ModelProto, seg: _Segment, inits: Mapping[str, onnx.TensorProto],
                     values: Mapping[str, Any], optimization: ort.GraphOptimizationLevel,
                     providers: Sequence[str] | None) -> Any:
    """A session for slice ``seg``: one thread, as `qgraph.runtime.compare.make_session` (the same reductions in
    the same order as one session, on every host whatever its core count)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = optimization
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    proto = segment_model(model, seg, inits, values)
    try:
        return ort.InferenceSession(proto.SerializeToString(), opts,
                                    providers=list(providers) if providers else ["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception classes
        raise ModelError(f"onnxruntime cannot load a segment of the model: {exc}") from exc


def sink_constants(model: onnx.ModelProto) -> None:
    """Move every node that reads only initializers and such nodes' outputs (a weight's DequantizeLinear) right
    before its first reader, in place. An exported graph lists them first: every slice would then be fed thousands
    of them from the first one, and onnxruntime checks a run's feed in O(inputs x fed names). The same nodes
    compute the same values in another topological order."""
    nodes = list(model.graph.node)
    producer = {t: i for i, n in enumerate(nodes) for t in n.output if t}
    sources = {t.name for t in model.graph.initializer}
    constant = [False] * len(nodes)
    for i, n in enumerate(nodes):
        constant[i] = all(not t or t in sources or (t in producer and constant[producer[t]]) for t in n.input)
    placed = [False] * len(nodes)
    out: list[onnx.NodeProto] = []

    def place(first: int) -> None:
        """Node ``first`` (constant) after the constant nodes it reads, depth first without recursion."""
        stack = [(first, False)]
        while stack:
            i, ready = stack.pop()
            if placed[i]:
                continue
            if ready:
                placed[i] = True
                out.append(nodes[i])
                continue
            stack.append((i, True))
            stack.extend((producer[t], False) for t in reversed(nodes[i].input) if t in producer
                         and not placed[producer[t]])

    for i, n in enumerate(nodes):
        if constant[i]:
            continue
        for t in n.input:
            if t in producer and constant[producer[t]] and not placed[producer[t]]:
                place(producer[t])
        out.append(n)
    for i in range(len(nodes)):
        if constant[i] and not placed[i]:  # read by no computed node (a graph output): last
            place(i)
    model.graph.ClearField("node")
    model.graph.node.extend(out)
