"""What ``insert_qdq`` plans: units (one integer op with what it absorbed), the plan, and the facts about nodes
they need (`label`, `is_depthwise`): below every other module of the pass, so they share these types without
importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import onnx_graphsurgeon as gs

from qgraph.graph import gs_label

#: What kind of integer op a unit becomes: a weighted op (Conv/Gemm/MatMul with a constant weight), a MatMul of
#: two activations, a binary or variadic op, a unary op, or a dynamically quantized MatMul/Gemm.
UnitKind = Literal["weighted", "matmul2", "binary", "variadic", "unary", "dynamic"]


@dataclass
class Unit:
    """One integer op: the node, the tensors it reads quantized, its weight/bias and what it absorbed."""

    node: gs.Node
    kind: UnitKind
    act_inputs: list[str] = field(default_factory=list)
    weight_index: int | None = None
    weight_axis: int | None = None
    bias: tuple[gs.Node, int] | None = None
    const_inputs: list[int] = field(default_factory=list)
    absorbed: list[gs.Node] = field(default_factory=list)
    output: str | None = None
    needs_q_out: bool = False

    @property
    def last(self) -> gs.Node:
        """The node producing the unit's output (the last absorbed node, or the op itself)."""
        return self.absorbed[-1] if self.absorbed else self.node


@dataclass
class Plan:
    """Where Q/DQ go: units, integer data-movement nodes, quantized tensors with their parameter roots."""

    units: list[Unit]
    movement: list[gs.Node]
    tensors: dict[str, str]  # quantized tensor -> root tensor whose range/params it shares
    readers: dict[str, set[int]]  # tensor -> ids of nodes that must read its DQ (producer not integer)
    producers: set[int]  # ids of nodes whose outputs are integer (all consumers read the DQ)
    skipped: list[tuple[str, str]]

    @property
    def roots(self) -> list[str]:
        """Tensors to calibrate (one per group), in graph order."""
        return list(dict.fromkeys(self.tensors.values()))


def label(node: gs.Node) -> str:
    """A node's name, or ``Op(first output)`` for unnamed nodes (reports must say which node): qgraph's one naming
    rule (`qgraph.graph.naming`), which already named every node of a loaded model."""
    return gs_label(node)


def is_depthwise(node: gs.Node, w: np.ndarray | None) -> bool:
    """A Conv with groups of one input channel (weight ``[C·m, 1, kh, kw]``)."""
    return (node.op == "Conv" and int(node.attrs.get("group", 1)) > 1 and w is not None and w.ndim > 2
            and w.shape[1] == 1)
