"""Run a float model in onnxruntime over calibration data and fold activations into observers.

Two paths, one result (:func:`collect_ranges` picks):

* **In-graph** (plain per-tensor ``minmax``, the default method): onnxruntime reduces every tensor to
  its min, max, size and a NaN/Inf sentinel inside the graph and returns a few small vectors per run
  (:mod:`qgraph.calibrate.reduce`); ranges of Relu/Clip/reshape outputs of calibrated tensors are
  derived exactly from their inputs'.  Python work per run is O(1) numpy calls.
* **Fetch** (histogram methods, per-channel, moving average): the requested tensors become extra graph
  outputs (name and, when known, element type; no shape, so dynamic batch/sequence/spatial sizes work)
  and each batch's values are folded into the observers immediately and then dropped.

Either way memory is one batch's activations plus the observers' bounded state, independent of the
number of samples, and every method needs a **single pass** over the data (histograms are
batching-invariant and re-gridded exactly as ranges grow, :mod:`qgraph.calibrate.histogram`).
Graphs too long for one onnxruntime session run in segments (:mod:`qgraph.runtime.segments`).

Sessions use onnxruntime's full graph optimizations (``optimize=True``): the graph being measured is
the one a float deployment runs, and calibration costs about what inference costs.  Requested tensors
are graph outputs or reduction inputs, so no fusion removes them; kernels may round differently from
the unoptimized graph (ranges move by ~1e-7 relative).  ``optimize=False`` reproduces onnxruntime's own
calibrators, which disable optimizations, bit for bit.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import onnx

from qgraph.calibrate.auto import AutoChoice, AutoObserver
from qgraph.calibrate.feeds import DataLike, Hasher, feeds_of, open_data, run_session, session_inputs
from qgraph.calibrate.observers import HistogramSummary, MinMaxObserver, Observer
from qgraph.calibrate.reduce import MIN_OPSET, InGraphMinMax, MinMaxState, plan_derivations, resolve_ranges
from qgraph.calibrate.registry import make_observer
from qgraph.calibrate.robust import PER_UPDATE, RobustMagnitude
from qgraph.calibrate.session import (
    LARGE_MODEL_BYTES,
    Additions,
    calibration_session,
    fetch_outputs,
    session_options,
)
from qgraph.errors import DataError, ModelError
from qgraph.graph.detach import with_weights
from qgraph.graph.opsets import model_opset
from qgraph.quant.math import ActivationRange
from qgraph.runtime.parallel import array_bytes, ordered_map
from qgraph.runtime.segments import observe_segmented, segmentable

ProgressCallback = Callable[[int, int | None], None]

__all__ = ["LARGE_MODEL_BYTES", "TensorCalibration", "collect_ranges", "observe"]


class Updatable(Protocol):
    """What :func:`observe` feeds: any :class:`Observer`, or a duck-typed tee of several."""

    def update(self, x: npt.NDArray[Any], sample_index: int | None = None, /) -> None: ...


@dataclass(frozen=True, eq=False)
class TensorCalibration:
    """Calibration result of one tensor.

    Attributes:
        name: tensor name.
        method: observer method (``minmax``, ``percentile``, ``entropy``, ``mse``, ``auto``).
        axis: channel axis, or ``None`` per tensor.
        range: chosen range (what the quantizer should use).
        observed: exact observed ``[min, max]``.
        clip_fraction: fraction of observed values outside ``range``.
        num_values: number of scalar values observed.
        num_updates: number of batches observed.
        histogram: compact histogram (per-tensor histogram methods only).
        options: observer options.
        robust_absmax: the ``robust_percentile`` of ``|x|`` (:mod:`qgraph.calibrate.robust`), when asked for;
            ``max|x| / robust_absmax`` is the tensor's outlier ratio.
        choice: for ``method: auto``, the winning candidate and every candidate's range and expected error.
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
    robust_absmax: float | None = None
    choice: AutoChoice | None = None

    @property
    def chosen_method(self) -> str:
        """The method whose range this is: the winning candidate under ``auto``, else ``method``."""
        return self.choice.winner if self.choice is not None else self.method

    @classmethod
    def from_observer(cls, obs: Observer, robust: RobustMagnitude | None = None) -> TensorCalibration:
        """Summarize a fed observer (and its robust magnitude estimate)."""
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
            robust_absmax=robust.value() if robust is not None else None,
            choice=obs.choice() if isinstance(obs, AutoObserver) else None,
        )


