"""One naming rule for nodes without a (unique) name, used by every part of qgraph that shows or selects nodes.

ONNX does not require node names, and exporters and quantizers (onnxruntime's ``quantize_static``) often leave them
empty or repeat them. qgraph gives every node of a model one name, the same wherever it is shown (``qgraph diff``,
``inspect``, ``sensitivity``, pass reports) and accepted wherever a node is selected (recipes' ``nodes.names``,
``float_fallback``, the sensitivity patch file):

- a node with a name no earlier node has keeps it, exactly;
- an unnamed node is named ``<OpType>(<first output>)``, e.g. ``HardSigmoid(/features/act_3/Mul_output_0)``
  (``<OpType>`` alone when it has no named output);
- a repeated name, or a generated name that another node already has, gets ``#2``, ``#3``... (``add1#2`` is the
  second node called ``add1``).

"Earlier" is the walk order: the top graph first, then each If/Loop/Scan body in the order `graph_scopes` lists
them (a scope before its children), nodes in graph order. Why the first output and not the position: tensor names
survive quantization (onnxruntime's quantizer and qgraph's passes keep the float tensors' names), so an unnamed
node gets the same name in the float model and in the QDQ model made from it, and ``qgraph diff`` pairs them by
name; a position changes with every inserted Q/DQ. Tensor names are unique in a model (single assignment), so
``#k`` is needed only for repeated node names and for sibling bodies (If branches) that reuse a tensor name.

`GraphHandle` applies the rule when it loads a model (so passes, outputs and reports carry the names);
`proto_node_names` gives the same names for a ``ModelProto`` without changing it (``qgraph diff``, ``inspect``);
`named_model` returns a model whose nodes carry them (the sensitivity search names its QDQ model once). The rule
is idempotent: on a model it already named, nothing changes. Cost: one walk over the nodes, O(N).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import onnx
import onnx_graphsurgeon as gs

from .ops import graph_scopes, proto_scopes, proto_subgraphs

#: How many renamed nodes `Naming.notice` lists by name.
SHOWN = 3


def node_label(name: str, op: str, outputs: Sequence[str]) -> str:
    """A node's name before de-duplication: ``name``, else ``<op>(<first named output>)``, else ``op``."""
    if name:
        return name
    first = next((o for o in outputs if o), "")
    return f"{op}({first})" if first else op


def gs_label(node: gs.Node) -> str:
    """`node_label` of a graphsurgeon node (for messages about a node that may not be named yet)."""
    return node_label(node.name, node.op, [t.name for t in node.outputs])


def proto_label(node: onnx.NodeProto) -> str:
    """`node_label` of a ``NodeProto``."""
    return node_label(node.name, node.op_type, node.output)


@dataclass
class Naming:
    """What the rule did: the final names in walk order, and the nodes it named or renamed."""

    names: list[str] = field(default_factory=list)
    unnamed: list[str] = field(default_factory=list)  # names given to nodes that had none
    repeated: list[tuple[str, str]] = field(default_factory=list)  # (old name, new name) of repeated names

    @property
    def changed(self) -> bool:
        """Whether any node got a name it did not have."""
        return bool(self.unnamed or self.repeated)

    def notice(self) -> str | None:
        """One sentence for reports saying which nodes were named and how to select them; None if none was."""
        parts = []
        if self.unnamed:
            shown = ", ".join(self.unnamed[:SHOWN]) + (", ..." if len(self.unnamed) > SHOWN else "")
            parts.append(f"{len(self.unnamed)} unnamed node(s) named <OpType>(<first output>) ({shown})")
        if self.repeated:
            shown = ", ".join(f"{a} → {b}" for a, b in self.repeated[:SHOWN])
            parts.append(f"{len(self.repeated)} repeated node name(s) numbered ({shown}"
                         f"{', ...' if len(self.repeated) > SHOWN else ''})")
        if not parts:
            return None
        return "; ".join(parts) + ": these are the names reports show and recipes select (nodes.names)"


