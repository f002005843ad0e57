"""The pipeline runner: passes in order, optional numeric verification, provenance, progress events.

``Pipeline([FoldConstants(), FuseBatchNorm()]).run("model.onnx")`` returns a `PipelineResult` whose ``model``
carries provenance in ``metadata_props`` (canonical recipe text and hash, input model hash, qgraph version,
per-pass stats). Nothing in provenance depends on time or machine, so the same recipe on the same model gives
a byte-identical file.
"""

from __future__ import annotations

import itertools
import math
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

from qgraph.data import DataLayout, DataSource, DataSpec, Feed, batched, open_data_source
from qgraph.errors import UsageError, VerificationError
from qgraph.graph import GraphHandle, check_input_structure, check_model
from qgraph.graph.detach import fill_weights
from qgraph.io.model_io import load_model, model_fingerprint, save_model
from qgraph.pipeline.contract import collect_cycles, run_pass
from qgraph.pipeline.pass_api import Pass, PassContext, PassResult
from qgraph.pipeline.pass_result import NestedRun
from qgraph.pipeline.preflight import preflight, require_data
from qgraph.pipeline.provenance import write_provenance
from qgraph.pipeline.recipe_text import RecipeSpec
from qgraph.pipeline.target import CalibrationSpec, TargetSpec
from qgraph.pipeline.timing import FloatInference, measure_float_inference
from qgraph.pipeline.verify import VerifyTolerance, check_pass, measure_tolerance
from qgraph.runtime.compare import TensorDiff, random_feeds
from qgraph.runtime.kernels.measure import KERNEL_OPTIONS, KernelChoice, choose, target_family

EventKind = Literal["pipeline_start", "pass_start", "pass_progress", "pass_end", "verify", "pipeline_end"]


@dataclass(frozen=True)
class PipelineEvent:
    """A progress event; the CLI renders them, Python callers can subscribe."""

    kind: EventKind
    total: int
    index: int | None = None
    pass_name: str | None = None
    seconds: float | None = None
    peak_rss_mb: float | None = None
    result: PassResult | None = None
    verify: list[TensorDiff] | None = None
    #: ``verify``: the tolerance the outputs were held to (the user's, raised by the model's noise floor).
    tolerance: VerifyTolerance | None = None
    #: ``pass_progress``: the step (e.g. "calibrating"), units done and the total when known.
    task: str | None = None
    done: int | None = None
    of: int | None = None
    #: ``pass_end``: the pass failed its --verify check (the message); the run stops with that error.
    failed: str | None = None
    # : ``pipeline_start``: warnings found before any pass ran (`qgraph.pipeline.preflight`: a node name the model
    # lacks).
    warnings: tuple[str, ...] = ()


@dataclass
class PassRecord:
    """One executed pass: its config, result, cost and (optionally) verification."""

    index: int
    name: str
    config: dict[str, Any]
    result: PassResult
    seconds: float
    peak_rss_mb: float
    nodes_before: int
    nodes_after: int
    preserves_float: bool
    #: Whether the graph changed, as measured by the pipeline (whatever the pass reported).
    changed: bool = False
    verify: list[TensorDiff] | None = None
    #: The pass decides which nodes run in integer (`Pass.quantizes`): its skips explain float nodes first.
    quantizes: bool = False
    #: Passes it ran inside itself (`PassContext.run_pass`), each held to the contract too.
    nested: list[NestedRun] = field(default_factory=list)


@dataclass
class PipelineResult:
    """The output model and what every pass did."""

    model: onnx.ModelProto
    records: list[PassRecord] = field(default_factory=list)
    input_model: onnx.ModelProto | None = None
    #: The model after each pass (``stages[i]`` follows ``records[i]``), kept only with ``keep_stages=True``.
    stages: list[onnx.ModelProto] = field(default_factory=list)
    #: The bound calibration data the passes saw (None without data); reports reuse it for fidelity.
    calibration_data: DataSource | None = None
    #: With ``run(weightless=True)``: the values of ``model``'s placeholders by name (`qgraph.graph.detach`).
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    #: With ``run(verify=True)``: the tolerance every check used (`qgraph.pipeline.verify`: raised by the noise floor).
    verify_tolerance: VerifyTolerance | None = None
    #: Decisions made on loading the input, before any pass: nodes named by `qgraph.graph.naming`.
    load_decisions: list[str] = field(default_factory=list)
    #: How the run measured accuracy, and how later checks of its output should (`qgraph.runtime.kernels.measure`).
    kernel_choice: KernelChoice | None = None
    #: One float inference pass over the calibration data, timed apart from every pass (`qgraph.pipeline.timing`):
    #: the yardstick of the run summary's time line; None without data or without a pass that needs it.
    float_inference: FloatInference | None = None

    def save(self, path: str | Path) -> Path:
        """Write the output model atomically (external data beside it when over 2 GB)."""
        return save_model(self.model, path)


