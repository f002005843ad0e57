"""Running models in onnxruntime and comparing their outputs (used by ``--verify``, diff and reports).

Metrics, for a reference ``r`` and a candidate ``c`` of the same shape:

- max abs error ``max|c - r|`` and its ratio to the output scale ``max|r|`` (the ``--verify`` criterion:
  ``max|c - r| <= tol * max|r|``, tol = 1e-5 by default, raised to the model's noise floor: `qgraph.pipeline.verify`);
- cosine similarity ``<c, r> / (|c| |r|)``;
- SQNR in dB ``10 log10(sum r² / sum (c - r)²)`` (inf when identical).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from qgraph.data import Feed, model_inputs
from qgraph.errors import DataError, ModelError, QGraphError, VerificationError
from qgraph.graph.detach import fill_nested, placeholders_as_inputs
from qgraph.io.model_io import PROTOBUF_LIMIT, save_model
from qgraph.runtime.parallel import ordered_map
from qgraph.runtime.part import OutputPart

#: What onnxruntime raises when a session cannot be built or run (they derive from Exception, not RuntimeError).
ORT_ERRORS: tuple[type[Exception], ...] = (ort_state.Fail, ort_state.RuntimeException, ort_state.InvalidArgument,
                                           ort_state.NotImplemented, ort_state.InvalidGraph)


def make_session(
    model: onnx.ModelProto | str | Path,
    *,
    optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    threads: int = 1,
    optimized_model_path: str | None = None,
    mem_pattern: bool = True,
    weights: Mapping[str, np.ndarray] | None = None,
) -> ort.InferenceSession:
    """An onnxruntime CPU session for ``model`` (models over 2 GB go through a temporary file).

    ``weights`` gives the values of a weightless model's placeholders (`qgraph.GraphHandle.weightless_export`):
    they become graph inputs fed from these arrays on every run (`WeightFedSession`), read in place: neither the
    protobuf, its serialized bytes nor the session hold a copy.

    ``mem_pattern=False`` turns off onnxruntime's pre-planned allocation of a whole run: with many extra outputs
    or branches it holds every intermediate at once (measured: 610 MB vs 384 MB on a 672-node detector)."""
    opts = ort.SessionOptions()
    opts.enable_mem_pattern = mem_pattern
    opts.graph_optimization_level = optimization
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    if optimized_model_path:
        opts.optimized_model_filepath = optimized_model_path
    if weights and not isinstance(model, (str, Path)):
        # placeholders inside If/Loop bodies get their values written in (a body's initializer cannot be fed)
        model, weights = fill_nested(model, weights)
    try:
        if weights and not isinstance(model, (str, Path)):
            fed = placeholders_as_inputs(model).SerializeToString()
            return WeightFedSession(ort.InferenceSession(fed, opts, providers=["CPUExecutionProvider"]), weights)
        if isinstance(model, (str, Path)):
            return ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
        if model.ByteSize() < PROTOBUF_LIMIT - (16 << 20):
            return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        with tempfile.TemporaryDirectory() as tmp:
            path = save_model(model, Path(tmp) / "model.onnx", external_data=True)
            return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ModelError(f"onnxruntime cannot load the model: {exc}") from exc


class WeightFedSession(ort.InferenceSession):  # type: ignore[misc]  # onnxruntime ships no types
    """A session whose large weights are graph inputs, fed from the caller's arrays on every run.

    onnxruntime reads a fed array in place, while it copies initializers given through ``add_external_initializers``
    into the session (measured with onnxruntime 1.31: one more copy of the weights per session). ``get_inputs``
    lists the data inputs only and ``run`` adds the weights to the feed; everything else is the wrapped session's
    (attribute lookups fall through to it, so the base class's methods run on its state)."""

    def __init__(self, session: ort.InferenceSession, weights: Mapping[str, np.ndarray]) -> None:
        # not super().__init__: this wraps a built session rather than building one
        self.session = session
        self.weights = {name: np.ascontiguousarray(value) for name, value in weights.items()}

    def get_inputs(self) -> list[Any]:
        """The session's inputs without the weights."""
        return [i for i in self.session.get_inputs() if i.name not in self.weights]

    def run(self, output_names: Any, input_feed: Any, run_options: Any = None) -> Any:
        """``session.run`` with the weights added to ``input_feed``."""
        return self.session.run(output_names, {**input_feed, **self.weights}, run_options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["session"], name)


def run(session: ort.InferenceSession, feed: Feed, outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Run ``session`` on ``feed``; returns output name -> array (bfloat16 inputs are passed as OrtValues)."""
    names = list(outputs) if outputs is not None else [o.name for o in session.get_outputs()]
    return dict(zip(names, session_run(session, names, feed), strict=True))


def _run_side(session: ort.InferenceSession, feed: Feed, which: str, error: type[QGraphError]) -> dict[str, np.ndarray]:
    """`run`, with onnxruntime's failure (a MatMul dimension mismatch on inputs whose sizes were guessed) as
    ``error`` naming the inputs it was given and what to give instead."""
    try:
        return run(session, feed)
    except (ort_state.Fail, ort_state.RuntimeException, ort_state.InvalidArgument) as exc:
        given = ", ".join(f"{k}: {getattr(v, 'dtype', '?')}{list(np.shape(v))}" for k, v in feed.items())
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise error(f"onnxruntime cannot run {which} on the inputs it was given ({given}): {reason}. Without data, "
                    "inputs are random with every symbolic or undeclared size set to 1, which the model may not "
                    "accept: give data whose samples have the sizes the model expects (--calibration-data, "
                    "--eval-data).") from None


def session_run(session: ort.InferenceSession, names: Sequence[str], feed: Mapping[str, Any]) -> list[Any]:
    """``session.run(names, feed)`` for every input dtype numpy can hold (bfloat16 included), as arrays."""
    # Inputs a pass fixed to constants (specialize_inputs) may still be in the data: the model no longer takes them.
    known = {i.name for i in session.get_inputs()}
    values = session.run(list(names), {k: _ort_input(v) for k, v in feed.items() if k in known})
    # Sequence outputs come back as lists and empty optionals as None: keep them as they are.
    return [v if v is None or isinstance(v, list) else np.asarray(v) for v in values]


def session_runs(session: Any, names: Sequence[str], feeds: Iterable[Mapping[str, Any]]) -> Iterator[list[Any]]:
    """`session_run` on every feed, in order, several at once (`qgraph.runtime.parallel.ordered_map`): for sessions
    of one intra-op thread (`make_session`'s default), which then give the bits of one run after another. A
    session with ``run_many`` (`qgraph.runtime.sliced.SlicedSession`) runs the feeds itself."""
    run_many = getattr(session, "run_many", None)
    if run_many is not None:
        return iter(run_many(names, list(feeds)))
    return ordered_map(lambda feed: session_run(session, names, feed), feeds)


def _ort_input(value: np.ndarray) -> Any:
    # onnxruntime's Python binding has no numpy dtype for bfloat16: hand it the bits with the ONNX type.
    if getattr(value, "dtype", None) is not None and value.dtype.name == "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            np.ascontiguousarray(value).view(np.uint16), onnx.TensorProto.BFLOAT16
        )
    return value


def random_feeds(
    model: onnx.ModelProto,
    n: int = 2,
    seed: int = 0,
    dynamic_dim: int = 1,
    *,
    dims: Mapping[str, int] | None = None,
    int_high: int = 2,
) -> list[Feed]:
    """Seeded random feeds matching the model's declared inputs.

    Float inputs are standard normal, integer inputs uniform in ``[0, int_high)`` (small, so index-like
    inputs stay valid), bool inputs fair coins, anything else zeros. Symbolic dims named in ``dims``
    (e.g. ``{"seq": 16}``) take that size; other dynamic dims take ``dynamic_dim``.
    """
    rng = np.random.default_rng(seed)
    specs = model_inputs(model)
    feeds: list[Feed] = []
    for _ in range(n):
        feed: Feed = {}
        for spec in specs:
            # No declared shape: a 1-element vector is the smallest guess (the error says what to give if wrong).
            shape = tuple(
                d if isinstance(d, int) and d >= 0
                else int(dims[d]) if isinstance(d, str) and dims is not None and d in dims
                else dynamic_dim
                for d in (spec.shape if spec.shape is not None else (None,))
            )
            kind = spec.dtype.kind
            if kind == "f" or spec.dtype.name == "bfloat16":
                value = rng.standard_normal(shape, dtype=np.float32).astype(spec.dtype)
            elif kind in "iu":
                value = rng.integers(0, int_high, size=shape).astype(spec.dtype)
            elif kind == "b":
                value = np.asarray(rng.random(shape) < 0.5)
            elif kind in "US":
                value = np.full(shape, "a", dtype=object)
            else:
                value = np.zeros(shape, dtype=spec.dtype)
            # A sequence gets one element; a present optional holds its value (onnxruntime takes both as is).
            feed[spec.name] = [value] if "sequence" in spec.containers else value  # type: ignore[assignment]
        feeds.append(feed)
    return feeds


@dataclass(frozen=True)
class TensorDiff:
    """How far a candidate tensor is from its reference."""

    name: str
    max_abs: float
    scale: float  # max|reference|
    cosine: float
    sqnr_db: float
    #: Elements that are NaN or infinite in the reference / the candidate: never "no error".
    nonfinite_reference: int = 0
    nonfinite_candidate: int = 0
    #: Samples compared (0 means nothing was measured: not a perfect match).
    samples: int = 1
    #: The part of a graph output this diff measures (`qgraph.runtime.output_parts`); None: the whole tensor ``name``.
    part: OutputPart | None = None
    #: Values compared (finite in both; None: not counted). 0 with samples > 0: every output was empty, so nothing
    #: was measured and "relative error 0" would be a false "verified".
    values: int | None = None

    @property
    def output(self) -> str:
        """The graph output this diff belongs to (``name`` unless it measures a part of one)."""
        return self.part.output if self.part is not None else self.name

    @property
    def finite(self) -> bool:
        """Whether both models produced only finite values for this tensor."""
        return not (self.nonfinite_reference or self.nonfinite_candidate)

    @property
    def relative(self) -> float:
        """``max_abs / max|reference|`` (max_abs itself when the reference is all zeros; inf with non-finite
        values)."""
        if not self.finite:
            return math.inf
        return self.max_abs / self.scale if self.scale > 0 else self.max_abs

    def problem(self) -> str | None:
        """A sentence naming non-finite values, or None."""
        if self.finite:
            return None
        return (f"output {self.name!r} holds non-finite values (NaN/Inf): {self.nonfinite_reference} in the "
                f"reference, {self.nonfinite_candidate} in the candidate")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "name": self.name,
            "max_abs": self.max_abs,
            "scale": self.scale,
            "relative": self.relative,
            "cosine": self.cosine,
            "sqnr_db": self.sqnr_db,
            "nonfinite_reference": self.nonfinite_reference,
            "nonfinite_candidate": self.nonfinite_candidate,
            "samples": self.samples,
            **({"part": self.part.to_dict()} if self.part is not None else {}),
        }


def _flat_output(value: Any, name: str) -> np.ndarray:
    """An output as one float64 array: a sequence's elements raveled end to end, an empty optional as size 0."""
    if value is None:
        return np.zeros(0)
    if isinstance(value, list):
        parts = [np.ravel(np.asarray(v, dtype=np.float64)) for v in value]
        return np.concatenate(parts) if parts else np.zeros(0)
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):  # strings and other non-numeric outputs: equal or not
        return np.zeros(0)


class DiffAccumulator:
    """Streams (reference, candidate) pairs of one tensor into the metrics above in O(1) memory."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.max_abs = 0.0
        self.scale = 0.0
        self.dot = 0.0
        self.ref_sq = 0.0
        self.cand_sq = 0.0
        self.err_sq = 0.0
        self.bad_ref = 0
        self.bad_cand = 0
        self.samples = 0
        self.values = 0

    def add(self, reference: Any, candidate: Any) -> None:
        """Fold one pair of outputs (arrays of the same shape; sequences and optionals are flattened) into the
        metrics."""
        r = _flat_output(reference, self.name)
        c = _flat_output(candidate, self.name)
        if r.shape != c.shape:
            raise ValueError(f"{self.name}: shapes differ {r.shape} vs {c.shape}")
        self.samples += 1
        if r.size == 0:
            return
        ok_r, ok_c = np.isfinite(r), np.isfinite(c)
        if not (ok_r.all() and ok_c.all()):
            # Count them, and measure the rest: max(0.0, nan) is 0.0, so NaN must never reach the reductions.
            self.bad_ref += int(r.size - np.count_nonzero(ok_r))
            self.bad_cand += int(c.size - np.count_nonzero(ok_c))
            both = ok_r & ok_c
            r, c = r[both], c[both]
            if r.size == 0:
                return
        self.values += int(r.size)
        err = c - r
        self.max_abs = max(self.max_abs, float(np.max(np.abs(err))))
        self.scale = max(self.scale, float(np.max(np.abs(r))))
        self.dot += float(np.sum(r * c))
        self.ref_sq += float(np.sum(r * r))
        self.cand_sq += float(np.sum(c * c))
        self.err_sq += float(np.sum(err * err))

    def result(self) -> TensorDiff:
        """The accumulated metrics."""
        denom = math.sqrt(self.ref_sq * self.cand_sq)
        cosine = self.dot / denom if denom > 0 else (1.0 if self.err_sq == 0 else 0.0)
        if self.err_sq == 0:
            sqnr = math.inf
        elif self.ref_sq == 0:
            sqnr = -math.inf
        else:
            sqnr = 10.0 * math.log10(self.ref_sq / self.err_sq)
        if self.bad_ref or self.bad_cand:
            cosine, sqnr = math.nan, math.nan
        return TensorDiff(self.name, self.max_abs, self.scale, cosine, sqnr, self.bad_ref, self.bad_cand, self.samples,
                          values=self.values)


def compare_models(
    reference: onnx.ModelProto | ort.InferenceSession,
    candidate: onnx.ModelProto | ort.InferenceSession,
    feeds: Iterable[Feed],
) -> list[TensorDiff]:
    """Run both models on ``feeds`` and compare every output by position (names may differ)."""
    ref_sess = reference if isinstance(reference, ort.InferenceSession) else make_session(reference)
    cand_sess = candidate if isinstance(candidate, ort.InferenceSession) else make_session(candidate)
    ref_names = [o.name for o in ref_sess.get_outputs()]
    cand_names = [o.name for o in cand_sess.get_outputs()]
    if len(ref_names) != len(cand_names):
        raise ModelError(f"the models have {len(ref_names)} and {len(cand_names)} outputs; cannot compare.")
    accs = [DiffAccumulator(n) for n in ref_names]
    count = 0
    for feed in feeds:
        ref = _run_side(ref_sess, feed, "the reference model", DataError)
        cand = _run_side(cand_sess, feed, "the candidate model", VerificationError)
        for acc, rn, cn in zip(accs, ref_names, cand_names, strict=True):
            try:
                acc.add(ref[rn], cand[cn])
            except ValueError as exc:  # the two models disagree on an output's shape: a result, not a crash
                raise VerificationError(f"the models' outputs do not have the same shape: {exc}") from None
        count += 1
    if count == 0:
        raise DataError("no samples to compare: the data is empty. Give at least one sample.")
    return [a.result() for a in accs]
