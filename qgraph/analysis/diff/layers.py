"""The results of a numeric diff: metrics per tensor (`LayerDiff`) and for a whole model pair (`NumericDiff`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from qgraph.runtime.output_parts import OutputPart, OutputParts


@dataclass
class LayerDiff:
    """Metrics of one tensor compared between the two models, with where it sits in model A."""

    tensor: str
    node: str  # producer in model A
    op: str
    order: int  # producer position in model A (topological)
    max_abs: float
    scale: float
    cosine: float
    sqnr_db: float
    rel_l2: float  # ||c - r|| / ||r||
    input_sqnr_db: float = math.inf
    drop_db: float = 0.0
    layer_sqnr_db: float = math.inf  # SQNR this layer alone would give (see module docs)
    candidate: str | None = None  # name in model B when it differs (outputs matched by position)
    node_b: str | None = None  # producer in model B when it is another node (e.g. a fused one)
    op_b: str | None = None  # its op, when it differs from ``op``
    pass_name: str | None = None  # the qgraph pass that created the producer in B (from its tag)
    nonfinite_a: int = 0  # NaN/Inf elements in model A's tensor (never counted as "no error")
    nonfinite_b: int = 0
    part: OutputPart | None = None  # the part of a graph output this row measures (`qgraph.runtime.output_parts`)

    @property
    def op_label(self) -> str:
        """``op`` or ``op (in B: op_b)`` when model B computes the tensor with another op (a Conv that absorbed
        this BatchNormalization: not an arrow, which would read as graph order)."""
        return self.op if self.op_b is None else f"{self.op} (in B: {self.op_b})"

    @property
    def label(self) -> str:
        """``node`` or ``node (in B: node_b, by pass)`` when model B produces the tensor with another node."""
        if self.node_b is None:
            return self.node
        return f"{self.node} (in B: {self.node_b}" + (f", by {self.pass_name})" if self.pass_name else ")")

    @property
    def relative(self) -> float:
        """``max_abs / max|reference|`` (inf when either model gave NaN/Inf)."""
        if self.nonfinite_a or self.nonfinite_b:
            return math.inf
        return self.max_abs / self.scale if self.scale > 0 else self.max_abs

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (infinite dB values as the strings ``"inf"``/``"-inf"``)."""
        keys = ("tensor", "node", "op", "order", "max_abs", "scale", "cosine", "sqnr_db", "rel_l2")
        out = {k: json_number(getattr(self, k)) for k in keys}
        out.update(relative=json_number(self.relative), input_sqnr_db=json_number(self.input_sqnr_db),
                   drop_db=json_number(self.drop_db), layer_sqnr_db=json_number(self.layer_sqnr_db),
                   nonfinite_a=self.nonfinite_a, nonfinite_b=self.nonfinite_b)
        for key in ("candidate", "node_b", "op_b", "pass_name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.part is not None:
            out.update(part_of=self.part.output, part=self.part.to_dict())
        return out


def part_drops(rows: dict[str, list[LayerDiff]], layers: dict[tuple[str, str], LayerDiff]) -> None:
    """A part of a split output copies its source tensor (the Concat input): its input SQNR is that tensor's, so
    the drop is what the join lost (e.g. the scores quantized with the boxes' scale)."""
    for d in (r for part_rows in rows.values() for r in part_rows):
        source = layers.get(("", d.part.source)) if d.part is not None else None
        if source is None:
            continue
        d.input_sqnr_db = source.sqnr_db
        d.drop_db = 0.0 if source.sqnr_db == -math.inf or d.sqnr_db == math.inf else source.sqnr_db - d.sqnr_db
        own = 10.0 ** (-d.sqnr_db / 10.0) - 10.0 ** (-source.sqnr_db / 10.0)
        d.layer_sqnr_db = math.inf if own <= 0 else -10 * math.log10(own) if math.isfinite(own) else -math.inf


def json_number(x: Any) -> Any:
    """``x`` with non-finite floats as strings (JSON has no inf/NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


@dataclass
class NumericDiff:
    """Per-tensor metrics in topological order, plus the graph outputs."""

    samples: int
    layers: list[LayerDiff]
    outputs: list[LayerDiff]
    skipped: dict[str, str] = field(default_factory=dict)
    runs: int = 0
    noise_floor_db: float = 80.0
    jump_db: float = 6.0
    #: Q/DQ pairs ranked by the output error they cause (`qgraph.analysis.diff.culprits.attribute`), when computed.
    attribution: Any = None
    #: Top-1 agreement and metric of both models on the evaluation data (`qgraph.analysis.diff.compare_outputs`).
    evaluation: dict[str, Any] | None = None
    #: Tensors compared after undoing a recorded per-channel rescaling (cross-layer equalization).
    rescaled: list[str] = field(default_factory=list)
    #: Each If/Loop body of A (scoped ``<node>.<attr>``) and what the diff saw of it: the executions compared, or
    #: that it did not run on these inputs (then nothing inside it is in ``layers``, which is not "no error").
    bodies: dict[str, str] = field(default_factory=dict)
    #: How A's outputs are scored (`qgraph.runtime.output_parts`), and the rows of the parts of each split output.
    output_parts: OutputParts | None = None
    parts: dict[str, list[LayerDiff]] = field(default_factory=dict)

    def output_rows(self) -> list[LayerDiff]:
        """The outputs, each split output followed by its parts."""
        return [r for d in self.outputs for r in (d, *self.parts.get(d.tensor, ()))]

    def scored_outputs(self) -> list[LayerDiff]:
        """What the outputs are judged by: the parts of a split output, else the whole output."""
        return [r for d in self.outputs for r in (self.parts.get(d.tensor) or [d])]

    def not_run(self) -> list[str]:
        """Scopes of the bodies with nothing compared (not run on these inputs, or not comparable)."""
        return [s for s, status in self.bodies.items() if not status.startswith("observed")]

    def nonfinite(self) -> list[LayerDiff]:
        """Tensors holding NaN/Inf in either model, in graph order (outputs first)."""
        seen: set[str] = set()
        out = []
        for d in [*self.outputs, *self.layers]:
            if (d.nonfinite_a or d.nonfinite_b) and d.tensor not in seen:
                seen.add(d.tensor)
                out.append(d)
        return out

    def problem(self) -> str | None:
        """A sentence naming non-finite outputs (an error: NaN is never "no difference"), or None."""
        bad = [d for d in self.outputs if d.nonfinite_a or d.nonfinite_b]
        if not bad:
            return None
        first_layer = next((d for d in self.layers if d.nonfinite_a or d.nonfinite_b), None)
        where = f"; first non-finite tensor: {first_layer.tensor} ({first_layer.label})" if first_layer else ""
        names = ", ".join(f"{d.tensor} ({d.nonfinite_a} in A, {d.nonfinite_b} in B)" for d in bad)
        return f"non-finite values (NaN/Inf) in the outputs: {names}{where}."

    def worst(self, n: int = 10) -> list[LayerDiff]:
        """The ``n`` tensors with the lowest SQNR (ties: earliest first)."""
        return sorted(self.layers, key=lambda d: (d.sqnr_db, d.order))[:n]

    def introduced(self, n: int | None = None) -> list[LayerDiff]:
        """Layers that added error themselves (see module docs), most error (lowest layer SQNR) first."""
        hits = [d for d in self.layers if d.layer_sqnr_db < self.noise_floor_db and d.drop_db >= self.jump_db]
        return sorted(hits, key=lambda d: (d.layer_sqnr_db, d.order))[:n]

    @property
    def first_jump(self) -> LayerDiff | None:
        """The topologically first layer that introduced error."""
        hits = self.introduced()
        return min(hits, key=lambda d: d.order) if hits else None

    def to_dict(self, top: int = 10) -> dict[str, Any]:
        """JSON-ready form."""
        first = self.first_jump
        return {
            "samples": self.samples,
            "runs": self.runs,
            "noise_floor_db": self.noise_floor_db,
            "jump_db": self.jump_db,
            "outputs": [{**d.to_dict(), **({"parts": [p.to_dict() for p in self.parts[d.tensor]]}
                                            if d.tensor in self.parts else {})} for d in self.outputs],
            "output_parts": self.output_parts.to_dict() if self.output_parts is not None else [],
            "output_parts_decisions": self.output_parts.decisions() if self.output_parts is not None else [],
            "first_jump": first.to_dict() if first else None,
            "introduced": [d.to_dict() for d in self.introduced(top)],
            "worst": [d.to_dict() for d in self.worst(top)],
            "layers": [d.to_dict() for d in self.layers],
            "skipped": self.skipped,
            "rescaled": self.rescaled,
            "bodies": self.bodies,
            "nonfinite": [d.to_dict() for d in self.nonfinite()],
            "problem": self.problem(),
            "evaluation": self.evaluation,
        }


# --------------------------------------------------------------------------------------------- streaming
