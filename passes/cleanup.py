"""``cleanup``: remove no-op nodes, dead code and duplicate weights; name every node; toposort.

Rewrites, in every scope (the top graph, then If/Loop/Scan bodies)::

    Identity:   y = Identity(x)             → consumers of y read x
    Dropout:    y[, mask] = Dropout(x, ...)  → consumers of y read x   (inference mode, mask unused)
                (when y is a graph output, x's producer writes y directly; between a graph input or a
                 constant and a graph output the node stays, since a graph output needs a producer)
    dead code:  nodes that no graph output depends on, and initializers nothing reads, are removed
    duplicates: initializers with the same dtype, shape and bytes → one (the first, outermost), readers rewired
    names:      unnamed node → "<op>(<first output>)"; a repeated name → "<name>#<k>" (first use keeps it), the
                rule every model gets on load (`qgraph.graph.naming`): here for nodes a pass left unnamed
    order:      nodes are sorted topologically (iterative Kahn) only when they are not already in order

Dropout counts as inference mode when ``training_mode`` is absent or a constant false (opset >= 12), and when
``is_test`` is set (opset < 7). Everything is O(N) plus one hash of the initializers whose dtype and shape
collide with another's; large fan-outs are rewired in bulk.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from pydantic import Field

from qgraph import GraphHandle, ModelError, Pass, PassConfig, PassContext, PassDetails, PassResult, register
from qgraph.graph import (
    const_value,
    graph_scopes,
    is_default_domain,
    is_topological,
    producer,
    rebuild,
    redirect,
    topological_order,
    unique_names,
)

#: Everything cleanup counts (each is a rewrite: a second run reports all zeros).
_COUNTS = (
    "identity",
    "dropout",
    "dead_nodes",
    "unused_initializers",
    "unused_graph_inputs",
    "duplicate_initializers",
    "renamed_nodes",
    "reordered_graphs",
)


@dataclass(frozen=True)
class CleanupDetails(PassDetails):
    """What `Cleanup` removed, renamed and reordered (one count per ``_COUNTS`` key), over how many scopes."""

    identity: int
    dropout: int
    dead_nodes: int
    unused_initializers: int
    unused_graph_inputs: int
    duplicate_initializers: int
    renamed_nodes: int
    reordered_graphs: int
    scopes: int


class CleanupConfig(PassConfig):
    """Options of `Cleanup`."""

    remove_identity: bool = Field(default=True, description="Bypass Identity nodes.")
    remove_dropout: bool = Field(default=True, description="Bypass inference-mode Dropout nodes.")
    remove_dead: bool = Field(default=True, description="Remove nodes no graph output depends on.")
    remove_unused_graph_inputs: bool = Field(
        default=False, description="Also drop graph inputs nothing reads (changes the model's interface)."
    )
    dedupe_initializers: bool = Field(default=True, description="Merge initializers with identical bytes.")
    name_nodes: bool = Field(default=True, description="Give every node a unique, stable name.")
    toposort: bool = Field(default=True, description="Sort nodes topologically when they are out of order.")
    recurse_subgraphs: bool = Field(default=True, description="Also clean If/Loop/Scan bodies.")


@register
class Cleanup(Pass[CleanupConfig]):
    """Remove Identity/inference Dropout, dead nodes, unused and duplicate initializers; name nodes; toposort.

    Rewrite: ``y = Identity(x)`` / ``y = Dropout(x)`` ⇒ readers of ``y`` read ``x``; duplicate initializers
    (same dtype, shape, bytes) ⇒ one; unnamed node ⇒ ``<op>(<first output>)`` (`qgraph.graph.naming`, as on
    load); out-of-order nodes ⇒ Kahn order.
    """

    name = "cleanup"
    config_class = CleanupConfig
    preserves_float = True

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Clean every scope and report what was removed, merged, renamed and reordered."""
        cfg = self.config
        res = PassResult()
        stats: Counter[str] = Counter()
        scopes = graph_scopes(graph.graph, cfg.recurse_subgraphs)
        nodes_before = sum(len(g.nodes) for g in scopes)
        for g in scopes:
            _bypass_noops(g, cfg, graph.opset, stats, res)
        if cfg.remove_dead or cfg.remove_unused_graph_inputs:
            consts_before = _count_constants(scopes)
            inputs_before = len(graph.graph.inputs)
            graph.cleanup(remove_unused_graph_inputs=cfg.remove_unused_graph_inputs)
            scopes = graph_scopes(graph.graph, cfg.recurse_subgraphs)
            stats["unused_initializers"] = consts_before - _count_constants(scopes)
            stats["unused_graph_inputs"] = inputs_before - len(graph.graph.inputs)
        nodes_after = sum(len(g.nodes) for g in scopes)
        stats["dead_nodes"] = nodes_before - nodes_after - stats["identity"] - stats["dropout"]
        if cfg.dedupe_initializers:
            stats["duplicate_initializers"] = _dedupe(scopes)
        if cfg.name_nodes:
            stats["renamed_nodes"] = _name_nodes(scopes)
        if cfg.toposort:
            stats["reordered_graphs"] = _toposort(graph, scopes)
        res.matched = stats["identity"] + stats["dropout"]
        res.rewritten = sum(stats[k] for k in _COUNTS)
        res.nodes_removed = nodes_before - nodes_after
        res.details = CleanupDetails(**{k: int(stats[k]) for k in _COUNTS}, scopes=len(scopes))
        return res