class _Tee:
    """Feeds an observer and its robust magnitude (or another observer) from one onnxruntime run."""

    def __init__(self, main: Updatable, aux: Updatable) -> None:
        self.main, self.aux = main, aux

    def update(self, x: npt.NDArray[Any], sample_index: int | None = None) -> None:
        self.main.update(x, sample_index)
        self.aux.update(x, sample_index)


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
    robust_percentile: float | None = None,
    optimize: bool = True,
    weights: Mapping[str, npt.NDArray[Any]] | None = None,
    extra: Mapping[str, Updatable] | None = None,
) -> dict[str, TensorCalibration]:
    """Calibrate ``tensor_names`` of ``model`` on ``data`` with one observer per tensor.

    Args:
        model: float model with its weights loaded (not modified).
        tensor_names: graph inputs or outputs of top-level nodes.
        data: feed dicts ``{input name: array}``, or a zero-argument callable returning them.
            Shapes may vary between feeds (dynamic axes).  Read once.
        method: ``minmax``, ``percentile``, ``entropy``, ``mse`` or ``auto`` (per tensor, the candidate with
            the smallest expected quantization error, :mod:`qgraph.calibrate.auto`).
        options: observer options (see :mod:`qgraph.calibrate.observers`).
        per_channel_axes: ``{tensor: axis}`` for per-channel ranges.
        progress: called after each feed with ``(feeds done, total or None)``.
        providers: onnxruntime execution providers (default CPU).
        data_hasher: updated with every feed (names, dtypes, shapes, bytes -- the same scheme
            as ``qgraph.data.DataSource.fingerprint``) to fingerprint the data in the same pass.
        large_model_bytes: serialized size above which external data is used.
        robust_percentile: also estimate this percentile of ``|x|`` per tensor (outlier ratio).
        optimize: run with onnxruntime's graph optimizations (module docstring).
        weights: values of the placeholders when ``model`` is a weightless export
            (`qgraph.GraphHandle.weightless_export`): sessions read them in place, no serialized copy is made.
        extra: further observers ``{tensor: observer}`` (e.g. a per-channel `MinMaxObserver` of a tensor that is
            also calibrated per tensor) fed in the same pass over the data (the fetch path); read them afterwards.

    Raises:
        ModelError: unknown tensor, initializer, or tensor inside a subgraph.
        DataError: empty data, wrong input names, onnxruntime failure or NaN/Inf in a tensor.
        ValueError: unknown method or option.
    """
    axes = dict(per_channel_axes or {})
    opts = dict(options or {})
    observers = {name: make_observer(method, name, axes.get(name), **opts) for name in tensor_names}
    robust = {name: RobustMagnitude(robust_percentile) for name in observers} if robust_percentile else {}
    _check_tensors(model, list(observers))
    run = _Run(progress, providers, data_hasher, large_model_bytes, optimize, weights)
    side = dict(extra or {})
    if side:
        _check_tensors(model, list(side))
    if method == "minmax" and not axes and not side and not opts.get("moving_average") and _in_graph_ok(model):
        minmax = {k: v for k, v in observers.items() if isinstance(v, MinMaxObserver)}
        if _collect_in_graph(model, minmax, robust, data, run):
            return {n: TensorCalibration.from_observer(o, robust.get(n)) for n, o in observers.items()}
    feeders: dict[str, Updatable] = {n: _Tee(o, robust[n]) if n in robust else o for n, o in observers.items()}
    for name, obs in side.items():
        feeders[name] = _Tee(feeders[name], obs) if name in feeders else obs
    observe(model, feeders, data, progress=progress, providers=providers, data_hasher=data_hasher,
            large_model_bytes=large_model_bytes, optimize=optimize, weights=weights)
    return {n: TensorCalibration.from_observer(o, robust.get(n)) for n, o in observers.items()}