def _input_handle(model: onnx.ModelProto) -> GraphHandle:
    """The graph handle of the input model, checked structurally first: an invalid input (a dangling tensor, an
    unknown op) is the model's fault (`ModelError`), not the first pass's that would meet it."""
    handle = GraphHandle(model)
    check_input_structure(handle.graph, handle.opset)
    return handle


def _check_options(kernels: str, verify_tolerance: float) -> None:
    if kernels not in KERNEL_OPTIONS:
        raise UsageError(f"kernels {kernels!r}: give one of {', '.join(KERNEL_OPTIONS)}.")
    if not (math.isfinite(verify_tolerance) and verify_tolerance > 0):
        raise UsageError(f"verify tolerance {verify_tolerance}: give a finite number greater than 0.")


def _float_yardstick(passes: Sequence[Pass[Any]], handle: GraphHandle, ctx: PassContext,
                     data: DataSource | None) -> FloatInference | None:
    """One float inference pass of the input model over the calibration data, timed apart from every pass
    (`qgraph.pipeline.timing`), when data was given and a pass needs it; on the handle's weightless export (its
    arrays read in place: no copy of the weights)."""
    if data is None or all(p.missing_data(ctx.calibration) is None for p in passes):
        return None
    model, held = handle.weightless_export()
    return measure_float_inference(model, {name: value for name, (value, _) in held.items()},
                                   batched(data, ctx.calibration.batch_size))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Pipeline(RecipeSpec):
    """An ordered list of passes that runs (a `RecipeSpec`); build it in Python or from a `Recipe`."""

    def __init__(
        self,
        passes: Sequence[Pass[Any]],
        *,
        name: str = "pipeline",
        description: str = "",
        target: TargetSpec | None = None,
        calibration: CalibrationSpec | None = None,
        recipe: RecipeSpec | None = None,
    ) -> None:
        if recipe is not None:  # the recipe's settings; the passes given (a recipe's own, or a subset of them)
            name = recipe.name if name == "pipeline" else name
            description, target, calibration = recipe.description, recipe.target, recipe.calibration
        super().__init__(name, passes, description=description, target=target, calibration=calibration)
        self._subscribers: list[Callable[[PipelineEvent], None]] = []
        self._locate = getattr(recipe, "field_location", None)  # a Recipe locates its options in its file

    def subscribe(self, callback: Callable[[PipelineEvent], None]) -> None:
        """Call ``callback`` with every `PipelineEvent` of later runs."""
        self._subscribers.append(callback)

    def run(
        self,
        model: onnx.ModelProto | str | Path,
        *,
        calibration_data: DataSpec | None = None,
        verify: bool = False,
        verify_tolerance: float = 1e-5,
        verify_samples: int = 2,
        on_event: Callable[[PipelineEvent], None] | None = None,
        keep_stages: bool = False,
        samples: int | None = None,
        data_layout: DataLayout = "auto",
        keep_input: bool = True,
        weightless: bool = False,
        kernels: str = "auto",
    ) -> PipelineResult:
        """Run every pass on a copy of ``model`` and return the result (the input is never modified).

        ``keep_stages`` keeps the exported model after every pass in ``result.stages`` (for reports: per-pass
        structural diffs and per-stage fidelity); it costs one export per pass and memory for each stage.
        ``samples`` caps the calibration samples read (default: the recipe's ``calibration.samples``);
        ``data_layout`` says how stacked arrays map to samples (`qgraph.data`). When the recipe's target names an
        opset, the model is converted to it after the last pass (a recorded step of its own). ``weightless``
        returns the output with its large weights as placeholders and their arrays in ``result.weights`` (for a
        caller that hands them to onnxruntime: no protobuf copy of them is made). ``verify`` checks every
        float-preserving pass in onnxruntime on ``verify_samples`` inputs against ``verify_tolerance``, raised per
        output to 4x the model's own float32 noise floor (`qgraph.pipeline.verify`; ``result.verify_tolerance`` says
        which). ``kernels``: how passes measure accuracy (auto, deployed, emulated:
        `qgraph.runtime.kernels.measure.choose`).
        """
        _check_options(kernels, verify_tolerance)
        listeners = [*self._subscribers, *([on_event] if on_event else [])]

        def emit(event: PipelineEvent) -> None:
            for cb in listeners:
                cb(event)

        # A model given in memory is read, never copied or modified: the handle owns copies of what it keeps.
        source = load_model(model) if isinstance(model, (str, Path)) else model
        # Content hash: the same model gives the same provenance whether given as a path or in memory.
        input_hash = model_fingerprint(source)
        check_model(source)
        # option values naming graph inputs/outputs fail here, before calibration or any pass (nodes: warnings)
        early = preflight(self.passes, source, self._locate, f"pipeline {self.name!r}")
        total = len(self.passes) + (self.target.opset is not None)
        running: list[tuple[int, str]] = []  # the running pass, for progress events

        def on_progress(task: str, done: int, of: int | None) -> None:
            index, name = running[-1] if running else (None, None)
            emit(PipelineEvent("pass_progress", total, index, name, task=task, done=done, of=of))

        ctx = self._context(source, calibration_data, on_progress, samples, data_layout, kernels)
        data = ctx.calibration_data  # as given: passes may narrow ctx's view of it (specialize_inputs)
        handle = _input_handle(source)
        yardstick = _float_yardstick(self.passes, handle, ctx, data)
        notice = handle.naming.notice()  # the output keeps these names: a decision the report shows
        load_decisions = [f"input model: {notice}"] if notice else []
        emit(PipelineEvent("pipeline_start", total, warnings=tuple(str(w) for w in early)))
        records: list[PassRecord] = []
        previous = source if verify else None
        verify_feeds = self._verify_feeds(source, ctx, verify_samples) if verify else []
        tolerance = measure_tolerance(source, verify_feeds, verify_tolerance) if verify else None
        if (kept := source if keep_input or keep_stages or verify else None) is None:
            ctx.input_model = None
        del source  # the handle owns the weights now: without `kept`, the loaded protobuf is freed here
        stages: list[onnx.ModelProto] = []
        steps = self._with_target_opset()
        # wants_reference[i]: a pass at i or later reads ctx.float_reference (exported once, only then)
        wants_reference: list[bool] = list(itertools.accumulate(reversed([s.needs_float_reference for s in steps]),
                                                    lambda later, here: later or here))[::-1]
        for i, step in enumerate(steps):
            target_step = isinstance(step, _ToTargetOpset)
            p = step.resolve(handle) if isinstance(step, _ToTargetOpset) else step
            if p is None:
                continue
            emit(PipelineEvent("pass_start", total, i, p.name))
            running.append((i, p.name))
            changes_values = not (p.preserves_float or p.keeps_float_values)
            if ctx.float_reference is None and wants_reference[i] and (changes_values or p.needs_float_reference):
                # the model before the first float-changing pass (or before the pass that asks, if none ran)
                # weightless, sharing the graph's arrays: no second copy of the weights (later passes replace
                # arrays, they never write into them)
                reference, held = handle.weightless_export()
                ctx.set_float_reference(reference, {name: value for name, (value, _) in held.items()}, handle)
            record = self._run_one(i, p, handle, ctx, target_step)
            records.append(record)
            if keep_stages or (verify and previous is not None):
                current = handle.to_onnx()
                if keep_stages:
                    stages.append(current)
            # verified before its end is announced, so a pass that fails --verify is never shown as done
            failed = _verified(record, p, (previous, current), verify_feeds, tolerance, ctx) if tolerance else None
            emit(PipelineEvent("pass_end", total, i, p.name, record.seconds, record.peak_rss_mb, record.result,
                               failed=str(failed) if failed is not None else None))
            if failed is not None:
                raise failed
            if record.verify is not None:
                emit(PipelineEvent("verify", total, i, p.name, verify=record.verify, tolerance=tolerance))
            previous = current if previous is not None else None
        out, held = handle.weightless_export()
        handle.release()  # the graph lets go of its weights: `held` is their last owner...
        collect_cycles(sum(value.nbytes for value, _ in held.values()))  # ...once the tensors' cycles are collected
        weights = {name: value for name, (value, _) in held.items()} if weightless else {}
        if not weightless:
            fill_weights(out, held, consume=True)  # each array freed once written: never the weights twice in flight
        del held
        write_provenance(out, self.to_dict(), input_hash, records, self.made_for())
        emit(PipelineEvent("pipeline_end", total, seconds=sum(r.seconds for r in records)))
        return PipelineResult(out, records, kept, stages, data, weights, tolerance, load_decisions,
                              choose(self.made_for(), kernels), yardstick)  # checked as it deploys on its CPU

    def made_for(self) -> str | None:
        """The CPU family the output is made for: the recipe's ``target.cpu`` (``host`` resolved), else the first
        pass that makes the model for one (`Pass.made_for_cpu`: a quantizer's CPU preset)."""
        return target_family(self.target.cpu) or next(
            (f for f in (p.made_for_cpu() for p in self.passes) if f is not None), None)

    @staticmethod
    def _run_one(index: int, p: Pass[Any], handle: GraphHandle, ctx: PassContext, target_step: bool) -> PassRecord:
        nodes_before, opset_before = len(handle.graph.nodes), handle.opset
        start = time.perf_counter()
        ctx.nested = []
        result, measured = run_pass(p, index, handle, ctx)
        collect_cycles(measured.dropped_bytes)  # the pass ran with the cyclic GC paused: the weights it dropped
        if target_step:
            result.decisions.insert(0, f"target.opset {handle.opset}: converted from opset {opset_before} after the "
                                    "last pass, as the recipe's target asks")
        return PassRecord(
            index=index,
            name=p.name,
            config=p.config.recipe_options(),
            result=result,
            seconds=time.perf_counter() - start,
            peak_rss_mb=_peak_rss_mb(),
            nodes_before=nodes_before,
            nodes_after=len(handle.graph.nodes),
            preserves_float=p.preserves_float,
            changed=measured.changed,
            quantizes=p.quantizes,
            nested=ctx.nested,
        )

    def _with_target_opset(self) -> list[Pass[Any]]:
        if self.target.opset is None:
            return list(self.passes)
        return [*self.passes, _ToTargetOpset(self.target.opset)]

    def _context(
        self,
        model: onnx.ModelProto,
        calibration_data: DataSpec | None,
        on_progress: Callable[[str, int, int | None], None] | None = None,
        samples: int | None = None,
        layout: DataLayout = "auto",
        kernels: str = "auto",
    ) -> PassContext:
        spec: CalibrationSpec = self.calibration
        target: TargetSpec = self.target
        data_spec = calibration_data if calibration_data is not None else spec.data
        cap = samples if samples is not None else spec.samples
        data = (open_data_source(data_spec, samples=cap, layout=layout).bind(model)
                if data_spec is not None else None)
        if data is None:  # a pass that needs data fails now, not after the passes before it
            require_data(self.passes, spec)
        return PassContext(
            input_model=model,
            calibration_data=data,
            target=target,
            calibration=spec,
            on_progress=on_progress,
            kernels=kernels,
            made_for=self.made_for(),
        )

    @staticmethod
    def _verify_feeds(model: onnx.ModelProto, ctx: PassContext, n: int) -> list[Feed]:
        if ctx.calibration_data is not None:
            feeds: list[Feed] = []
            for feed in ctx.calibration_data:
                feeds.append(feed)
                if len(feeds) >= n:
                    break
            if feeds:
                return feeds
        return random_feeds(model, n)