def unique_names(nodes: Sequence[tuple[str, str, Sequence[str]]]) -> Naming:
    """The rule (module docs) on ``(name, op_type, output names)`` of every node of a model, in walk order.

    Linear: one pass collects the names in use, one assigns; the ``#k`` counter resumes per base name."""
    existing = {name for name, _, _ in nodes if name}
    taken: set[str] = set()
    next_k: dict[str, int] = {}
    out = Naming()
    for name, op, outputs in nodes:
        label = node_label(name, op, outputs)
        if name and name not in taken:
            final = name
        elif not name and label not in existing and label not in taken:
            final = label
        else:
            k = next_k.get(label, 2)
            while f"{label}#{k}" in existing or f"{label}#{k}" in taken:
                k += 1
            next_k[label] = k + 1
            final = f"{label}#{k}"
        taken.add(final)
        out.names.append(final)
        if not name:
            out.unnamed.append(final)
        elif final != name:
            out.repeated.append((name, final))
    return out


def name_graph(root: gs.Graph) -> Naming:
    """Apply the rule to every node of ``root`` and its nested graphs, in place.

    The cyclic GC is paused meanwhile: the walk allocates only acyclic strings and tuples, but enough of them to
    trigger collections that each traverse the whole graph (4x the cost of naming at 48k nodes)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        nodes = [node for g in graph_scopes(root) for node in g.nodes]
        naming = unique_names([(n.name or "", n.op, [t.name for t in n.outputs]) for n in nodes])
        if naming.changed:
            for node, name in zip(nodes, naming.names, strict=True):
                node.name = name
    finally:
        if enabled:
            gc.enable()
    return naming


def proto_node_names(graph: onnx.GraphProto) -> tuple[list[tuple[onnx.GraphProto, list[str]]], Naming]:
    """The rule's names for ``graph`` (a model's top graph) without changing it: ``(scope, its node names)`` for
    every GraphProto of `proto_scopes`, in node order (key them by ``id(scope)`` while holding this list: protobuf
    gives the same wrapper object only while one is alive)."""
    scopes = proto_scopes(graph)
    naming = unique_names([(n.name, n.op_type, n.output) for g in scopes for n in g.node])
    per_scope: list[tuple[onnx.GraphProto, list[str]]] = []
    start = 0
    for g in scopes:
        per_scope.append((g, naming.names[start : start + len(g.node)]))
        start += len(g.node)
    return per_scope, naming


def named_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Naming]:
    """``model`` itself when every node already has its rule name, else a copy whose nodes carry them."""
    scopes = proto_scopes(model.graph)
    naming = unique_names([(n.name, n.op_type, n.output) for g in scopes for n in g.node])
    if not naming.changed:
        return model, naming
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = iter(naming.names)
    for g in proto_scopes(out.graph):
        for node in g.node:
            node.name = next(names)
    return out, naming


def named_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """``graph``'s nodes carrying the rule's names, bodies included, without copying the graph: a node is copied
    only when it or a node of its bodies gets a new name (for hashing a model as qgraph names it)."""
    scopes, naming = proto_node_names(graph)
    if not naming.changed:
        yield from graph.node
        return
    names = {id(g): n for g, n in scopes}  # `scopes` keeps the wrappers alive, so the ids stay valid
    for node, name in zip(scopes[0][0].node, scopes[0][1], strict=True):
        if name == node.name and not proto_subgraphs(node):
            yield node
            continue
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = name
        _rename_bodies(node, copy, names)
        yield copy


def _rename_bodies(node: onnx.NodeProto, copy: onnx.NodeProto, names: dict[int, list[str]]) -> None:
    for body, body_copy in zip(proto_subgraphs(node), proto_subgraphs(copy), strict=True):
        for inner, inner_copy, name in zip(body.node, body_copy.node, names[id(body)], strict=True):
            inner_copy.name = name
            _rename_bodies(inner, inner_copy, names)
