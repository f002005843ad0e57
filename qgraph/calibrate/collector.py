"""Run a float model in onnxruntime over calibration data and fold activations into observers.

The requested tensors are exposed as extra graph outputs (name and, when known, element
type; no shape, so dynamic batch/sequence/spatial sizes work) of a copy of the model, run
with graph optimizations disabled so every intermediate name survives.  Each batch's
outputs are folded into the observers immediately and then dropped: memory is one batch's
activations plus the observers' bounded state, independent of the number of samples.

Because the histograms are batching-invariant and re-gridded exactly as ranges grow
(:mod:`qgraph.calibrate.histogram`), every method needs a **single pass** over the data.

Models whose protobuf would exceed 2 GB are written to a temporary folder with their
initializers as external data (one tensor in memory at a time) and loaded from there.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import TensorProto

from qgraph.calibrate.observers import HistogramSummary, Observer, make_observer
from qgraph.errors import DataError, ModelError
from qgraph.quant import ActivationRange

Feed = Mapping[str, npt.NDArray[Any]]
DataLike = Iterable[Feed] | Callable[[], Iterable[Feed]]
ProgressCallback = Callable[[int, int | None], None]

#: Serialized size above which the augmented model goes through external data (2 GB - 64 MB).
LARGE_MODEL_BYTES = 2**31 - 1 - (64 << 20)


class Updatable(Protocol):
    """What :func:`observe` feeds: any :class:`Observer`, or a duck-typed tee of several."""

    def update(self, x: npt.NDArray[Any], sample_index: int | None = None, /) -> None: ...


class Hasher(Protocol):
    """Anything with ``update(bytes)`` (``hashlib.sha256()``)."""

    def update(self, data: bytes, /) -> None: ...


@dataclass(frozen=True, eq=False)
class TensorCalibration:
    """Calibration result of one tensor.

    Attributes:
        name: tensor name.
        method: observer method (``minmax``, ``percentile``, ``entropy``, ``mse``).
        axis: channel axis, or ``None`` per tensor.
        range: chosen range (what the quantizer should use).
        observed: exact observed ``[min, max]``.
        clip_fraction: fraction of observed values outside ``range``.
        num_values: number of scalar values observed.
        num_updates: number of batches observed.
        histogram: compact histogram (per-tensor histogram methods only).
        options: observer options.
    """

    name: str
    method: str
    axis: int | None
    range: ActivationRange
    observed: ActivationRange
    clip_fraction: float
    num_values: int
    num_updates: int
    histogram: HistogramSummary | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_observer(cls, obs: Observer) -> TensorCalibration:
        """Summarize a fed observer."""
        return cls(
            name=obs.name,
            method=obs.method,
            axis=obs.axis,
            range=obs.compute(),
            observed=obs.observed(),
            clip_fraction=obs.clip_fraction(),
            num_values=obs.num_values,
            num_updates=obs.num_updates,
            histogram=obs.histogram_summary(),
            options=obs.options(),
        )


def collect_ranges(
    model: onnx.ModelProto,
    tensor_names: Sequence[str],
    data: DataLike,
    method: str = "minmax",
    *,
    options: Mapping[str, Any] | None = None,
    per_channel_axes: Mapping[str, int] | None = None,
    progress: ProgressCallback | None = None,
    providers: Sequence[str] | None = None,
    data_hasher: Hasher | None = None,
    large_model_bytes: int = LARGE_MODEL_BYTES,
) -> dict[str, TensorCalibration]:
    """Calibrate ``tensor_names`` of ``model`` on ``data`` with one observer per tensor.

    Args:
        model: float model with its weights loaded (not modified).
        tensor_names: graph inputs or outputs of top-level nodes.
        data: feed dicts ``{input name: array}``, or a zero-argument callable returning them.
            Shapes may vary between feeds (dynamic axes).  Read once.
        method: ``minmax``, ``percentile``, ``entropy`` or ``mse``.
        options: observer options (see :mod:`qgraph.calibrate.observers`).
        per_channel_axes: ``{tensor: axis}`` for per-channel ranges.
        progress: called after each feed with ``(feeds done, total or None)``.
        providers: onnxruntime execution providers (default CPU).
        data_hasher: updated with every feed (names, dtypes, shapes, bytes -- the same scheme
            as ``qgraph.data.DataSource.fingerprint``) to fingerprint the data in the same pass.
        large_model_bytes: serialized size above which external data is used.

    Raises:
        ModelError: unknown tensor, initializer, or tensor inside a subgraph.
        DataError: empty data, wrong input names, onnxruntime failure or NaN/Inf in a tensor.
        ValueError: unknown method or option.
    """
    axes = dict(per_channel_axes or {})
    observers = {name: make_observer(method, name, axes.get(name), **dict(options or {})) for name in tensor_names}
    if method == "minmax" and not axes and not dict(options or {}).get("moving_average"):
        # Reduce inside onnxruntime (three scalars per tensor instead of whole activations), as fast as
        # plain inference; the observer sees [min, max] and so keeps its NaN/Inf checks and formulas.
        inits = {t.name for t in model.graph.initializer}
        _check_tensors(model, list(observers), inits, {vi.name for vi in model.graph.input if vi.name not in inits})
        reduced, feeders = _in_graph_minmax(model, observers)
        # Optimizations stay off: ORT_ENABLE_ALL swaps kernels and moves ranges by ~1e-6 (measured) for no
        # measurable speed-up here.
        observe(reduced, feeders, data, progress=progress, providers=providers, data_hasher=data_hasher,
                large_model_bytes=large_model_bytes)
        for feeder in feeders.values():
            if isinstance(feeder, _FoldMinMax):
                feeder.finish()
        return {name: TensorCalibration.from_observer(obs) for name, obs in observers.items()}
    observe(
        model,
        observers,
        data,
        progress=progress,
        providers=providers,
        data_hasher=data_hasher,
        large_model_bytes=large_model_bytes,
    )
    return {name: TensorCalibration.from_observer(obs) for name, obs in observers.items()}


def observe(
    model: onnx.ModelProto,
    observers: Mapping[str, Updatable],
    data: DataLike,
    *,
    progress: ProgressCallback | None = None,
    providers: Sequence[str] | None = None,
    data_hasher: Hasher | None = None,
    large_model_bytes: int = LARGE_MODEL_BYTES,
    optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
) -> int:
    """Feed every tensor named in ``observers`` (any mix of observer types, or anything with
    ``update(x, sample_index)``) for all of ``data``.

    Lower-level form of :func:`collect_ranges`; returns the number of feeds processed.
    """
    inits = {t.name for t in model.graph.initializer}
    graph_inputs = [vi.name for vi in model.graph.input if vi.name not in inits]
    _check_tensors(model, list(observers), inits, set(graph_inputs))
    from_feed = [n for n in observers if n in graph_inputs]
    fetch = [n for n in observers if n not in graph_inputs]
    source = data() if callable(data) else data
    total = len(source) if isinstance(source, Sized) else None
    done = 0
    with _session(model, fetch, providers, large_model_bytes, optimization) as sess:
        expected = {i.name for i in sess.get_inputs()}
        for index, feed in enumerate(_iterate(source)):
            arrays = _validate_feed(feed, expected, index)
            if data_hasher is not None:
                _hash_feed(data_hasher, arrays)
            outputs: list[Any] = []
            if fetch:
                try:
                    outputs = sess.run(fetch, arrays)
                except Exception as exc:  # onnxruntime raises its own exception classes
                    raise DataError(f"calibration sample {index}: onnxruntime failed to run the model: {exc}") from exc
            for name in from_feed:
                observers[name].update(arrays[name], index)
            for name, value in zip(fetch, outputs, strict=True):
                observers[name].update(np.asarray(value), index)
            del outputs
            done = index + 1
            if progress is not None:
                progress(done, total)
    if done == 0:
        raise DataError("the calibration data is empty: it yielded no feed dict; provide at least one sample")
    return done


def _iterate(source: Iterable[Feed]) -> Iterator[Feed]:
    try:
        yield from source
    except TypeError as exc:
        raise DataError(f"calibration data is not iterable: {exc}") from exc


def _validate_feed(feed: Any, expected: set[str], index: int) -> dict[str, npt.NDArray[Any]]:
    if not isinstance(feed, Mapping):
        raise DataError(
            f"calibration sample {index}: expected a dict of input name -> array, got {type(feed).__name__}"
        )
    missing = sorted(expected - set(feed))
    extra = sorted(set(feed) - expected)
    if missing or extra:
        raise DataError(
            f"calibration sample {index}: input names do not match the model (missing: {missing or 'none'}, "
            f"unknown: {extra or 'none'}); the model's inputs are {sorted(expected)}"
        )
    return {k: np.asarray(v) for k, v in feed.items()}


def _hash_feed(h: Hasher, feed: Mapping[str, npt.NDArray[Any]]) -> None:
    for name in sorted(feed):
        arr = np.ascontiguousarray(feed[name])
        h.update(f"{name}:{arr.dtype}:{arr.shape};".encode())
        h.update(arr.tobytes())


def _check_tensors(model: onnx.ModelProto, names: list[str], inits: set[str], inputs: set[str]) -> None:
    produced = {o for node in model.graph.node for o in node.output if o}
    bad_init = [n for n in names if n in inits]
    if bad_init:
        raise ModelError(
            f"cannot calibrate initializer(s) {bad_init}: constants are quantized from their values; "
            "calibrate activations only"
        )
    unknown = [n for n in names if n not in produced and n not in inputs]
    if unknown:
        raise ModelError(
            f"tensor(s) {unknown} are neither graph inputs nor outputs of a top-level node of the model "
            "(tensors inside If/Loop/Scan bodies cannot be calibrated); check the names with `qgraph inspect`"
        )


def _known_types(model: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = {}
    for vi in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            out[vi.name] = vi.type.tensor_type.elem_type
    return out


def _output_infos(model: onnx.ModelProto, fetch: Sequence[str]) -> list[onnx.ValueInfoProto]:
    """Value infos for the tensors to expose: element type when known, never a shape."""
    types = _known_types(model)
    existing = {o.name for o in model.graph.output}
    infos = []
    for name in fetch:
        if name in existing:
            continue
        vi = onnx.ValueInfoProto()
        vi.name = name
        if name in types:
            vi.type.tensor_type.elem_type = types[name]
        infos.append(vi)
    return infos


def _serialized_size(model: onnx.ModelProto) -> int:
    try:
        return int(model.ByteSize())
    except Exception:  # protobuf may refuse to size > 2 GB messages
        return 2**63 - 1


@contextmanager
def _session(
    model: onnx.ModelProto,
    fetch: Sequence[str],
    providers: Sequence[str] | None,
    large_model_bytes: int,
    optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
) -> Iterator[ort.InferenceSession]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = optimization
    provs = list(providers) if providers else ["CPUExecutionProvider"]
    infos = _output_infos(model, fetch)
    if _serialized_size(model) <= large_model_bytes:
        aug = onnx.ModelProto()
        aug.CopyFrom(model)
        aug.graph.output.extend(infos)
        yield _create_session(aug.SerializeToString(), opts, provs)
        return
    with tempfile.TemporaryDirectory(prefix="qgraph-calib-") as tmp:
        path = _write_with_external_data(model, infos, Path(tmp))
        yield _create_session(str(path), opts, provs)


def _create_session(src: str | bytes, opts: ort.SessionOptions, providers: list[str]) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(src, opts, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception classes
        raise ModelError(f"onnxruntime cannot load the model for calibration: {exc}") from exc


def _write_with_external_data(model: onnx.ModelProto, extra_outputs: list[onnx.ValueInfoProto], folder: Path) -> Path:
    """Write ``model`` + outputs to ``folder`` with top-level initializers in one external file.

    The model passed in is not modified and never copied whole: the graph is rebuilt from its
    parts and each initializer's bytes are streamed to ``weights.bin``.
    """
    aug = onnx.ModelProto()
    aug.ir_version = model.ir_version
    aug.producer_name = model.producer_name
    aug.domain = model.domain
    aug.opset_import.extend(model.opset_import)
    aug.functions.extend(model.functions)
    src = model.graph
    g = aug.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.output.extend(extra_outputs)
    g.value_info.extend(src.value_info)
    g.sparse_initializer.extend(src.sparse_initializer)
    weights = folder / "weights.bin"
    offset = 0
    with weights.open("wb") as f:
        for t in src.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                raise ModelError(
                    f"initializer {t.name!r} refers to external data that is not loaded; load the model with "
                    "qgraph.load_model (or onnx.load with its external data) before calibrating"
                )
            if t.data_type == TensorProto.STRING:
                g.initializer.append(t)
                continue
            raw = t.raw_data if t.HasField("raw_data") else onnx.numpy_helper.to_array(t).tobytes()
            f.write(raw)
            header = TensorProto()
            header.name = t.name
            header.dims.extend(t.dims)
            header.data_type = t.data_type
            for key, value in (
                ("location", "weights.bin"),
                ("offset", str(offset)),
                ("length", str(len(raw))),
            ):
                entry = header.external_data.add()
                entry.key, entry.value = key, value
            header.data_location = TensorProto.EXTERNAL
            g.initializer.append(header)
            offset += len(raw)
            del raw
    path = folder / "model.onnx"
    path.write_bytes(aug.SerializeToString())
    return path


class _Held:
    """Holds one reduced scalar until the last one of its tensor arrives."""

    def __init__(self) -> None:
        self.value: npt.NDArray[Any] = np.zeros((), np.float32)

    def update(self, x: npt.ArrayLike, sample_index: int | None = None) -> None:
        self.value = np.asarray(x).reshape(())


class _FoldMinMax:
    """Receives a tensor's element count last: keeps the running [min, max] as two floats (no per-sample
    numpy work) and folds them into the real observer once, in `finish`."""

    def __init__(self, observer: Observer, lo: _Held, hi: _Held) -> None:
        self.observer, self.lo, self.hi = observer, lo, hi
        self.vmin, self.vmax = math.inf, -math.inf
        self.values = 0
        self.updates = 0

    def update(self, x: npt.ArrayLike, sample_index: int | None = None) -> None:
        size = int(np.asarray(x))
        self.updates += 1
        if size == 0:
            return
        lo, hi = float(self.lo.value), float(self.hi.value)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            where = "" if sample_index is None else f" in sample {sample_index}"
            raise DataError(f"tensor {self.observer.name!r} contains NaN or Inf values{where}")
        self.vmin, self.vmax = min(self.vmin, lo), max(self.vmax, hi)
        self.values += size

    def finish(self) -> None:
        """Fold the accumulated range into the observer, with its true value and update counts."""
        if self.values == 0:
            return
        self.observer.update(np.array([self.vmin, self.vmax], dtype=np.float64))
        self.observer.num_values += self.values - 2
        self.observer.num_updates += self.updates - 1


def _in_graph_minmax(
    model: onnx.ModelProto, observers: Mapping[str, Observer]
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """A copy of ``model`` with ReduceMin/ReduceMax/Size of every observed tensor, and their feeders."""
    reduced = onnx.ModelProto()
    reduced.CopyFrom(model)
    feeders: dict[str, Any] = {}
    for name, obs in observers.items():
        lo, hi = _Held(), _Held()
        outs = [f"{name}/qgraph_min", f"{name}/qgraph_max", f"{name}/qgraph_size"]
        reduced.graph.node.append(onnx.helper.make_node("ReduceMin", [name], [outs[0]], keepdims=0))
        reduced.graph.node.append(onnx.helper.make_node("ReduceMax", [name], [outs[1]], keepdims=0))
        reduced.graph.node.append(onnx.helper.make_node("Size", [name], [outs[2]]))
        feeders.update({outs[0]: lo, outs[1]: hi, outs[2]: _FoldMinMax(obs, lo, hi)})
    return reduced, feeders