@dataclass(frozen=True)
class _Run:
    """How to run: progress callback, providers, data hasher, external-data threshold, optimizations."""

    progress: ProgressCallback | None
    providers: Sequence[str] | None
    data_hasher: Hasher | None
    large_model_bytes: int
    optimize: bool
    weights: Mapping[str, npt.NDArray[Any]] | None = None


def _in_graph_ok(model: onnx.ModelProto) -> bool:
    opset = model_opset(model, 0)
    return opset >= MIN_OPSET and not segmentable(model)


def _collect_in_graph(
    model: onnx.ModelProto,
    observers: Mapping[str, MinMaxObserver],
    robust: Mapping[str, RobustMagnitude],
    data: DataLike,
    run: _Run,
) -> bool:
    """The in-graph path (module docstring); False, having read no data, when onnxruntime cannot load the
    reductions (an op or dtype it lacks a kernel for): the caller then takes the fetch path."""
    names = list(observers)
    derived = plan_derivations(model, names, keep_order=bool(robust))
    sources = [n for n in names if n not in derived]
    position = {s: i for i, s in enumerate(sources)}
    derived_subs = [(d, n, d.root) for n, d in derived.items() if n in robust and d.root is not None and d.same_order]
    state = MinMaxState(len(sources))
    zeroed: frozenset[str] = frozenset()
    source, total = open_data(data)
    feeds: Iterator[tuple[int, dict[str, Any]]] | None = None
    while True:  # one session; rebuilt (rarely) when a tensor's sentinel sum overflows
        reduction = InGraphMinMax(model, sources, subsample=PER_UPDATE if robust else None, zeroed=zeroed)
        additions = Additions(reduction.nodes, reduction.initializers, reduction.output_infos())
        with ExitStack() as stack:
            try:
                sess = stack.enter_context(calibration_session(
                    model, additions, optimize=run.optimize, providers=run.providers,
                    large_model_bytes=run.large_model_bytes, weights=run.weights,
                ))
            except ModelError:
                if feeds is not None:
                    raise
                return False
            if feeds is None:
                feeds = feeds_of(source, session_inputs(sess), run.data_hasher)
            overflowing: list[str] = []
            pulled: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()
            for index, arrays, outputs in ordered_map(_reduced(sess, reduction.outputs), _recorded(feeds, pulled)):
                pulled.popleft()
                r = reduction.split(outputs)
                certain, maybe = r.suspects()
                if certain:
                    _non_finite([sources[i] for i in certain], index)
                overflowing = _confirm(model, [sources[i] for i in maybe], arrays, index, run)
                state.fold(r)
                for src, sub in zip(sources, r.subsamples, strict=False):
                    robust[src].add_subsample(sub)
                for d, name, root in derived_subs:
                    robust[name].add_subsample(d.apply_values(r.subsamples[position[root]]))
                if run.progress is not None:
                    run.progress(index + 1, total)
                if overflowing:
                    zeroed = zeroed | frozenset(overflowing)
                    break
            # samples read ahead for runs of a session now replaced: the next session runs them first
            feeds = itertools.chain(list(pulled), feeds)
        if not overflowing:
            break
    measured = {s: (float(state.lo[i]), float(state.hi[i]), int(state.num_values[i])) for i, s in enumerate(sources)}
    for src, (lo, hi, n) in measured.items():
        observers[src].fold_range(lo, hi, n, state.num_updates)
    for name, (lo, hi, n) in resolve_ranges(derived, measured).items():
        observers[name].fold_range(lo, hi, n, state.num_updates)
    return True


def _non_finite(names: list[str], index: int) -> None:
    shown = ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")
    raise DataError(
        f"tensor {shown} contains NaN or Inf values in sample {index}: calibration needs finite activations; "
        "check that sample's input data and the ops producing the tensor"
    )


