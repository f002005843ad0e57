"""What a pass returns: `PassResult` (counts, skips, decisions, details) and `Skipped` (a node left alone, with why).

The details are a pass's own typed record (`qgraph.pipeline.pass_details.PassDetails`) or, for plug-ins written
before those existed, a plain JSON-ready dict; both serialise the same way (`PassResult.details_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import onnx

from qgraph.graph import NoMatch, gs_label, proto_label
from qgraph.pipeline.pass_details import PassDetails, details_dict


@dataclass
class Skipped:
    """A node a pass looked at and left alone, with the reason a user can act on."""

    node: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        """JSON-ready form."""
        return {"node": self.node, "reason": self.reason}


@dataclass
class PassResult:
    """What a pass did. Counts are exact; "nothing matched" is a normal outcome."""

    matched: int = 0
    rewritten: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    nodes_added: int = 0
    nodes_removed: int = 0
    #: What the pass measured and chose, for the report and the ``--report`` JSON only: the pass's typed record
    #: (a frozen `PassDetails` dataclass, or a `TypedDict` where the key order follows events; both checked by
    #: mypy) or a plain JSON-ready dict (plug-ins).
    details: PassDetails | Mapping[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Choices the pass made that change the output (raised opsets, per-tensor fallbacks, host-dependent
    #: settings): shown in the run summary and the report, and recorded in the output model's provenance.
    decisions: list[str] = field(default_factory=list)
    #: The decisions (the same text, also in `decisions`) a user must not miss: part of the model left unquantized
    #: that the recipe asked to quantize, or a data problem (an If branch the calibration data never ran). The
    #: run summary shows every one of them, before the routine decisions it may cut. Record them with `decide`.
    attention: list[str] = field(default_factory=list)
    #: Selector criteria that matched no node (a typo in a recipe is reported, never silently ignored).
    unmatched: list[str] = field(default_factory=list)
    #: A goal the pass could not reach (e.g. an accuracy target within its time budget), in one sentence. The
    #: model keeps the best the pass found and is still written; `qgraph run` then exits 1.
    unmet: str | None = None
    #: Nodes this pass deliberately put (back) in float, with why (float_fallback): the answer to "why is this
    #: node not integer" that wins over any pass's skip. Not skips (the pass acted on them), so not counted as such.
    kept_float: list[Skipped] = field(default_factory=list)
    #: Seconds this pass spent running the float model over the calibration data to collect activation ranges
    #: (insert_qdq): what the run summary measures every other pass's time against (`qgraph.pipeline.timing`).
    calibration_seconds: float | None = None

    def decide(self, text: str, attention: bool = False) -> None:
        """Record a decision (`decisions`); with ``attention``, one the summary always shows, first (`attention`)."""
        self.decisions.append(text)
        if attention:
            self.attention.append(text)

    def keep_float(self, node: str, reason: str) -> None:
        """Record that this pass put ``node`` (its name) in float on purpose, because of ``reason``."""
        self.kept_float.append(Skipped(node, reason))

    def skip(self, node: str, reason: str | NoMatch) -> None:
        """Record that ``node`` (its name; a node object is taken by its ``name``) was left alone because of
        ``reason``: a sentence, or the `qgraph.graph.NoMatch` a matcher raised (its reason is recorded)."""
        if isinstance(reason, NoMatch):
            reason = reason.reason
        if not isinstance(node, str):  # a gs.Node / NodeProto given for its name: never its multi-line repr
            name = getattr(node, "name", None)
            if not isinstance(name, str):
                raise TypeError(f"PassResult.skip takes a node name (str), got {type(node).__name__}")
            if not name:  # a node made without a name: the name qgraph's rule gives it (`qgraph.graph.naming`)
                name = proto_label(node) if isinstance(node, onnx.NodeProto) else gs_label(node)
            node = name
        self.skipped.append(Skipped(node, reason))

    @property
    def changed(self) -> bool:
        """Whether the pass modified the graph."""
        return bool(self.rewritten or self.nodes_added or self.nodes_removed)

    def details_dict(self) -> dict[str, Any]:
        """The details in their JSON-ready form (a typed record's `PassDetails.to_dict`, a dict as it is)."""
        return details_dict(self.details)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, deterministic form (no timings)."""
        return {
            "matched": self.matched,
            "rewritten": self.rewritten,
            "skipped": [s.to_dict() for s in self.skipped],
            "nodes_added": self.nodes_added,
            "nodes_removed": self.nodes_removed,
            "details": self.details_dict(),
            "notes": self.notes,
            "decisions": self.decisions,
            "unmatched": self.unmatched,
            "unmet": self.unmet,
            **({"kept_float": [s.to_dict() for s in self.kept_float]} if self.kept_float else {}),
            **({"attention": self.attention} if self.attention else {}),
        }


@dataclass
class NestedRun:
    """A pass one pass ran inside itself through `PassContext.run_pass` (an opset raised for the ops it emits,
    constants folded between rounds), held to the same contract as a recipe's pass."""

    name: str
    options: dict[str, Any]
    result: PassResult
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``seconds`` left out: reports are deterministic)."""
        return {"pass": self.name, "options": self.options, "result": self.result.to_dict()}
