"""Structural checks: the ones every input model gets (unique names, no cycle) and the one the pipeline runs
after every pass (`check_structure`: no dangling input, one producer per tensor, arity and required attributes
as the op's schema says, acyclic), each O(N) and without exporting the graph."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import lru_cache

import networkx
import onnx
import onnx_graphsurgeon as gs

from qgraph.errors import ModelError

from .naming import gs_label, proto_label
from .ops import graph_scopes, is_default_domain, is_topological, topological_order

#: At most this many problems are listed by `check_structure` (the first ones say enough).
MAX_PROBLEMS = 10


def cycle_message(g: networkx.DiGraph, label: Callable[[Hashable], str] = str) -> str:
    """The user-facing sentence for a cyclic graph ``g``, naming the nodes of one cycle (``label`` names a node)."""
    try:
        cycle = [label(edge[0]) for edge in networkx.find_cycle(g)]
    except networkx.NetworkXNoCycle:
        cycle = []
    shown = " -> ".join(cycle[:8]) + (" -> ..." if len(cycle) > 8 else "")
    return (
        f"the graph has a cycle ({shown}); ONNX graphs must be acyclic. Fix the exporter or the graph surgery "
        "that produced it."
    )


def check_acyclic(model: onnx.ModelProto) -> None:
    """Raise `ModelError` naming the nodes of a cycle if the model's top graph is cyclic."""
    nodes = model.graph.node
    producer = {t: i for i, node in enumerate(nodes) for t in node.output}
    edges = [(producer[t], j) for j, node in enumerate(nodes) for t in node.input if t in producer and producer[t] != j]
    g = networkx.DiGraph()
    g.add_nodes_from(range(len(nodes)))
    g.add_edges_from(edges)
    if networkx.is_directed_acyclic_graph(g):
        return
    raise ModelError(cycle_message(g, lambda i: proto_label(nodes[i])))


def gs_cycle_message(nodes: list[gs.Node]) -> str:
    """`cycle_message` for graphsurgeon nodes."""
    producer = {t.name: gs_label(n) for n in nodes for t in n.outputs}
    g = networkx.DiGraph()
    g.add_edges_from((producer[t.name], gs_label(n)) for n in nodes for t in n.inputs if t.name in producer)
    return cycle_message(g)


def check_unique_names(model: onnx.ModelProto) -> None:
    """Raise `ModelError` when two initializers, or two node outputs, or an initializer and a node output share a
    name in the top graph: onnxruntime then silently uses one of them, so the model computes something else."""
    seen: dict[str, str] = {}
    for t in model.graph.initializer:
        if t.name in seen:
            raise ModelError(f"the model has two initializers named {t.name!r}; onnxruntime would silently use one "
                             "of them. Rename or remove the duplicate (names must be unique in a graph).")
        seen[t.name] = "initializer"
    for node in model.graph.node:
        for name in node.output:
            if not name:
                continue
            if name in seen:
                raise ModelError(f"tensor {name!r} is produced twice (by node {proto_label(node)!r} and by "
                                 f"{seen[name]}); every tensor must have exactly one producer. Rename one of them.")
            seen[name] = f"node {proto_label(node)!r}"


def check_model(model: onnx.ModelProto) -> None:
    """The structural checks every input model gets before any work: unique names, no cycle."""
    check_unique_names(model)
    check_acyclic(model)


def check_input_structure(graph: gs.Graph, opset: int) -> None:
    """`check_structure` on an input model, before any pass: an invalid model (a tensor nothing produces, an op the
    default domain does not have, an output nobody produces, in any scope) raises `ModelError` blaming the model,
    not the first pass that would have met it."""
    problems = check_structure(graph, opset)
    if problems:
        raise ModelError(f"the input model is not a valid ONNX graph: {'; '.join(problems)}. Fix the model (or the "
                         "exporter that wrote it); `qgraph inspect` lists its nodes.")


@lru_cache(maxsize=4096)
def _schema(op: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return None


def check_structure(graph: gs.Graph, opset: int) -> list[str]:
    """Problems that make ``graph`` (all scopes) an invalid ONNX graph, at most `MAX_PROBLEMS` of them: inputs
    nothing produces, tensors produced twice, default-domain ops that do not exist at ``opset`` or have the wrong
    number of inputs/outputs or miss a required attribute, cycles. Empty when the graph is sound."""
    problems: list[str] = []
    scopes = graph_scopes(graph)
    inputs = {id(t) for g in scopes for t in g.inputs}
    for g in scopes:
        if len(problems) >= MAX_PROBLEMS:
            break
        for node in g.nodes:
            problems += _node_problems(node, inputs, opset)
        for t in g.outputs:
            if isinstance(t, gs.Variable) and not t.inputs and id(t) not in inputs:
                problems.append(f"graph output {t.name!r} is produced by no node")
        # sorted nodes are acyclic: the one-walk check first, Kahn's algorithm only for an unsorted scope
        if not is_topological(g.nodes) and topological_order(g.nodes) is None:
            problems.append(gs_cycle_message(g.nodes))
    return problems[:MAX_PROBLEMS]


def _node_problems(node: gs.Node, graph_inputs: set[int], opset: int) -> list[str]:
    where = f"{node.op} node {node.name!r}"
    out: list[str] = []
    for t in node.inputs:
        if isinstance(t, gs.Variable) and t.name and not t.inputs and id(t) not in graph_inputs:
            out.append(f"{where}: input {t.name!r} is produced by no node and is no graph input (dangling)")
    for t in node.outputs:
        if len(t.inputs) > 1:
            out.append(f"{where}: output {t.name!r} is produced by {len(t.inputs)} nodes")
    if not is_default_domain(node.domain):
        return out
    schema = _schema(node.op, opset)
    if schema is None:
        return [*out, f"{where}: {node.op} does not exist at opset {opset}"]
    n_in = len(node.inputs)
    while n_in and not node.inputs[n_in - 1].name:  # trailing omitted optionals
        n_in -= 1
    if not schema.min_input <= n_in <= schema.max_input:
        out.append(f"{where}: has {n_in} input(s), {node.op}-{schema.since_version} takes "
                   f"{schema.min_input}..{schema.max_input}")
    if not schema.min_output <= len(node.outputs) <= schema.max_output:
        out.append(f"{where}: has {len(node.outputs)} output(s), {node.op}-{schema.since_version} gives "
                   f"{schema.min_output}..{schema.max_output}")
    for name, attr in schema.attributes.items():
        if attr.required and name not in node.attrs:
            out.append(f"{where}: misses the required attribute {name!r}")
    return out
