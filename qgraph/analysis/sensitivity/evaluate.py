"""Evaluating fallback variants of a QDQ model: evaluation data, one session per variant, worker processes.

`Evaluator` holds the QDQ model, the evaluation batches and the float model's outputs on them; `measure` builds
the variant with given nodes in float (the same rewrite the pass makes), opens one onnxruntime session for it,
runs every batch through it and compares each output with the reference, and each part of an output a final
Concat joins (`qgraph.runtime.output_parts`: `Measurement.scored` is what targets score). `measure_all` measures
independent variants on an executor (`qgraph.runtime.executor`: in this process, in ``jobs`` local worker processes, or
as Ray tasks); each worker receives the evaluator once, and Ctrl-C or the time budget stops the workers at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from qgraph.data import DataSource, Feed, NpzSource, batched, model_inputs, open_data_source
from qgraph.errors import DataError, ModelError
from qgraph.quant.reference_weights import ReferenceWeights
from qgraph.remedy.apply import remedy_model
from qgraph.runtime.compare import TensorDiff, session_run
from qgraph.runtime.executor import Executor, ExecutorSpec, make_executor
from qgraph.runtime.kernels.measure import Kernels, deployed
from qgraph.runtime.output_parts import OutputParts, PartDiffs
from qgraph.runtime.streaming import Recurrence, run_streamed, sequence_starts

Progress = Callable[[int, int], None]


#: Input bytes per evaluation batch at most (see `load_feeds`).
MAX_BATCH_INPUT_BYTES = 1 << 20


def load_feeds(
    spec: str | DataSource,
    model: onnx.ModelProto,
    *,
    samples: int | None = None,
    batch_size: int = 32,
    others: Sequence[onnx.ModelProto] = (),
) -> list[Feed]:
    """Evaluation batches from ``spec``, validated against ``model``.

    Arrays of an ``.npz`` that are not model inputs (e.g. ``labels``) are ignored, so one file can hold the
    inputs and what a user metric needs. Samples are batched along axis 0 when every input's first dimension
    is dynamic in ``model`` and in ``others``, else fed one by one.
    """
    source = open_data_source(spec, samples=samples)
    if isinstance(source, NpzSource):
        wanted = {s.name for s in model_inputs(model)}
        if wanted <= set(source.arrays):
            source.arrays = {k: v for k, v in source.arrays.items() if k in wanted}
    source.bind(model)
    feeds = list(source)
    if not feeds:
        raise DataError(f"{source.description}: no evaluation samples.")
    specs = [s for m in (model, *others) for s in model_inputs(m)]
    dynamic = all(bool(s.shape) and not (isinstance(s.shape[0], int) and s.shape[0] > 0)  # type: ignore[index]
                  for s in specs)
    # Activations are tens of times the input: bound the input bytes of a batch so a batch's activations (what
    # onnxruntime holds, and what per-node statistics fetch) stay near one inference of the model.
    per_sample = max(1, sum(int(v.nbytes) for v in feeds[0].values()))
    batch_size = max(1, min(batch_size, MAX_BATCH_INPUT_BYTES // per_sample))
    return list(batched(feeds, batch_size)) if dynamic and batch_size > 1 else feeds


def first_sample(feed: Feed, model: onnx.ModelProto) -> Feed:
    """The first sample of an evaluation batch: `load_feeds` batches along axis 0 only when every input's first
    dimension is symbolic; otherwise (a recurrent state [2, batch, 128]) the feed is one sample already."""
    batched = all(bool(s.shape) and not (isinstance(s.shape[0], int) and s.shape[0] > 0)  # type: ignore[index]
                  for s in model_inputs(model))
    return {k: v[:1] if batched and v.ndim else v for k, v in feed.items()}


def run_batches(session: ort.InferenceSession, batches: Sequence[Feed]) -> list[list[np.ndarray]]:
    """Outputs per batch (by output position) of ``session`` on ``batches``."""
    names = [o.name for o in session.get_outputs()]
    return [session_run(session, names, feed) for feed in batches]


def concat_outputs(per_batch: list[list[np.ndarray]]) -> list[np.ndarray]:
    """One array per output, batches concatenated along axis 0 (rank-0 outputs stacked)."""
    if not per_batch:
        return []
    out = []
    for i in range(len(per_batch[0])):
        arrays = [b[i] for b in per_batch]
        out.append(np.stack(arrays) if arrays[0].ndim == 0 else np.concatenate(arrays, axis=0))
    return out


@dataclass
class Measurement:
    """One evaluated model: which nodes were in float, output diffs vs the reference, optional outputs, and the
    diffs of the scored parts (`qgraph.runtime.output_parts`: a split output's parts, else the whole output)."""

    nodes: tuple[str, ...]
    diffs: list[TensorDiff]
    outputs: list[np.ndarray] | None
    seconds: float
    parts: list[TensorDiff] = field(default_factory=list)

    @property
    def scored(self) -> list[TensorDiff]:
        """What targets score: the parts' diffs (the whole outputs' when no parts were measured)."""
        return self.parts or self.diffs


class Evaluator:
    """Builds and runs fallback variants of one QDQ model against fixed reference outputs (picklable)."""

    def __init__(
        self,
        qdq: onnx.ModelProto,
        batches: list[Feed],
        reference: list[list[np.ndarray]],
        *,
        keep_outputs: bool = False,
        kernels: Kernels | None = None,
        float_weights: ReferenceWeights | None = None,
        recurrence: Recurrence | None = None,
        starts: Sequence[int] = (),
        remedy: str = "float",
        parts: OutputParts | None = None,
    ) -> None:
        self.qdq = qdq
        #: The scored parts of the outputs (`qgraph.runtime.output_parts`); None: every output whole.
        self.parts = parts
        self.remedy = remedy  # what a chosen node becomes: float, or 16-bit activations (`qgraph.remedy.widen`)
        self.recurrence = recurrence  # streamed: each variant fed its own state (`qgraph.runtime.streaming`)
        self.starts = list(starts)
        self.float_weights = float_weights
        self.batches = batches
        self.reference = reference
        self.keep_outputs = keep_outputs
        #: How each variant runs: the target CPU's arithmetic (`qgraph.runtime.kernels.measure`; default: this host's
        #: deployed kernels).
        self.kernels = kernels or deployed()

    def variant(self, nodes: Sequence[str]) -> onnx.ModelProto:
        """The QDQ model with ``nodes`` fallen back (the model itself when ``nodes`` is empty), their integer
        weights restored from ``float_weights`` when given; with ``remedy="a16w8"`` their activations 16-bit
        (``"a16w16"``: and their weights)."""
        if not nodes:
            return self.qdq
        return remedy_model(self.qdq, nodes, self.remedy, self.float_weights).model

    def run(self, model: onnx.ModelProto, nodes: Sequence[str] = ()) -> Measurement:
        """Run ``model`` on every batch and compare each output with the reference."""
        start = time.perf_counter()
        session = self.kernels.session(model, mem_pattern=False)
        names = [o.name for o in session.get_outputs()]
        if self.recurrence is None:
            per_batch = run_batches(session, self.batches)
        else:
            streamed = run_streamed(session, names, self.batches, self.starts, self.recurrence)
            per_batch = [[r[n] for n in names] for r in streamed]
        if len(names) != len(self.reference[0]):
            raise ModelError(
                f"the QDQ model has {len(names)} outputs but the float model "
                f"{len(self.reference[0])}; they must match by position."
            )
        accs = PartDiffs(self.parts if self.parts is not None else OutputParts.whole(names), names)
        for ref, cand in zip(self.reference, per_batch, strict=True):
            accs.add(ref, cand)
        outputs = concat_outputs(per_batch) if self.keep_outputs else None
        return Measurement(tuple(nodes), accs.whole(), outputs, time.perf_counter() - start, accs.scored())

    def measure(self, nodes: Sequence[str]) -> Measurement:
        """`run` on the variant with ``nodes`` in float."""
        return self.run(self.variant(nodes), nodes)


# ----------------------------------------------------------------------------- many variants
def _measure(evaluator: Evaluator, nodes: tuple[str, ...]) -> Measurement:
    return evaluator.measure(nodes)


def measure_all(
    evaluator: Evaluator,
    node_sets: Sequence[tuple[str, ...]],
    *,
    jobs: int = 1,
    deadline: float | None = None,
    progress: Progress | None = None,
    executor: ExecutorSpec | Executor | None = None,
) -> list[Measurement]:
    """Measure every node set (one session each) on ``executor`` (default: ``jobs`` local processes).

    The evaluator (QDQ model, batches, reference outputs) goes to each worker once, not per node set.
    Measurements come back in ``node_sets`` order; at ``deadline`` the search's budget is spent and only the
    finished ones are returned (still in order). An executor given as a spec is created and closed here."""
    run = make_executor(executor, jobs)
    try:
        return run.map(_measure, list(node_sets), shared=evaluator, progress=progress, deadline=deadline)
    finally:
        if run is not executor:
            run.close()


def reference_outputs(
    reference: onnx.ModelProto, batches: Sequence[Feed], kernels: Kernels | None = None
) -> list[list[np.ndarray]]:
    """The float model's outputs per batch (with ``kernels``; default: this host's deployed kernels)."""
    return run_batches((kernels or deployed()).session(reference), batches)


def streamed_reference_outputs(reference: onnx.ModelProto, feeds: Sequence[Feed], recurrence: Recurrence,
                               kernels: Kernels | None = None) -> tuple[list[list[np.ndarray]], list[int]]:
    """The float model's outputs per sample run streamed (`qgraph.runtime.streaming`), and where its sequences start."""
    session = (kernels or deployed()).session(reference)
    names = [o.name for o in session.get_outputs()]
    chunk = [dict(zip(names, out, strict=True)) for out in run_batches(session, feeds)]
    starts = sequence_starts(recurrence, feeds, chunk)
    return [[r[n] for n in names] for r in run_streamed(session, names, feeds, starts, recurrence)], starts


# ----------------------------------------------------------------------------- the chosen model
PATCH_RECIPE_NAME = "float-fallback"


def build_model(qdq: onnx.ModelProto, nodes: Sequence[str],
                float_weights: ReferenceWeights | None = None, remedy: str = "float") -> onnx.ModelProto:
    """``qdq`` with ``nodes`` in float (``remedy="a16w8"``/``"a16w16"``: with 16-bit activations/weights): the
    rewrite the ``float_fallback`` pass applies (`qgraph.remedy.apply.remedy_model`; with ``float_weights``, float
    weights restored as the pass restores them after ``insert_qdq`` in one recipe)."""
    if not nodes:
        return qdq
    return remedy_model(qdq, nodes, remedy, float_weights).model


def patch_recipe(nodes: Sequence[str], remedy: str = "float", float_weights: str | None = None) -> dict[str, Any]:
    """A one-pass recipe as data: ``float_fallback`` of ``nodes`` (``to: remedy`` unless float; the weights of the
    float model ``float_weights`` when given). Data, not a `Recipe`: the engine names the pass without importing it
    or reaching it through the registry (``Recipe.from_dict`` validates it where it is read)."""
    options: dict[str, Any] = {"pass": "float_fallback", "nodes": {"names": list(nodes)}}
    if remedy != "float":
        options["to"] = remedy
    if float_weights is not None:
        options["float_weights"] = float_weights
    return {"name": PATCH_RECIPE_NAME, "passes": [options]}
