"""Options of ``float_fallback``: the pass (`FloatFallbackConfig`) and its automatic search
(`AutoFallbackConfig`), below the pass's modules so they share them without importing the pass."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from qgraph import (
    NodeSelector,
    PassConfig,
    QGraphError,
)
from qgraph.analysis.sensitivity.targets import parse_target
from qgraph.graph.names import GraphOutputName
from qgraph.runtime.executor import ExecutorSpec
from qgraph.runtime.streaming import Recurrence


class AutoFallbackConfig(PassConfig):
    """Options of the automatic mode."""

    target: str = Field(description="cosine:GOAL, sqnr:GOAL_DB, a built-in task metric (detection.f1:0.98, "
                        "ctc.cer:0.01; docs/metrics.md) or module:function>=GOAL (e.g. >=float-0.5%).")
    data: str | None = Field(default=None, description="Evaluation data; default: the calibration data.")
    reference: str | None = Field(
        default=None, description="Float model to compare with; default: this model with every Q/DQ removed."
    )
    candidates: NodeSelector | None = Field(default=None, description="Only consider these nodes.")
    max_nodes: int | None = Field(default=None, ge=0, description="Keep at most this many nodes in float.")
    max_time: float | None = Field(
        default=None, gt=0, description="Time budget in seconds: no evaluation starts that would end after it; "
        "the best model found so far is kept and the summary says the budget ran out."
    )
    samples: int | None = Field(default=None, ge=1, description="Use at most this many evaluation samples.")
    jobs: int = Field(default=1, ge=1, description="Worker processes evaluating candidate models (local executor).")
    exact_top: int = Field(
        default=0, ge=0, description="Measure the first K nodes of the one-run ranking exactly (one full "
        "evaluation each) and re-rank them by that measure."
    )
    executor: ExecutorSpec | None = Field(
        default=None,
        description="Where candidates are measured: {kind: local|ray, address, workers, max_retries}; "
        "default: `jobs` local processes.",
    )
    cost: Literal["latency", "error"] = Field(
        default="latency",
        description="latency: rank nodes by output error bought per added latency (cost table, Q/DQ boundaries "
        "counted: a node next to float nodes is cheaper than an isolated one); error: by output error alone.",
    )
    latency_table: str | None = Field(
        default=None, description="Cost table for `cost: latency` (default: the one shipped with insert_qdq)."
    )
    latency_preset: str | None = Field(
        default=None, description="Preset of the cost table to use; default: ort-<target.cpu> if the table has "
        "it, else the table's only preset.",
    )
    max_latency: float | None = Field(
        default=None, gt=0, description="With cost: latency, keep at most this many times the float model's "
        "latency (1.0: never slower than float): the search bounds the modelled latency, then (latency_rounds > 0) "
        "the chosen set is timed in onnxruntime and cut back to the largest prefix timed within the bound; a "
        "target that needs more is reported as not met.",
    )
    latency_rounds: int = Field(
        default=5, ge=0, le=100, description="Time the float, INT8 and chosen models in onnxruntime this many "
        "rounds (at least 3) and report the ratios (0: do not measure).",
    )
    outputs: tuple[GraphOutputName, ...] = Field(
        default=(), description="With a cosine/sqnr target, score only these graph outputs (default: every one), "
        "e.g. [output] for a recurrent model whose state output should not decide.",
    )
    bodies: bool = Field(
        default=True, description="Also consider the quantized nodes inside If/Loop bodies (a model whose compute "
        "sits in branches chosen at run time): each is measured exactly, one evaluation, for the ranking.",
    )
    recurrent: Recurrence | None = Field(
        default=None, description="A recurrent model's state feedback ({state_inputs: {state: stateN}}): every "
        "full evaluation runs streamed, each model fed its own previous state over the data in order "
        "(`qgraph.runtime.streaming`); the one-run ranking stays per sample.",
    )
    output_parts: bool = Field(
        default=True, description="With a cosine/sqnr target, score each part of an output that a final Concat "
        "joins (a detector's boxes and class scores) on its own, the worst part deciding "
        "(`qgraph.runtime.output_parts`); false: every output whole, where the largest part's error hides the others'.",
    )

    @field_validator("target")
    @classmethod
    def _parses(cls, value: str) -> str:
        try:
            parse_target(value, load=False)
        except QGraphError as exc:  # as a validation error, so the recipe error names file, line and field
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _latency_needs_costs(self) -> AutoFallbackConfig:
        if self.max_latency is not None and self.cost != "latency":
            raise ValueError("max_latency bounds the modelled latency: it needs cost: latency")
        return self


class FloatFallbackConfig(PassConfig):
    """Which nodes go back to float."""

    #: The entry `qgraph passes float_fallback` shows (the defaults alone select nothing).
    recipe_example: ClassVar[dict[str, Any]] = {"nodes": {"op_types": ["Softmax"]}, "auto": {"target": "sqnr:30"},
                                                "to": "float"}

    nodes: NodeSelector | None = Field(default=None, description="Nodes to keep in float (always).")
    auto: AutoFallbackConfig | None = Field(default=None, description="Also find nodes automatically.")
    to: Literal["float", "a16w8", "a16w16"] = Field(
        default="float",
        description="What the chosen nodes become: float; a16w8: 16-bit activations, weights unchanged (for NPUs, "
        "which run A16W8 layers natively and have no cheap float path; on onnxruntime's CPU provider such a "
        "layer runs in float between its 16-bit Q/DQ). The 16-bit range is the 8-bit one x 2 (`qgraph.remedy.widen`). "
        "a16w16: also int16 weights (per channel, from the float reference) and their int32 biases "
        "(`qgraph.remedy.widen_weights`).",
    )

    float_weights: str | None = Field(
        default=None, description="A float model (path) whose weights and biases the chosen nodes take when no "
        "quantizing pass ran before this one in the recipe (a patch applied to a QDQ model): to: float restores "
        "them, to: a16w16 re-quantizes them to 16 bits. Default: the recipe's float model, else the integer "
        "weights.")

    @model_validator(mode="after")
    def _a16_costs(self) -> FloatFallbackConfig:
        if self.to != "float" and self.auto is not None:
            if self.auto.max_latency is not None:
                raise ValueError("auto.max_latency bounds the modelled latency of float nodes; the cost table has no "
                                 f"16-bit costs: drop it with to: {self.to}")
            if "cost" in self.auto.model_fields_set and self.auto.cost == "latency":
                raise ValueError("auto.cost: latency ranks by the cost table's float and int8 costs, which have no "
                                 f"16-bit entry: with to: {self.to} use cost: error (what it does when cost is unset)")
        return self

    @model_validator(mode="after")
    def _something(self) -> FloatFallbackConfig:
        if self.nodes is None and self.auto is None:
            raise ValueError("give `nodes` (a selector) and/or `auto` (a target); with neither nothing would change")
        return self
