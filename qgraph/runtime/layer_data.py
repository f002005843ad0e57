"""What weight-correction passes measure on calibration data: per-channel output means, and sampled layer inputs.

`channel_means` reduces inside onnxruntime: each requested tensor ``y`` gets, right after its producer (so it can
be freed at once), ``ReduceMean`` over everything but the channel axis and its element count; a run returns
``C`` numbers per tensor whatever the activation size. Means over batches are weighted by rows.

`sample_inputs` keeps a uniform random sample of at most ``max_rows`` input *rows* per layer over the whole data
(reservoir by random keys: every row gets a key ``U(0, 1)``, the rows with the smallest keys are kept), so memory
is ``max_rows x K`` per layer whatever the data. A Conv row is the receptive field of one output position
(im2col), gathered only at the sampled positions: ``x_pad[n, c, o·stride + k·dilation]`` for every input channel
``c`` of the group and kernel offset ``k``, flattened as the weight's ``(C_in/group, *kernel)``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
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
from qgraph.graph.detach import DETACH_BYTES, PLACEHOLDER, placeholders_as_inputs, with_weights
from qgraph.runtime.compare import make_session, refeed, session_run
from qgraph.runtime.segments import observe_segmented, plan_segments, segmentable

#: Stems of the namespaces the helper nodes live in (`qgraph.graph.ProtoNames.prefix`: ``qgraph_layer_1/`` when
#: the model already uses ``qgraph_layer/``).
_STEM, _TWIN_STEM = "qgraph_layer", "qgraph_layer_twin"
_NO_OPTIMIZATION = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # what `make_session` runs with
#: `channel_means` runs graphs over this many nodes slice by slice, in slices of `SLICE_NODES`. Higher than
#: calibration's threshold: the twin graph of a 1,000-layer chain (~20k nodes) initializes no faster in 4,000-node
#: slices (measured: 14 sessions 56 s vs 6 sessions 47 s on a loaded machine) and pays a run per slice per batch.
SLICE_ABOVE = 32_000
SLICE_NODES = 16_000


def _opset(model: onnx.ModelProto) -> int:
    return next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _mean_nodes(name: str, p: str, one: str, channels: int, channel_first: bool, opset: int) -> tuple[
        list[onnx.NodeProto], list[onnx.TensorProto], tuple[str, str]]:
    """Per-channel mean (cast to double: exact) and element count (as a 1-vector) of tensor ``name``; helper
    names start with ``p``, ``one`` names the shared constant ``[1]``."""
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
    nodes.append(helper.make_node("Size", [name], [p + "size"]))
    nodes.append(helper.make_node("Reshape", [p + "size", one], [p + "size1"]))
    return nodes, inits, (p + "mean64", p + "size1")


def _augment(model: onnx.ModelProto, after: dict[str, list[onnx.NodeProto]],
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
    """`channel_means` of one model, its session built once: each call is one streamed run over ``batches``, and
    `refeed` changes the values of the placeholders named in ``fed`` (a layer's bias) between calls without a new
    session."""

    def __init__(self, model: onnx.ModelProto, tensors: dict[str, tuple[int, bool]],
                 weights: Mapping[str, npt.NDArray[Any]] | None = None, fed: Collection[str] = ()) -> None:
        opset = _opset(model)
        after: dict[str, list[onnx.NodeProto]] = {}
        space = ProtoNames(model).prefix(_STEM)
        one = space + "one"
        inits: list[onnx.TensorProto] = [numpy_helper.from_array(np.array([1], np.int64), one)]
        means: list[str] = []
        sizes: list[str] = []
        for k, (name, (c, first)) in enumerate(tensors.items()):
            nodes, consts, (mean_o, size_o) = _mean_nodes(name, f"{space}{k}/", one, c, first, opset)
            after.setdefault(name, []).extend(nodes)
            inits.extend(consts)
            means.append(mean_o)
            sizes.append(size_o)
        self.tensors = tensors
        self.channels = [c for c, _ in tensors.values()]
        self.run = _MeansRun(_augment(model, after, inits, []), (means, sizes), (space + "means", space + "sizes"),
                             weights, fed)

    def refeed(self, values: Mapping[str, npt.NDArray[Any]]) -> bool:
        """From now on, read these placeholders' values from ``values`` (the same dtype and shape); False (nothing
        changed) when a name is not one of ``fed``: build a new `ChannelMeans` then."""
        return self.run.refeed(values)

    def __call__(self, batches: Iterable[Feed]) -> dict[str, npt.NDArray[np.float64]]:
        """Per-channel means of every tensor over ``batches`` (one streamed run)."""
        channels = self.channels
        ends = np.cumsum(channels)
        sums = np.zeros(int(ends[-1]) if channels else 0, np.float64)
        rows = np.zeros(len(channels), np.float64)
        per_channel = np.repeat(np.arange(len(channels)), channels)

        def fold(mean: npt.NDArray[Any], size: npt.NDArray[Any]) -> None:
            nonlocal sums, rows
            n = np.asarray(size, np.float64) / np.asarray(channels, np.float64)
            sums += np.asarray(mean, np.float64) * n[per_channel]
            rows += n

        self.run.each(batches, fold)
        totals = dict(zip(self.tensors, np.split(sums, ends[:-1]), strict=True))
        rows_of = dict(zip(self.tensors, rows, strict=True))
        out: dict[str, npt.NDArray[np.float64]] = {}
        for name, total in totals.items():
            mean = total / max(float(rows_of[name]), 1.0)
            if not np.all(np.isfinite(mean)):
                raise DataError(f"tensor {name!r} holds NaN/Inf on the calibration data: its mean cannot be "
                                "corrected; fix the model or the data.")
            out[name] = mean
        return out


class _MeansRun:
    """``use(every mean joined, every size joined)`` for every batch, in order.

    One session: two Concat nodes join them, so a run fetches two outputs whatever the number of tensors (each
    fetched output costs onnxruntime and Python ~10 us: 2 x 2,000 outputs x 32 samples on a 1,000-layer chain).
    A graph over `SLICE_ABOVE` nodes (onnxruntime's session initialization is super-linear in the node count: 10 s
    for the quantized twin graph of a 3,000-layer chain, ~100 s at 10,000 layers) runs slice by slice
    (`qgraph.runtime.segments`) at the same optimization level (none), each slice handing out its own means (a
    Concat would carry every mean through every later slice); they are joined here: the same values. The slices'
    sessions, built on the first run, serve every run: the ``fed`` placeholders are their inputs."""

    def __init__(self, model: onnx.ModelProto, parts: tuple[list[str], list[str]], joined: tuple[str, str],
                 weights: Mapping[str, npt.NDArray[Any]] | None, fed: Collection[str]) -> None:
        self.parts, self.joined = parts, joined
        weights = dict(weights or {})
        self.session: Any = None
        self.fed = {n: np.asarray(weights.pop(n)) for n in fed if n in weights}  # slice inputs, fed per sample
        means, sizes = parts
        if len(model.graph.node) <= SLICE_ABOVE or not segmentable(model):
            model.graph.node.extend([helper.make_node("Concat", means, [joined[0]], axis=0),  # our own copy
                                     helper.make_node("Concat", sizes, [joined[1]], axis=0)])
            model.graph.output.extend(helper.make_value_info(o, onnx.TypeProto()) for o in joined)
            self.session = make_session(model, mem_pattern=False, weights={**weights, **self.fed})
            return
        # slices are built from protobufs: every weight written in but the fed ones, which stay graph inputs
        self.model = placeholders_as_inputs(with_weights(model, weights) if weights else model)
        self.plan = plan_segments(self.model, [*means, *sizes], SLICE_NODES)

    def refeed(self, values: Mapping[str, npt.NDArray[Any]]) -> bool:
        if not all(n in self.fed and np.asarray(v).dtype == self.fed[n].dtype
                   and np.shape(v) == self.fed[n].shape for n, v in values.items()):
            return False
        if self.session is not None and not refeed(self.session, values):
            return False
        self.fed.update(values)
        return True

    def each(self, batches: Iterable[Feed], use: Callable[[npt.NDArray[Any], npt.NDArray[Any]], None]) -> None:
        means, sizes = self.parts
        if self.session is not None:
            for feed in batches:
                use(*session_run(self.session, list(self.joined), feed))
            return
        got: dict[str, Any] = {}

        class _Keep:
            def __init__(self, name: str) -> None:
                self.name = name

            def update(self, x: Any, sample_index: int | None = None) -> None:
                got[self.name] = x

        def done(_: int) -> None:
            use(np.concatenate([got.pop(o) for o in means]), np.concatenate([got.pop(o) for o in sizes]))

        observe_segmented(self.model, {o: _Keep(o) for o in [*means, *sizes]},
                          ({**feed, **self.fed} for feed in batches), SLICE_NODES, optimization=_NO_OPTIMIZATION,
                          after_feed=done, plan=self.plan)


@dataclass
class RowSpec:
    """How to cut a layer's input into rows of ``k`` values (per group): a Conv's geometry (``kernel`` non-empty;
    ``k = C_in / groups x kernel size``) or a matrix of ``k`` columns."""

    tensor: str
    k: int
    groups: int = 1
    kernel: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()
    dilations: tuple[int, ...] = ()
    pads: tuple[int, ...] = ()  # begins then ends, as ONNX


@dataclass
class _Reservoir:
    """``max_rows`` slots of rows and their keys (``inf``: empty); new rows overwrite the slots with the largest
    keys in place (no re-concatenation of the whole sample per batch)."""

    keys: npt.NDArray[np.float64] = field(default_factory=lambda: np.empty(0))
    rows: npt.NDArray[np.float32] | None = None

    def sample(self) -> npt.NDArray[np.float32] | None:
        """The rows of the filled slots ``(G, n, K)``."""
        if self.rows is None:
            return None
        filled = np.isfinite(self.keys)
        return self.rows if filled.all() else self.rows[:, filled]


def _positions(x: npt.NDArray[np.float32], spec: RowSpec) -> tuple[int, ...]:
    """Output positions per axis: ``(N, *out_spatial)`` for a Conv, ``(rows,)`` for a matrix."""
    if not spec.kernel:
        return (x.size // spec.k,)
    sp = x.shape[2:]
    nd = len(sp)
    out = [(sp[i] + spec.pads[i] + spec.pads[i + nd] - spec.dilations[i] * (spec.kernel[i] - 1) - 1)
           // spec.strides[i] + 1 for i in range(nd)]
    return (x.shape[0], *out)


def _gather(x: npt.NDArray[np.float32], spec: RowSpec, picked: npt.NDArray[np.intp],
            grid: tuple[int, ...]) -> npt.NDArray[np.float32]:
    """Rows ``(G, m, K)`` at flat positions ``picked`` of ``grid``."""
    if not spec.kernel:
        return x.reshape(-1, spec.k)[picked][None]
    nd = len(spec.kernel)
    pad = [(0, 0), (0, 0)] + [(spec.pads[i], spec.pads[i + nd]) for i in range(nd)]
    xp = np.pad(x, pad) if any(spec.pads) else x
    xt = np.moveaxis(xp, 1, -1)  # (N, *spatial, C): channels last for one fancy-index gather
    coords = np.unravel_index(picked, grid)
    offsets = np.indices(spec.kernel).reshape(nd, -1)  # (nd, kernel elements), row-major like the weight
    index = [coords[0][:, None]] + [coords[i + 1][:, None] * spec.strides[i] + offsets[i][None] * spec.dilations[i]
                                    for i in range(nd)]
    patches = xt[tuple(index)]  # (m, kernel elements, C)
    m, ke, c = patches.shape
    g = spec.groups
    grouped = patches.reshape(m, ke, g, c // g).transpose(2, 0, 3, 1)  # (G, m, C/g, kernel elements)
    return np.ascontiguousarray(grouped.reshape(g, m, (c // g) * ke), dtype=np.float32)


def _fold(res: _Reservoir, x: npt.NDArray[np.float32], spec: RowSpec, max_rows: int,
          rng: np.random.Generator) -> None:
    grid = _positions(x, spec)
    total = int(np.prod(grid))
    if total == 0:
        return
    if res.rows is None:
        res.rows = np.empty((spec.groups, max_rows, spec.k), np.float32)
        res.keys = np.full(max_rows, np.inf)
    keys = rng.random(total)
    take = min(max_rows, total)
    picked = np.argpartition(keys, take - 1)[:take] if take < total else np.arange(total)
    picked = picked[keys[picked] < res.keys.max()]  # only rows that beat the worst kept one can enter
    if not picked.size:
        return
    both = np.concatenate([res.keys, keys[picked]])
    keep = np.argpartition(both, max_rows - 1)[:max_rows]
    incoming = keep[keep >= max_rows] - max_rows
    evicted = np.setdiff1d(np.arange(max_rows), keep[keep < max_rows], assume_unique=True)
    res.rows[:, evicted] = _gather(x, spec, picked[incoming], grid)
    res.keys[evicted] = keys[picked[incoming]]


def sample_inputs(model: onnx.ModelProto, specs: Sequence[RowSpec], batches: Iterable[Feed], max_rows: int,
                  seed: int = 0, weights: Mapping[str, npt.NDArray[Any]] | None = None
                  ) -> list[npt.NDArray[np.float32]]:
    """A uniform sample of at most ``max_rows`` rows ``(G, n, K)`` of each spec's input over every batch (module
    docstring); one streamed run of ``model`` fetching the input tensors. `DataError` on NaN/Inf. ``weights`` as
    in `channel_means`."""
    names = list(dict.fromkeys(s.tensor for s in specs))
    inputs = {i.name for i in model.graph.input}
    fetched = [n for n in names if n not in inputs]
    session = (make_session(_augment(model, {}, [], fetched), mem_pattern=False, weights=weights) if fetched
               else None)
    rng = np.random.default_rng(seed)
    reservoirs = [_Reservoir() for _ in specs]
    for feed in batches:
        got = session_run(session, fetched, feed) if session is not None else []
        values = dict(zip(fetched, got, strict=True))
        values.update({n: feed[n] for n in names if n in inputs})
        for spec, res in zip(specs, reservoirs, strict=True):
            x = np.asarray(values[spec.tensor], np.float32)
            if not np.all(np.isfinite(x)):
                raise DataError(f"tensor {spec.tensor!r} holds NaN/Inf on the calibration data; fix the model or "
                                "the data.")
            _fold(res, x, spec, max_rows, rng)
        del values
    out: list[npt.NDArray[np.float32]] = []
    for r, s in zip(reservoirs, specs, strict=True):
        kept = r.sample()
        out.append(kept if kept is not None else np.zeros((s.groups, 0, s.k), np.float32))
    return out


@dataclass
class Twin:
    """A float copy of a quantized layer reading the same (quantized) input: node with output ``node_output`` in
    the model, its float ``weight`` and ``bias`` (C,), and the name its twin output gets."""

    node_output: str
    weight: npt.NDArray[np.float32]
    bias: npt.NDArray[np.float32]
    output: str


def _twin_tensor(value: npt.NDArray[np.float32], name: str,
                 weights: dict[str, npt.NDArray[Any]] | None) -> onnx.TensorProto:
    if weights is None or value.nbytes < DETACH_BYTES:
        return numpy_helper.from_array(value, name)
    weights[name] = value  # shared, not copied: the session reads it in place
    t = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(value.dtype))
    t.dims.extend(value.shape)
    t.data_location = onnx.TensorProto.EXTERNAL
    t.external_data.add(key="location", value=PLACEHOLDER)
    return t


def with_twins(model: onnx.ModelProto, twins: Sequence[Twin],
               weights: dict[str, npt.NDArray[Any]] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` where each twin's layer gets a float copy right after it: the same op and attributes on
    the same input 0, with the float weight and bias (Conv/Gemm: input 2, Gemm ``beta = 1``; MatMul: an Add).

    With ``weights`` (a weightless ``model``'s placeholder values), large twin tensors are placeholders too and
    their arrays are added to ``weights`` (shared): the copy then holds no weights at all."""
    by_output = {n.output[0]: n for n in model.graph.node if n.output}
    after: dict[str, list[onnx.NodeProto]] = {}
    inits: list[onnx.TensorProto] = []
    space = ProtoNames(model).prefix(_TWIN_STEM)
    for k, twin in enumerate(twins):
        node = by_output[twin.node_output]
        p = f"{space}{k}/"
        inits += [_twin_tensor(twin.weight, p + "w", weights), _twin_tensor(twin.bias, p + "b", weights)]
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = p + "node"
        del copy.input[1:]
        copy.input.append(p + "w")
        del copy.output[:]
        nodes = [copy]
        if node.op_type == "MatMul":
            copy.output.append(p + "matmul")
            nodes.append(helper.make_node("Add", [p + "matmul", p + "b"], [twin.output], name=p + "add"))
        else:
            copy.input.append(p + "b")
            copy.output.append(twin.output)
            for a in copy.attribute:
                if a.name == "beta":
                    a.f = 1.0
        after.setdefault(twin.node_output, []).extend(nodes)
    return _augment(model, after, inits, [])