# ---------------------------------------------------------------------------------------------- no-ops
def _dropout_reason(node: gs.Node, opset: int, outputs: set[int]) -> str | None:
    """Why ``node`` (a Dropout) cannot be bypassed, or None if it is an inference no-op."""
    if len(node.outputs) > 1 and node.outputs[1].name and (node.outputs[1].outputs or id(node.outputs[1]) in outputs):
        return "its mask output is used"
    if opset < 7 and int(node.attrs.get("is_test", 0)) == 0:
        return "is_test=0 declares training mode (opset < 7)"
    if len(node.inputs) > 2 and node.inputs[2].name:
        mode = const_value(node.inputs[2])
        if mode is None:
            return "training_mode is not a constant"
        if bool(np.asarray(mode).reshape(-1)[0]):
            return "training_mode is true"
    return None


def _bypass_noops(g: gs.Graph, cfg: CleanupConfig, opset: int, stats: Counter[str], res: PassResult) -> None:
    outputs = {id(t) for t in g.outputs}
    inputs = {id(t) for t in g.inputs}
    local = {id(n) for n in g.nodes}
    removed: list[gs.Node] = []
    for node in g.nodes:
        if not is_default_domain(node.domain) or not node.inputs or not node.outputs:
            continue
        if node.op == "Identity" and cfg.remove_identity:
            kind = "identity"
        elif node.op == "Dropout" and cfg.remove_dropout:
            reason = _dropout_reason(node, opset, outputs)
            if reason is not None:
                res.skip(node.name, f"Dropout kept: {reason}")
                continue
            kind = "dropout"
        else:
            continue
        x, y = node.inputs[0], node.outputs[0]
        if not x.name:
            continue
        if id(y) not in outputs:
            redirect(y, x)
        else:
            # y must keep a producer: let x's producer write y (if x is a plain local intermediate).
            prod = producer(x)
            if (
                prod is None
                or id(prod) not in local
                or id(x) in outputs
                or id(x) in inputs
                or isinstance(x, gs.Constant)
            ):
                continue
            list.clear(y.inputs)
            list.clear(node.outputs)
            redirect(x, y, keep=[node])
            prod.outputs[prod.outputs.index(x)] = y
        stats[kind] += 1
        removed.append(node)
    rebuild(g, removed)


# ---------------------------------------------------------------------------------------------- initializers
def _constants(scopes: list[gs.Graph]) -> list[gs.Constant]:
    seen: dict[int, gs.Constant] = {}
    for g in scopes:
        for node in g.nodes:
            for t in node.inputs:
                if isinstance(t, gs.Constant):
                    seen.setdefault(id(t), t)
    return list(seen.values())


def _count_constants(scopes: list[gs.Graph]) -> int:
    return len(_constants(scopes))


def _dedupe(scopes: list[gs.Graph]) -> int:
    """Merge constants with identical dtype, shape and bytes; returns how many were merged away."""
    protected = {id(t) for g in scopes for t in [*g.inputs, *g.outputs]}
    by_layout: dict[tuple[str, tuple[int, ...]], list[gs.Constant]] = {}
    for c in _constants(scopes):
        if id(c) in protected:
            continue
        values = np.asarray(c.values)
        if values.dtype == object:
            continue
        by_layout.setdefault((values.dtype.str, tuple(values.shape)), []).append(c)
    merged = 0
    for group in by_layout.values():
        if len(group) < 2:
            continue
        first: dict[bytes, gs.Constant] = {}
        for c in group:
            digest = hashlib.sha256(np.ascontiguousarray(c.values).tobytes()).digest()
            keep = first.setdefault(digest, c)
            if keep is not c:
                redirect(c, keep)
                merged += 1
    return merged


# ---------------------------------------------------------------------------------------------- names, order
def _name_nodes(scopes: list[gs.Graph]) -> int:
    """Unique names over every scope by qgraph's one rule (`qgraph.graph.naming`): unnamed → ``<op>(<first
    output>)``, repeats → ``<name>#2``... Models are named so on load: this catches nodes a pass left unnamed."""
    nodes = [node for g in scopes for node in g.nodes]
    naming = unique_names([(n.name or "", n.op, [t.name for t in n.outputs]) for n in nodes])
    for node, name in zip(nodes, naming.names, strict=True):
        node.name = name  # pass tags are keyed by name: the first user of a repeated name keeps its tag
    return len(naming.unnamed) + len(naming.repeated)


def _toposort(handle: GraphHandle, scopes: list[gs.Graph]) -> int:
    reordered = 0
    for g in scopes:
        if is_topological(g.nodes):
            continue
        if g is handle.graph:
            handle.toposort()
        else:
            order = topological_order(g.nodes)
            if order is None:
                raise ModelError(f"subgraph {g.name!r} has a cycle; ONNX graphs must be acyclic.")
            g.nodes = order
        reordered += 1
    return reordered
