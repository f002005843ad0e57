"""Output parts: a graph output that joins different quantities through a final ``Concat`` is scored part by part.

A detector often writes boxes (0..320 px) and sigmoid class scores (0..1) into one output (YOLOv8's ``output0
[1, 22, 2100] = Concat(axis=1)(boxes [1, 4, 2100], scores [1, 18, 2100])``). Scored as one tensor, the output's
SQNR is the boxes' (their signal power is ~10^5 times the scores'), and the scores are invisible: on YOLOv8n the
INT8 ``output0`` reads 30 dB while its score rows are at 13 dB.

`find_output_parts` finds, for a model, every graph output produced by a ``Concat`` with two or more inputs whose
sizes along the concat axis are known statically (from the model's shapes and ONNX shape inference; other
dimensions may be symbolic, e.g. YOLO's anchor count). The output is looked for behind a trailing ``Q -> DQ`` pair
(a quantized output) and each input behind its own ``DQ(Q(x))``, so a float model and the QDQ model made from it
get the same parts, named by the float tensors. Each such output gets one `OutputPart` per Concat input; every
other output is one part (the whole output). A Concat whose sizes along the axis are not static leaves its output
whole, and `OutputSplit.reason` says why. Cost: one producer index and at most one shape inference (only when some
output comes from a Concat): linear in the graph.

Every scorer cuts outputs with `OutputPart.cut` (batch-concatenated arrays included) and folds them with
`PartDiffs`, so they all measure the same parts. Scores that are a minimum over outputs become a minimum over the
parts of every output. By the mediant inequality (``Σr²/Σe²`` of the whole lies between the parts' ratios) that
minimum is never above the whole output's SQNR: targets only get stricter. `OutputParts.whole` is the opt-out
(``output_parts: false`` in the passes that score by outputs, ``--whole-outputs`` on the commands).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import onnx

from qgraph.graph.ops import Inferred
from qgraph.graph.shapes import skeleton, static_shapes
from qgraph.quant.qdq import float_behind, is_qdq
from qgraph.runtime.compare import DiffAccumulator, TensorDiff
from qgraph.runtime.part import OutputPart

__all__ = ["OutputPart", "OutputParts", "OutputSplit", "PartDiffs", "find_output_parts", "output_parts_of", "worst"]

#: Parts named in a decision sentence before "and N more".
_NAMED_PARTS = 4


@dataclass(frozen=True)
class OutputSplit:
    """How one graph output is scored: its parts (one when whole), and why a Concat output stays whole."""

    output: str
    parts: tuple[OutputPart, ...]
    #: Set when the output comes from a Concat that could not be split (sizes along the axis not static).
    reason: str | None = None

    @property
    def split(self) -> bool:
        """Whether the output is scored as several parts."""
        return len(self.parts) > 1

    def describe(self) -> str | None:
        """The decision sentence for a split output or a Concat output kept whole; None for a plain output."""
        if self.reason is not None:
            return f"{self.output} is scored whole: {self.reason}"
        if not self.split:
            return None
        named = [f"{p.source} [{p.size}]" for p in self.parts[:_NAMED_PARTS]]
        more = len(self.parts) - len(named)
        listed = ", ".join(named[:-1]) + f" and {named[-1]}" if not more else ", ".join(named) + f" and {more} more"
        return (f"{self.output} is scored as {len(self.parts)} parts (Concat on axis {self.parts[0].axis} of "
                f"{listed}); the worst part decides")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"output": self.output, "split": self.split, "reason": self.reason,
                "parts": [p.to_dict() for p in self.parts] if self.split else []}


@dataclass(frozen=True)
class OutputParts:
    """The scored parts of every graph output of a model, in graph-output order."""

    outputs: tuple[OutputSplit, ...]

    @classmethod
    def whole(cls, names: Iterable[str]) -> OutputParts:
        """Every output in ``names`` scored whole (the opt-out)."""
        return cls(tuple(OutputSplit(n, (OutputPart(n, n),)) for n in names))

    @property
    def names(self) -> list[str]:
        """The graph outputs, in order."""
        return [s.output for s in self.outputs]

    @property
    def parts(self) -> list[OutputPart]:
        """Every scored part, output by output (a whole output is one part)."""
        return [p for s in self.outputs for p in s.parts]

    @property
    def split(self) -> bool:
        """Whether some output is scored as several parts."""
        return any(s.split for s in self.outputs)

    def without_parts(self) -> OutputParts:
        """The same outputs, each scored whole."""
        return OutputParts.whole(self.names)

    def decisions(self, selected: Sequence[str] = ()) -> list[str]:
        """One sentence per split output and per Concat output kept whole (only ``selected`` outputs when given)."""
        lines = [s.describe() for s in self.outputs if not selected or s.output in selected]
        return [line for line in lines if line]

    def to_dict(self) -> list[dict[str, Any]]:
        """JSON-ready form: the outputs that come from a Concat (split or not)."""
        return [s.to_dict() for s in self.outputs if s.split or s.reason is not None]


# ----------------------------------------------------------------------------------------------- finding them
def find_output_parts(model: onnx.ModelProto, shapes: Inferred | None = None) -> OutputParts:
    """The parts of every graph output of ``model`` (see module docs); ``shapes`` (name -> (shape, type), as
    `qgraph.GraphHandle.shapes` gives) saves the shape inference when known."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    splits: list[OutputSplit] = []
    for out in graph.output:
        concat = _concat_behind(out.name, producer)
        if concat is None:
            splits.append(OutputSplit(out.name, (OutputPart(out.name, out.name),)))
            continue
        if shapes is None:
            shapes = _infer(model)
        splits.append(_split(out.name, concat, producer, shapes, _declared(out)))
    return OutputParts(tuple(splits))


