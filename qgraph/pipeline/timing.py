"""What each pass of a run costs, against one float inference pass over the calibration data.

Accuracy techniques (equalization, SmoothQuant, bias correction, rounding optimization, range tuning, fallback
search) and calibration itself cost time; the budget a demanding user can accept is a small multiple of what the
float model costs to run over the calibration data once (issue #13: at most 10x; issue #34: the yardstick must be
something no pass can slow down). `measure_float_inference` times that float pass apart from every pass (its own
onnxruntime session, created outside the timed span, in slices on a long graph, on at most `MAX_TIMED_SAMPLES`
samples or about `MAX_TIMED_SECONDS`, scaled to the whole data); `run_timing` puts every pass's whole
time (the quantizing pass's calibration included, and also shown on its own) against it, and `Timing.line` is what
the run summary and the report print: the multiples, the passes over `BUDGET`, and which pass dominated the run.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from qgraph.errors import DataError, QGraphError
from qgraph.graph.detach import with_weights
from qgraph.pipeline.pass_result import PassResult
from qgraph.runtime.compare import make_session, session_run
from qgraph.runtime.parallel import ordered_map, parallel_runs
from qgraph.runtime.sliced import SlicedSession, sliced_session

#: The multiple of one float inference pass a pass may take before the summary flags it.
BUDGET = 10.0
#: Passes under this multiple are counted, not named, in the summary line.
NEGLIGIBLE = 0.05
#: Passes named in the summary line at most.
SHOWN = 5
#: Samples the float pass is timed on at most (the rest is extrapolated): the yardstick stays cheap on long data.
MAX_TIMED_SAMPLES = 64
#: Seconds after which the float pass stops timing (having timed at least `MIN_TIMED_SAMPLES`): on long inputs
#: (9 s audio clips) the full pass cost as much as a whole accuracy pass, spent only on a yardstick.
MAX_TIMED_SECONDS = 1.0
MIN_TIMED_SAMPLES = 2
#: Weights up to this size are written into the yardstick's own model, so onnxruntime optimizes it as a user's float
#: session would be (PicoDet 1.8 -> 1.1 s, YOLOv8n 0.53 -> 0.38 s, DNSMOS 2.2 -> 1.5 s over the calibration data);
#: larger ones stay shared and fed, without graph optimizations: the copies a session of its own makes (the model,
#: its serialized bytes, onnxruntime's) would raise a large model's peak memory (144 MB of weights: 974 MB peak,
#: against the two model sizes + 300 MB `tests/test_memory.py` holds a run to).
OPTIMIZED_UP_TO_BYTES = 32 << 20


class _Record(Protocol):
    name: str
    seconds: float
    result: PassResult


@dataclass(frozen=True)
class FloatInference:
    """One float inference pass over the calibration data: ``seconds`` (scaled to ``samples_total`` when only
    ``samples_timed`` were run), measured in its own session apart from every pass."""

    seconds: float
    samples_timed: int
    samples_total: int
    runs: int = 1  # samples run at once (`qgraph.runtime.parallel`), as the passes run them
    optimized: bool = True  # with onnxruntime's graph optimizations (`OPTIMIZED_UP_TO_BYTES`)
    slices: int = 1  # sessions the graph ran in (`qgraph.runtime.sliced`: a long graph)

    def describe(self) -> str:
        """How it was measured, for the summary line."""
        part = ("" if self.samples_timed >= self.samples_total
                else f", timed on {self.samples_timed} of {self.samples_total} samples")
        at_once = f", {self.runs} at a time" if self.runs > 1 and self.samples_total > 1 else ""
        how = "" if self.optimized else ", without graph optimizations (weights over 32 MB are not copied for it)"
        how += f", in {self.slices} slices" if self.slices > 1 else ""
        return (f"{self.seconds:.2f} s: the float model over {self.samples_total} calibration sample(s){at_once}"
                f"{part}{how}")


def measure_float_inference(model: onnx.ModelProto, weights: Mapping[str, npt.NDArray[Any]] | None,
                            batches: Iterable[Mapping[str, npt.NDArray[Any]]],
                            max_samples: int = MAX_TIMED_SAMPLES,
                            max_seconds: float = MAX_TIMED_SECONDS) -> FloatInference | None:
    """Time ``model`` (a weightless export and its ``weights``, read in place) over ``batches`` in onnxruntime:
    the session is created outside the timed span; at most ``max_samples`` batches are run (fewer once
    ``max_seconds`` are spent and `MIN_TIMED_SAMPLES` were timed) and the time is scaled to all of them (a stream's
    remaining batches are counted, not run). The batches run as the passes run them: `parallel_runs` at once,
    one intra-op thread each; with onnxruntime's graph optimizations up to `OPTIMIZED_UP_TO_BYTES` of weights.
    A graph over `SLICE_ABOVE` nodes runs as slices (`qgraph.runtime.sliced`), built on an untimed first run:
    one session over it takes more than linear time to build. None when there is no data."""
    stream = iter(batches)
    first = next(stream, None)
    if first is None:
        return None
    batches_left: Iterable[Mapping[str, npt.NDArray[Any]]] = itertools.chain([first], stream)
    session: Any = None
    optimized = sum(int(v.nbytes) for v in (weights or {}).values()) <= OPTIMIZED_UP_TO_BYTES
    if optimized:  # as a user's float session runs it: weights in the model, onnxruntime's optimizations on
        try:
            session = _built(model, weights, first, optimize=True)
        except (QGraphError, ort_state.Fail, ort_state.RuntimeException, ort_state.InvalidArgument,
                ort_state.InvalidGraph):  # an optimizer that refuses the model: time it as the passes run it
            optimized = False
    if session is None:
        try:
            session = _built(model, weights, first, optimize=False)
        except (ort_state.Fail, ort_state.RuntimeException, ort_state.InvalidArgument) as exc:
            raise _data_does_not_fit(first, exc) from None
    names = [o.name for o in session.get_outputs()]

    def run(feed: Mapping[str, npt.NDArray[Any]]) -> None:
        try:
            session_run(session, names, dict(feed))
        except (ort_state.Fail, ort_state.RuntimeException, ort_state.InvalidArgument) as exc:
            raise _data_does_not_fit(feed, exc) from None

    # run as the passes run the model: several samples at once, one per core (`qgraph.runtime.parallel`)
    stream = iter(batches_left)
    read = [0]

    def counted() -> Iterator[Mapping[str, npt.NDArray[Any]]]:
        for feed in itertools.islice(stream, max_samples):
            read[0] += 1
            yield feed

    timed, seconds, start = 0, 0.0, time.perf_counter()
    for _ in ordered_map(run, counted()):
        seconds = time.perf_counter() - start
        timed += 1
        if seconds >= max_seconds and timed >= MIN_TIMED_SAMPLES:
            break
    if timed == 0:
        return None
    if isinstance(batches, Sized):
        total = max(len(batches), timed)
    else:  # a stream: the samples not timed are counted (read, not run), so the time scales to all of them
        total = read[0] + sum(1 for _ in stream)
    return FloatInference(seconds * total / timed, timed, total, parallel_runs(), optimized,
                          int(getattr(session, "slices", 1)))


def _built(model: onnx.ModelProto, weights: Mapping[str, npt.NDArray[Any]] | None,
           first: Mapping[str, npt.NDArray[Any]], optimize: bool) -> Any:
    """The yardstick's session: optimized with the weights written in, or fed them unoptimized. A long graph is
    sliced anywhere (a fusion a cut prevents changes the time of a few nodes, not the scale), its slices' inputs
    typed with the graph's inferred shapes when optimized (the fusions inside a slice read them: untyped, the
    30k-node chain ran 1.8x slower), and its slices are built now, by running ``first`` once, so that building
    stays outside the timed span."""
    def build(m: onnx.ModelProto, w: Mapping[str, npt.NDArray[Any]]) -> Any:
        if optimize:
            return make_session(with_weights(m, w) if w else m, optimization=ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
        return make_session(m, weights=w)

    session = sliced_session(model, build, weights=weights, anywhere=True, typed=optimize)
    if isinstance(session, SlicedSession):
        session_run(session, [o.name for o in session.get_outputs()], first)
    return session


def _data_does_not_fit(feed: Mapping[str, npt.NDArray[Any]], exc: Exception) -> DataError:
    """The input model failing on a calibration sample, before any pass: the data does not fit the model (a
    shapeless input takes any shape, and a scalar where a matrix was meant fails only inside a node)."""
    given = ", ".join(f"{k}: {getattr(v, 'dtype', '?')}{list(np.shape(v))}" for k, v in feed.items())
    reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return DataError(f"the input model cannot run on the calibration data (a batch: {given}): {reason}. Nothing was "
                     "changed. Give samples with the shapes the model expects (an input without a declared shape "
                     "takes whatever it is fed; --data-layout samples|batched says how an .npz maps to samples).")


@dataclass(frozen=True)
class PassTime:
    """One pass's seconds and their multiple of the float inference pass; ``calibration``: the seconds of its data
    pass, when it calibrated (included in ``seconds``)."""

    name: str
    seconds: float
    ratio: float
    calibration: float | None = None


@dataclass(frozen=True)
class Timing:
    """The float inference pass and every pass against it (slowest first)."""

    float_inference: FloatInference
    passes: tuple[PassTime, ...]

    @property
    def over_budget(self) -> list[PassTime]:
        """Passes that took more than `BUDGET` float inference passes."""
        return [p for p in self.passes if p.ratio > BUDGET]

    @property
    def dominant(self) -> PassTime | None:
        """The pass that took the longest."""
        return self.passes[0] if self.passes else None

    def _one(self, p: PassTime) -> str:
        cal = (f"; calibration {p.calibration:.1f} s, {p.calibration / self.float_inference.seconds:.1f}x"
               if p.calibration else "")
        return f"{p.name} {p.seconds:.1f} s ({p.ratio:.1f}x{cal})"

    def line(self) -> str:
        """One sentence for the run summary and the report."""
        shown = [p for p in self.passes if p.ratio >= NEGLIGIBLE][:SHOWN]
        rest = len(self.passes) - len(shown)
        names = ", ".join(self._one(p) for p in shown) or "none"
        more = f" (+{rest} more, each {self.passes[len(shown)].ratio:.2f}x or less)" if rest else ""
        over = self.over_budget
        verdict = (f"over {BUDGET:g}x: {', '.join(p.name for p in over)}" if over
                   else f"every pass within {BUDGET:g}x")
        total = sum(p.seconds for p in self.passes)
        top = self.dominant
        dominated = (f"; {top.name} dominated ({100 * top.seconds / total:.0f}% of {total:.1f} s)"
                     if top is not None and total > 0 else "")
        return (f"time against one float inference pass ({self.float_inference.describe()}): "
                f"{names}{more}; {verdict}{dominated}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        fi = self.float_inference
        return {"float_inference_seconds": fi.seconds, "float_samples_timed": fi.samples_timed,
                "float_samples": fi.samples_total, "budget_x": BUDGET,
                "dominant": self.dominant.name if self.dominant else None,
                "passes": [{"pass": p.name, "seconds": p.seconds, "x_float_inference": p.ratio,
                            "calibration_seconds": p.calibration} for p in self.passes]}


def run_timing(records: Sequence[_Record], float_inference: FloatInference | None) -> Timing | None:
    """Every pass's whole time against ``float_inference`` (None when the run measured none: no pass read data)."""
    if float_inference is None or not float_inference.seconds > 0 or not np.isfinite(float_inference.seconds):
        return None
    base = float_inference.seconds
    times = [PassTime(r.name, r.seconds, r.seconds / base, r.result.calibration_seconds) for r in records]
    return Timing(float_inference, tuple(sorted(times, key=lambda p: -p.seconds)))
