"""What the weight-correction passes (``correct_bias``, ``optimize_rounding``) share: their base class
(`CorrectionPass`: preconditions and first steps), the layers they may correct with the float weights behind them,
calibration batches, and per-layer row geometry.

Both run after a quantizing pass (``insert_qdq``) and compare with `PassContext.float_reference`, the model as it
was before the first float-changing pass: layers are matched by their output tensor, whose name quantization
keeps.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt
import onnx
from pydantic import Field

from qgraph.data import Feed, batched
from qgraph.errors import PassError
from qgraph.graph import GraphHandle, NoMatch
from qgraph.graph.selectors import NodeSelector, select
from qgraph.metrics.interval import sqnr_change
from qgraph.options import PassConfig
from qgraph.pipeline.pass_api import Pass, PassContext, PassResult
from qgraph.quant.layers import QuantLayer, find_layers
from qgraph.recovery.reference_outputs import reference_outputs
from qgraph.runtime.compare import make_session
from qgraph.runtime.layer_data import RowSpec
from qgraph.runtime.output_parts import find_output_parts
from qgraph.runtime.sliced import sliced_session
from qgraph.runtime.streaming import OutputScore


@dataclass
class Candidates:
    """Layers a correction pass will work on, with their float weights, and the ones it leaves alone."""

    layers: list[QuantLayer] = field(default_factory=list)
    float_weights: dict[str, npt.NDArray[np.float32]] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)


def require(pass_name: str, graph: GraphHandle, ctx: PassContext) -> None:
    """`PassError` saying how to fix it when the pass is misplaced (no float reference: not after a quantizing
    pass in a pipeline)."""
    if ctx.float_reference is None:
        raise PassError(f"{pass_name}: needs the float model: run it in a pipeline after the quantizing pass "
                        "(`- pass: insert_qdq` before it in the same recipe).")


def unavailable(graph: GraphHandle, ctx: PassContext) -> str | None:
    """Why a correction pass has nothing to do here (reported as its decision, so a ready recipe still runs on a
    model quantized from a ranges file, or one whose layers all stayed float), or None."""
    if ctx.calibration_data is None:
        return ("not run: no calibration data to measure the layers on (give --calibration-data or the recipe's "
                "calibration.data)")
    layers, _ = find_layers(graph)
    if not layers:
        return "not run: no Conv/Gemm/MatMul with a weight behind Q/DQ to correct"
    return None


def candidates(pass_name: str, graph: GraphHandle, ctx: PassContext, selector: NodeSelector | None) -> Candidates:
    """Quantized layers (restricted to ``selector``) that have a float weight of the same shape in the reference."""
    out = Candidates()
    layers, out.skipped = find_layers(graph)
    if selector is not None:
        sel = select(graph, selector)
        out.unmatched = list(sel.unmatched)
        chosen = {id(n) for n in sel.nodes}
        layers = [la for la in layers if id(la.node) in chosen]
    assert ctx.float_reference is not None
    from qgraph.quant.layers import float_weights

    weights = float_weights(ctx.float_reference, layers, ctx.float_reference_weights)
    for layer in layers:
        w = weights.get(layer.output)
        if w is None or w.shape != layer.weight.values.shape:
            out.skipped.append((layer.name, "the float reference has no float weight of the same shape for it "
                                "(was the model quantized before this recipe?)"))
            continue
        out.layers.append(layer)
        out.float_weights[layer.output] = w
    if layers and not out.layers:
        raise PassError(f"{pass_name}: none of the {len(layers)} quantized layer(s) has a float weight in the float "
                        "reference: quantize in the same recipe (`- pass: insert_qdq` before this pass).")
    return out


C = TypeVar("C", bound=PassConfig)


class CorrectionPass(Pass[C]):
    """Base of the weight-correction passes: they change float results, read `PassContext.float_reference`, need
    it (`require`), and start the same way (`start`). Subclasses set ``name``, ``config_class`` and `run`."""

    preserves_float: ClassVar[bool] = False
    needs_float_reference: ClassVar[bool] = True

    def requires(self, graph: GraphHandle, ctx: PassContext) -> None:
        """Calibration data, the float reference and at least one quantized layer."""
        require(self.name, graph, ctx)

    def start(self, graph: GraphHandle, ctx: PassContext, selector: NodeSelector | None,
              res: PassResult) -> Candidates | None:
        """The `candidates` (restricted to ``selector``), their unmatched criteria and skipped layers reported in
        ``res``; or None, with `unavailable`'s reason as ``res``'s decision, when there is nothing to do here."""
        why = unavailable(graph, ctx)
        if why is not None:
            res.decisions.append(why)
            return None
        cands = candidates(self.name, graph, ctx, selector)
        res.unmatched = cands.unmatched
        for node, reason in cands.skipped:
            res.skip(node, reason)
        return cands


def weightless(graph: GraphHandle) -> tuple[onnx.ModelProto, dict[str, npt.NDArray[Any]]]:
    """The graph's weightless export and its placeholders' values (the graph's own arrays, not copies): what
    `qgraph.runtime.channel_means.ChannelMeans` / `qgraph.runtime.layer_data.sample_inputs` take to build a session
    without a copy of the weights."""
    model, held = graph.weightless_export()
    return model, {name: value for name, (value, _) in held.items()}


def calibration_batches(ctx: PassContext) -> Iterable[Feed]:
    """The calibration data in the recipe's batches (a fresh iterator per call)."""
    assert ctx.calibration_data is not None
    return batched(ctx.calibration_data, ctx.calibration.batch_size)


def row_spec(layer: QuantLayer) -> RowSpec:
    """How `qgraph.runtime.layer_data.sample_inputs` cuts the layer's input into rows; `NoMatch` saying why it
    cannot."""
    node = layer.node
    w = layer.weight.values
    if node.op != "Conv":
        return RowSpec(node.inputs[0].name, int(layer.rows(np.empty(w.shape, np.float32)).shape[1]))
    if str(node.attrs.get("auto_pad", "NOTSET")) not in ("NOTSET", "VALID"):
        raise NoMatch("auto_pad SAME_* convolutions are not handled (pads depend on the input size)")
    nd = w.ndim - 2
    kernel = tuple(int(k) for k in w.shape[2:])
    return RowSpec(
        node.inputs[0].name,
        int(np.prod(w.shape[1:])),
        groups=layer.groups,
        kernel=kernel,
        strides=tuple(int(v) for v in node.attrs.get("strides", [1] * nd)),
        dilations=tuple(int(v) for v in node.attrs.get("dilations", [1] * nd)),
        pads=tuple(int(v) for v in node.attrs.get("pads", [0] * 2 * nd)),
    )


class GuardConfig(PassConfig):
    """The fidelity guard of a weight-correcting pass (`FidelityGuard`): its config class inherits these fields."""

    guard: bool = Field(
        default=True, description="Keep the change only if the model's output fidelity against the float reference "
        "(the minimum SQNR over outputs, each part of a Concat-joined output on its own) does not drop by more than "
        "guard_tolerance_db on guard_samples calibration samples, or the drop is within what those samples can "
        "tell from chance (the 95% paired bootstrap interval of the change reaches the tolerance); otherwise undo "
        "it (reported).",
    )
    guard_samples: int = Field(default=32, ge=1, description="Calibration samples the guard scores on.")
    guard_tolerance_db: float = Field(default=0.05, ge=0, description="Drop in dB the guard accepts (float noise).")


class FidelityGuard:
    """Keeps a weight-correcting pass's change only where it does not make the model worse: the output fidelity
    against the float reference on a few calibration samples (the minimum SQNR over outputs, each part of a
    Concat-joined output on its own: `qgraph.runtime.output_parts`) before (`start`, with a snapshot of the layers'
    codes)
    and after (`finish`, which restores the snapshot when the score dropped). Reported in ``res`` either way. Costs
    two runs of the graph on those samples, and one of the float reference unless calibration kept its outputs on
    them (`qgraph.recovery.reference_outputs`; the decision line says which)."""

    def __init__(self, ctx: PassContext, samples: int, layers: list[QuantLayer], res: PassResult) -> None:
        assert ctx.calibration_data is not None and ctx.float_reference is not None
        feeds = list(itertools.islice(iter(ctx.calibration_data), samples))
        parts = find_output_parts(ctx.float_reference)
        names = [o.name for o in ctx.float_reference.graph.output]
        kept = reference_outputs(ctx, names, len(feeds))  # calibration ran the float reference on them
        self.reused = kept is not None
        if kept is not None:
            self.scorer = OutputScore.of_outputs(names, feeds, kept, parts)
        else:
            # a long graph runs in slices: one session over it costs more than linear time to build (`sliced_session`)
            reference = sliced_session(ctx.float_reference, lambda m, w: make_session(m, weights=w),
                                       weights=ctx.float_reference_weights, anywhere=True, single_use=True)
            self.scorer = OutputScore(reference, feeds, parts=parts)
        self.kernels = ctx.kernels  # the target's arithmetic: a correction that only helps elsewhere is undone
        self.layers = layers
        self.stored = [la.snapshot() for la in layers]
        self.res = res
        self.before = math.nan
        self.after = math.nan
        self.before_sums = np.zeros((0, 0, 2))
        #: 95 % paired bootstrap interval of after - before (dB) over the samples (`qgraph.metrics.interval`)
        self.change = (math.nan, math.nan)
        self.within_noise = False  # kept though the score fell by more than the tolerance: within the interval

    @classmethod
    def start(cls, config: GuardConfig, graph: GraphHandle, ctx: PassContext, layers: list[QuantLayer],
              res: PassResult) -> FidelityGuard | None:
        """A guard holding the graph's score and the layers' codes now, or None when ``config.guard`` is off."""
        if not config.guard:
            return None
        guard = cls(ctx, config.guard_samples, layers, res)
        guard.before = guard.score(graph)
        guard.before_sums = guard.scorer.last_sums
        return guard

    def score(self, graph: GraphHandle) -> float:
        """The graph's score now (dB; NaN/Inf outputs give -inf). Its own export and session (in exact slices on
        a long graph): feeding the corrected biases to the session of `start` would make every run pass thousands
        of inputs on a long chain (onnxruntime checks a feed in O(inputs x fed names))."""
        model, held = graph.weightless_export()
        session = sliced_session(model, lambda m, w: self.kernels.session(m, weights=w),
                                 weights={n: v for n, (v, _) in held.items()}, single_use=True)
        return self.scorer.score_db(session)

    def finish(self, graph: GraphHandle, tolerance_db: float, report: bool = True) -> bool:
        """Score the graph again; undo the change (restore every layer) when it lost more than ``tolerance_db``.
        Whether it was kept; with ``report``, a decision line says which and why (a pass that says it in its own
        line passes False and uses `measured`)."""
        self.after = self.score(graph)
        self.change = sqnr_change(self.before_sums, self.scorer.last_sums)
        # undone only where these samples show the loss: the whole interval of the change below the tolerance
        # (YOLOv8n's bias correction read -0.35 dB on 32 calibration images, -0.07 on 320, +3.2 dB held out)
        kept = self.after >= self.before - tolerance_db or self.change[1] >= -tolerance_db
        self.within_noise = kept and self.after < self.before - tolerance_db
        if not kept:
            for layer, stored in zip(self.layers, self.stored, strict=True):
                layer.restore(stored)
            graph.changed()
        if report:
            what = "kept" if kept else "undone: it made the model worse there (guard: false keeps it)"
            self.res.decisions.append(f"guard: {self.measured()}: the change is {what}")
        return kept

    def measured(self) -> str:
        """``output SQNR on 32 calibration sample(s) 30.10 -> 29.50 dB`` (after `finish`)."""
        units = len(self.scorer.units)
        scored = f"min output SQNR over {units} part(s)" if units > 1 else "output SQNR"
        source = ", the float reference's outputs kept from calibration" if self.reused else ""
        low, high = self.change
        spread = f" (95% interval of the change {low:+.2f} to {high:+.2f} dB)" if math.isfinite(low + high) else ""
        if self.within_noise:
            spread += ": a drop these samples cannot tell from chance"
        return (f"{scored} on {len(self.scorer.feeds)} calibration sample(s){source} {self.before:.2f} -> "
                f"{self.after:.2f} dB{spread}")