def _verified(record: PassRecord, p: Pass[Any], models: tuple[onnx.ModelProto | None, onnx.ModelProto],
              feeds: list[Feed], tolerance: VerifyTolerance, ctx: PassContext) -> VerificationError | None:
    """Check a float-preserving pass against the model before it (`record.verify`; a quantized stage with the
    run's kernels, `qgraph.pipeline.verify.check_pass`); its failure, not raised."""
    previous, current = models
    if previous is None or not p.preserves_float:
        return None
    try:
        record.verify = check_pass(p.name, record.index, previous, current, feeds, tolerance, ctx.kernels)
    except VerificationError as exc:
        return exc
    return None


class _ToTargetOpset(Pass[Any]):
    """Placeholder for the step that brings the model to ``target.opset`` (resolved once the opset is known)."""

    name = "target_opset"

    def __init__(self, opset: int) -> None:
        self.opset = opset

    def resolve(self, handle: GraphHandle) -> Pass[Any] | None:
        """The lower_opset/raise_opset pass that reaches the target, or None when the model is already there."""
        from qgraph.pipeline.pass_api import get_pass

        if handle.opset == self.opset:
            return None
        name = "lower_opset" if self.opset < handle.opset else "raise_opset"
        return get_pass(name)(opset=self.opset)
