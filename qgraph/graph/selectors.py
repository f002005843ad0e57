"""One selector language for every pass: names, regexes, op types and subgraph ranges, with exclusions.

In a recipe::

    nodes:
      names: [conv1, fc]            # exact node names
      regex: ["^encoder/layer_0/"]  # Python regexes searched in node names
      op_types: [Softmax, LayerNormalization]
      ranges:                       # every node on a path from `start` to `end` (tensor or node names)
        - {start: attention_in, end: attention_out}
      exclude:
        names: [conv1]

Include criteria are united; ``exclude`` is removed from the result. A selector with no include criteria
selects every node. Each criterion that matches nothing is reported (`Selection.unmatched`), never ignored.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import networkx as nx
import onnx_graphsurgeon as gs
from pydantic import BaseModel, ConfigDict, Field, field_validator

from qgraph.graph import GraphHandle
from qgraph.graph.names import NodeName


class SubgraphRange(BaseModel):
    """All nodes on a path from ``start`` to ``end``, both ends included; each is a tensor or node name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: str = Field(description="Tensor or node name where the range begins.")
    end: str = Field(description="Tensor or node name where the range ends.")


class NodeSelector(BaseModel):
    """Selects nodes of a graph (see module docs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    names: tuple[NodeName, ...] = Field(default=(), description="Exact node names.")
    regex: tuple[str, ...] = Field(default=(), description="Regular expressions searched in node names.")
    op_types: tuple[str, ...] = Field(default=(), description="ONNX op types, e.g. Conv, MatMul.")
    ranges: tuple[SubgraphRange, ...] = Field(default=(), description="Subgraphs between two tensors/nodes.")
    exclude: NodeSelector | None = Field(default=None, description="Nodes removed from the selection.")

    @field_validator("regex")
    @classmethod
    def _compiles(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for p in patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"invalid regular expression {p!r}: {exc}") from exc
        return patterns

    @property
    def is_everything(self) -> bool:
        """True when no include criterion is given (the selector selects every node)."""
        return not (self.names or self.regex or self.op_types or self.ranges)

    def describe(self) -> str:
        """Short human-readable form for reports."""
        parts = [f"names={list(self.names)}"] if self.names else []
        parts += [f"regex={list(self.regex)}"] if self.regex else []
        parts += [f"op_types={list(self.op_types)}"] if self.op_types else []
        parts += [f"ranges={[(r.start, r.end) for r in self.ranges]}"] if self.ranges else []
        if self.exclude is not None:
            parts.append(f"exclude=({self.exclude.describe()})")
        return ", ".join(parts) or "all nodes"

    def criterion(self, name: str, op_type: str) -> str:
        """Which include criterion selects a node of this name and op type, for a reason shown per node
        (``name in nodes.names``, ``regex '^enc/' in nodes.regex``, ...). Ranges are not resolved here: a
        node no other criterion names is said to be in a range (or everything, for an empty selector)."""
        if name in self.names:
            return "name in nodes.names"
        pattern = next((p for p in self.regex if re.search(p, name)), None)
        if pattern is not None:
            return f"regex {pattern!r} in nodes.regex"
        if op_type in self.op_types:
            return f"op_type {op_type} in nodes.op_types"
        return "in a range of nodes.ranges" if self.ranges else "all nodes selected"


@dataclass
class Selection:
    """The nodes a selector matched (in graph order) and the criteria that matched nothing."""

    nodes: list[gs.Node]
    unmatched: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """Names of the selected nodes."""
        return [n.name for n in self.nodes]


#: Other names and op types a node answers to: ``(node, name, op)``. A dynamically quantized MatMul's integer node
#: answers to the MatMul's name and op type it replaced (`qgraph.quant.dynamic_graph`).
Aliases = Sequence[tuple[gs.Node, str, str]]


def select(graph: GraphHandle, selector: NodeSelector, aliases: Aliases = ()) -> Selection:
    """Resolve ``selector`` on ``graph`` in O(N + criteria) (one index, one networkx view at most); a node is
    also chosen by any of its ``aliases``."""
    idx = graph.index
    nodes = idx.nodes
    unmatched: list[str] = []
    alias_node = {name: node for node, name, _ in aliases}
    if selector.is_everything:
        chosen = set(range(len(nodes)))
    else:
        chosen = set()
        for name in selector.names:
            node = idx.by_name.get(name, alias_node.get(name))
            if node is None:
                unmatched.append(f"names: {name!r} matched no node")
            else:
                chosen.add(idx.pos(node))
        for pattern in selector.regex:
            rx = re.compile(pattern)
            hits = {i for i, n in enumerate(nodes) if n.name and rx.search(n.name)}
            hits |= {idx.pos(n) for name, n in alias_node.items() if rx.search(name)}
            if not hits:
                unmatched.append(f"regex: {pattern!r} matched no node name")
            chosen |= hits
        if selector.op_types:
            wanted = set(selector.op_types)
            hits_by_op: dict[str, int] = dict.fromkeys(wanted, 0)
            ops = [(i, n.op) for i, n in enumerate(nodes)] + [(idx.pos(n), op) for n, _, op in aliases]
            for i, op in ops:
                if op in wanted:
                    chosen.add(i)
                    hits_by_op[op] += 1
            unmatched += [f"op_types: no {op} node in the graph" for op, c in hits_by_op.items() if c == 0]
        for rng in selector.ranges:
            hits, problem = _range(graph, rng)
            if problem:
                unmatched.append(problem)
            chosen |= hits
    if selector.exclude is not None:
        excluded = select(graph, selector.exclude, aliases)
        unmatched += [f"exclude {u}" for u in excluded.unmatched]
        chosen -= {idx.pos(n) for n in excluded.nodes}
    return Selection([nodes[i] for i in sorted(chosen)], unmatched)


def selects(selector: NodeSelector, name: str, op: str) -> bool:
    """Whether ``selector`` chooses a node of this name and op type by name, regex or op type (its ranges are
    resolved on a graph only: `select`)."""
    hit = selector.is_everything or name in selector.names or op in selector.op_types or any(
        re.search(p, name) for p in selector.regex)
    return hit and not (selector.exclude is not None and selects(selector.exclude, name, op))


def selected_ids(graph: GraphHandle, selector: NodeSelector) -> tuple[set[int] | None, list[str]]:
    """For passes that also walk nested graphs: ``id()`` of every selected node, or None when ``selector`` takes
    every node (no include criterion, no ``exclude``: `select` resolves only the top graph, so None also admits the
    nodes of If/Loop/Scan bodies); and the criteria that matched nothing."""
    if selector.is_everything and selector.exclude is None:
        return None, []
    selection = select(graph, selector)
    return {id(n) for n in selection.nodes}, list(selection.unmatched)


def _endpoints(graph: GraphHandle, name: str, as_start: bool) -> set[int] | None:
    idx = graph.index
    if name in idx.by_name:
        return {idx.pos(idx.by_name[name])}
    if as_start and name in idx.tensors:
        return {idx.pos(n) for n in idx.consumers.get(name, [])}
    if not as_start and name in idx.producer:
        return {idx.pos(idx.producer[name])}
    return None


def _range(graph: GraphHandle, rng: SubgraphRange) -> tuple[set[int], str | None]:
    starts = _endpoints(graph, rng.start, as_start=True)
    ends = _endpoints(graph, rng.end, as_start=False)
    if not starts:
        return set(), f"ranges: start {rng.start!r} is neither a node nor a consumed tensor"
    if not ends:
        return set(), f"ranges: end {rng.end!r} is neither a node nor a produced tensor"
    g = graph.nx
    forward: set[int] = set(starts)
    for s in starts:
        forward |= nx.descendants(g, s)
    backward: set[int] = set(ends)
    for e in ends:
        backward |= nx.ancestors(g, e)
    hits = forward & backward
    if not hits:
        return set(), f"ranges: no path from {rng.start!r} to {rng.end!r}"
    return hits, None