def _confirm(model: onnx.ModelProto, names: list[str], arrays: Mapping[str, Any], index: int, run: _Run) -> list[str]:
    """Tell NaN from an overflowing sentinel sum by fetching ``names`` for this feed; returns the overflowing."""
    if not names:
        return []
    with calibration_session(model, Additions(outputs=fetch_outputs(model, names)), optimize=run.optimize,
                             providers=run.providers, large_model_bytes=run.large_model_bytes,
                             weights=run.weights) as sess:
        values = run_session(sess, names, arrays, index)
    nan = [n for n, v in zip(names, values, strict=True) if not np.isfinite(np.asarray(v)).all()]
    if nan:
        _non_finite(nan, index)
    return names


def observe(
    model: onnx.ModelProto,
    observers: Mapping[str, Updatable],
    data: DataLike,
    *,
    progress: ProgressCallback | None = None,
    providers: Sequence[str] | None = None,
    data_hasher: Hasher | None = None,
    large_model_bytes: int = LARGE_MODEL_BYTES,
    optimize: bool = True,
    weights: Mapping[str, npt.NDArray[Any]] | None = None,
) -> int:
    """Feed every tensor named in ``observers`` (any mix of observer types, or anything with
    ``update(x, sample_index)``) for all of ``data``; returns the number of feeds processed.

    Lower-level form of :func:`collect_ranges` (always the fetch path).  Graphs longer than
    :data:`qgraph.runtime.segments.SEGMENT_THRESHOLD` nodes run in segments.
    """
    _check_tensors(model, list(observers))
    inits = {t.name for t in model.graph.initializer}
    graph_inputs = [vi.name for vi in model.graph.input if vi.name not in inits]
    source, total = open_data(data)
    if segmentable(model):
        if weights:  # segments build their own sessions from protobufs: give them the weights
            model = with_weights(model, weights)
        validated = (arrays for _, arrays in feeds_of(source, set(graph_inputs), data_hasher))
        shown = (lambda done, of: progress(done, total if total is not None else of)) if progress is not None else None
        return observe_segmented(model, observers, validated, optimization=session_options(optimize)
                                 .graph_optimization_level, providers=providers, progress=shown)
    from_feed = [n for n in observers if n in graph_inputs]
    fetch = [n for n in observers if n not in graph_inputs]
    done = 0
    with calibration_session(model, Additions(outputs=fetch_outputs(model, fetch)), optimize=optimize,
                             providers=providers, large_model_bytes=large_model_bytes, weights=weights) as sess:
        feeds = feeds_of(source, session_inputs(sess), data_hasher)
        # several samples run at once; the observers see them one by one, in order, in this thread
        # (a sample's fetched activations can be large: at most ~1 GB of them are in flight, `IN_FLIGHT_BYTES`)
        runs = (ordered_map(_reduced(sess, fetch), feeds, size_of=lambda r: array_bytes(r[2]))
                if fetch else ((i, a, []) for i, a in feeds))
        for index, arrays, outputs in runs:
            for name in from_feed:
                observers[name].update(arrays[name], index)
            for name, value in zip(fetch, outputs, strict=True):
                observers[name].update(np.asarray(value), index)
            del outputs
            done = index + 1
            if progress is not None:
                progress(done, total)
    return done


def _recorded(feeds: Iterator[tuple[int, dict[str, Any]]],
          pulled: collections.deque[tuple[int, dict[str, Any]]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``feeds``, each also appended to ``pulled`` as it is read (the consumer pops it once used)."""
    for item in feeds:
        pulled.append(item)
        yield item


def _reduced(sess: Any, outputs: list[str]) -> Callable[[tuple[int, dict[str, Any]]],
                                                       tuple[int, dict[str, Any], list[Any]]]:
    """A function running ``sess`` for ``outputs`` on an ``(index, feed)``: ``(index, feed, values)``."""

    def run(item: tuple[int, dict[str, Any]]) -> tuple[int, dict[str, Any], list[Any]]:
        return item[0], item[1], run_session(sess, outputs, item[1], item[0])
    return run


def _check_tensors(model: onnx.ModelProto, names: list[str]) -> None:
    inits = {t.name for t in model.graph.initializer}
    inputs = {vi.name for vi in model.graph.input if vi.name not in inits}
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
