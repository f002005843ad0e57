"""What ``insert_qdq`` reports in ``PassResult.details`` (typed, `qgraph.PassDetails`).

The top level is typed field by field; the per-unit list is a typed record; the nested reports of the optional
stages (calibration choices, latency and depthwise decisions, saturation) are their stages' JSON-ready dicts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from qgraph import PassDetails
from qgraph.pipeline.pass_details import KEEP_NONE

from .units import Plan, UnitKind, label


@dataclass(frozen=True)
class QuantizedUnit(PassDetails):
    """One integer op: its node (label), op type, unit kind, the nodes it absorbed and whether its weight is
    per-channel (``null`` for a unit without a weight)."""

    node: str
    op: str
    kind: UnitKind
    absorbed: list[str]
    per_channel: bool | None = field(metadata=KEEP_NONE)


@dataclass(frozen=True, kw_only=True)  # keyword-only: the optional early stages can come first, as in the JSON
class InsertQDQDetails(PassDetails):
    """Everything ``insert_qdq`` decided, in the order the keys are written: the optional stages that ran while
    planning (``depthwise: auto``, ``latency``), the preset and target, the quantized units and tensors, then the
    optional calibration, saturation and pair-safe reports (None: the stage did not run or found nothing)."""

    depthwise_auto: list[dict[str, Any]] | None = None
    latency: dict[str, Any] | None = None
    preset: str | None = field(metadata=KEEP_NONE)
    why: str
    mode: str
    reduce_range: str
    cpu: str
    quantized: list[QuantizedUnit]
    quantized_ops: dict[str, int]
    integer_data_movement: list[str]
    quantized_tensors: int
    calibrated_tensors: int
    excluded_tensors: dict[str, str]
    asymmetric_weights: list[str]
    subgraph_nodes_quantized: int
    subgraph_nodes_quantized_static: int
    calibration: dict[str, Any] | None = None
    saturation: dict[str, Any] | None = None
    pair_safe: list[dict[str, Any]] | None = None


@dataclass
class EarlyStages:
    """The reports of the stages that run inside re-planning (filled in by the pass as they run)."""

    depthwise_auto: list[dict[str, Any]] | None = None
    latency: dict[str, Any] | None = None


def quantized_units(plan: Plan) -> list[QuantizedUnit]:
    """The units of ``plan`` as the details list them."""
    return [
        QuantizedUnit(node=label(u.node), op=u.node.op, kind=u.kind, absorbed=[n.name for n in u.absorbed],
                      per_channel=u.weight_axis is not None if u.weight_index is not None else None)
        for u in plan.units
    ]


def quantized_ops(plan: Plan) -> dict[str, int]:
    """How many units of each op type ``plan`` quantizes (first-seen order)."""
    return dict(Counter(u.node.op for u in plan.units))