def output_parts_of(model: onnx.ModelProto | str | Path, enabled: bool = True) -> OutputParts:
    """`find_output_parts` of a model in memory or a file (read without its external data: shapes only), or
    every output whole when not ``enabled``."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    if not enabled:
        return OutputParts.whole(o.name for o in proto.graph.output)
    return find_output_parts(proto)


def _concat_behind(name: str, producer: dict[str, onnx.NodeProto]) -> onnx.NodeProto | None:
    """The Concat writing graph output ``name`` directly or through a trailing ``Q -> DQ`` pair (or Identity)."""
    node = producer.get(name)
    for _ in range(8):
        if node is None or node.domain not in ("", "ai.onnx", "com.microsoft"):
            return None
        if node.op_type == "Concat":
            return node if node.domain in ("", "ai.onnx") else None
        if node.op_type == "Identity" or is_qdq(node.op_type, node.domain):
            node = producer.get(node.input[0]) if node.input else None
            continue
        return None
    return None




def _declared(info: onnx.ValueInfoProto) -> tuple[int | None, ...] | None:
    t = info.type.tensor_type
    if not info.type.HasField("tensor_type") or not t.HasField("shape"):
        return None
    return tuple(int(d.dim_value) if d.HasField("dim_value") else None for d in t.shape.dim)


def _split(name: str, concat: onnx.NodeProto, producer: dict[str, onnx.NodeProto], shapes: Inferred,
           declared: tuple[int | None, ...] | None) -> OutputSplit:
    """The parts of output ``name`` written by ``concat``, or the output whole with the reason."""
    whole = (OutputPart(name, name),)
    inputs = [t for t in concat.input if t]
    if len(inputs) < 2:
        return OutputSplit(name, whole)
    axis = next((int(a.i) for a in concat.attribute if a.name == "axis"), 0)
    known = [shape for t in (concat.output[0], *inputs) if (shape := (shapes.get(t) or (None, 0))[0]) is not None]
    ranks = [len(shape) for shape in known]
    rank = ranks[0] if ranks else (len(declared) if declared is not None else None)
    if axis < 0:
        if rank is None:
            return OutputSplit(name, whole, f"the rank of its Concat's output is unknown, so axis {axis} is too")
        axis += rank
    sizes: list[int | None] = []
    for t in inputs:
        shape = (shapes.get(t) or (None, 0))[0]
        sizes.append(shape[axis] if shape is not None and axis < len(shape) else None)
    if any(s is None for s in sizes):
        listed = ", ".join(f"{float_behind(t, producer)} [{'?' if s is None else s}]" for t, s in zip(inputs, sizes,
                                                                                               strict=True))
        return OutputSplit(name, whole, f"the sizes of its Concat's inputs along axis {axis} are not static "
                           f"({listed}); give the model static sizes there to score each input separately")
    parts: list[OutputPart] = []
    start, length = 0, sum(s or 0 for s in sizes)
    for t, s in zip(inputs, sizes, strict=True):
        assert s is not None
        if s > 0:  # an empty input writes nothing
            parts.append(OutputPart(name, float_behind(t, producer), axis, start, start + s, length))
        start += s
    return OutputSplit(name, tuple(parts)) if len(parts) > 1 else OutputSplit(name, whole)


def _infer(model: onnx.ModelProto) -> Inferred:
    """Shapes of ``model``'s tensors from a weightless skeleton (weights as typed inputs): O(nodes)."""
    return static_shapes(skeleton(model))


# ----------------------------------------------------------------------------------------------- measuring them
class PartDiffs:
    """Streams (reference, candidate) outputs of a model (by position) into one `DiffAccumulator` per output and
    per part of each split output, in O(1) memory."""

    def __init__(self, parts: OutputParts, names: Sequence[str] | None = None) -> None:
        self.layout = parts
        names = list(names) if names is not None else parts.names
        self.wholes = [DiffAccumulator(n) for n in names]
        self.cuts = [[(p, DiffAccumulator(p.label)) for p in s.parts] if s.split else [] for s in parts.outputs]

    def add(self, references: Sequence[Any], candidates: Sequence[Any]) -> None:
        """Fold one sample (or batch) of every output; ValueError when shapes disagree."""
        for k, (r, c) in enumerate(zip(references, candidates, strict=True)):
            self.wholes[k].add(r, c)
            for part, acc in self.cuts[k]:
                acc.add(part.cut(r), part.cut(c))

    def whole(self) -> list[TensorDiff]:
        """One diff per output."""
        return [a.result() for a in self.wholes]

    def by_output(self) -> list[tuple[TensorDiff, list[TensorDiff]]]:
        """Per output: its diff, and the diffs of its parts (each with its `TensorDiff.part`; empty when whole)."""
        return [(acc.result(), [replace(a.result(), part=p) for p, a in cuts])
                for acc, cuts in zip(self.wholes, self.cuts, strict=True)]

    def scored(self) -> list[TensorDiff]:
        """One diff per scored part: the parts of a split output, else the whole output."""
        return [d for whole, parts in self.by_output() for d in (parts or [whole])]


def worst(diffs: Sequence[TensorDiff]) -> TensorDiff | None:
    """The diff with the lowest SQNR (NaN first: not comparable), or None for no diffs."""
    return min(diffs, key=lambda d: -math.inf if math.isnan(d.sqnr_db) else d.sqnr_db, default=None)
