"""Graph operations for passes: reading constants, rewiring uses, dropping and inserting nodes, ordering.

Everything here works on onnx-graphsurgeon objects through their own producer/consumer links
(``tensor.inputs`` / ``tensor.outputs``), so it works the same in the top graph and in If/Loop/Scan bodies
(which the handle's index does not cover) and every helper is O(size of what it touches):

- `graph_scopes` lists the top graph and every nested graph, outermost first;
- `const_value` reads an initializer or a ``Constant`` node output in any scope;
- `redirect` moves every consumer of one tensor to another in O(fan-out) (graphsurgeon's own list
  bookkeeping is O(fan-out) per consumer, O(fan-out²) for a whole fan-out);
- `detach` and `rebuild` drop and insert nodes in one pass over the node list (`insert_after_producers`, its
  twin on a GraphProto, places in-graph reductions);
- `topological_order` is Kahn's algorithm (iterative: graphsurgeon's recursive sort overflows on long chains).

Shapes and dtypes after shape inference come from `GraphHandle.shapes` (cached until the graph changes).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs

Shape = tuple[int | None, ...]
#: What shape inference found for a tensor: its shape (None if unknown) and its ONNX element type (0 if unknown).
Inferred = dict[str, tuple[Shape | None, int]]

#: The spellings of ONNX's default operator domain (graphsurgeon reports None for a node without one).
DEFAULT_DOMAINS: tuple[str | None, ...] = ("", "ai.onnx", None)


def is_default_domain(domain: str | None) -> bool:
    """Whether ``domain`` names ONNX's default operator set."""
    return domain in DEFAULT_DOMAINS


def node_subgraphs(node: gs.Node) -> list[gs.Graph]:
    """The graphs held in ``node``'s attributes (If branches, Loop/Scan bodies)."""
    out: list[gs.Graph] = []
    for value in node.attrs.values():
        if isinstance(value, gs.Graph):
            out.append(value)
        elif isinstance(value, list):
            out.extend(v for v in value if isinstance(v, gs.Graph))
    return out


def graph_scopes(root: gs.Graph, recurse: bool = True) -> list[gs.Graph]:
    """``root`` and (if ``recurse``) every nested graph, breadth first: a scope comes before its children."""
    scopes = [root]
    if not recurse:
        return scopes
    i = 0
    while i < len(scopes):
        for node in scopes[i].nodes:
            scopes.extend(node_subgraphs(node))
        i += 1
    return scopes


def proto_subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs in a NodeProto's attributes (If branches, Loop/Scan bodies)."""
    out: list[onnx.GraphProto] = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            out.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            out.extend(attr.graphs)
    return out


def proto_scopes(root: onnx.GraphProto) -> list[onnx.GraphProto]:
    """``root`` and every nested GraphProto, a scope before its children (the proto twin of `graph_scopes`)."""
    scopes = [root]
    i = 0
    while i < len(scopes):
        for node in scopes[i].node:
            scopes.extend(proto_subgraphs(node))
        i += 1
    return scopes


def insert_after_producers(graph: onnx.GraphProto, after: Mapping[str, Sequence[onnx.NodeProto]]) -> None:
    """Put the nodes ``after[t]`` right after the node that produces tensor ``t`` in ``graph`` (in place, one walk
    over the node list); those of a tensor no node produces (a graph input, an initializer) go at the end.

    For in-graph reductions: a reduction placed right after its tensor's producer lets onnxruntime free the tensor
    as soon as it is reduced, where one appended at the end would keep every reduced activation alive to the end."""
    pending = {t: list(nodes) for t, nodes in after.items()}
    ordered: list[onnx.NodeProto] = []
    for node in graph.node:
        ordered.append(node)
        for t in node.output:
            ordered.extend(pending.pop(t, []))
    for rest in pending.values():
        ordered.extend(rest)
    del graph.node[:]
    graph.node.extend(ordered)


def producer(tensor: gs.Tensor) -> gs.Node | None:
    """The node producing ``tensor`` (None for graph inputs, initializers and omitted optionals)."""
    return tensor.inputs[0] if tensor.inputs else None


def const_dtype(tensor: gs.Tensor) -> np.dtype | None:
    """numpy dtype of a constant without loading its values (None when numpy has no such dtype)."""
    if isinstance(tensor, gs.Constant):
        dtype = tensor.dtype
        if isinstance(dtype, int) or dtype is None:
            return None
        try:
            found: np.dtype = np.dtype(dtype)
        except TypeError:
            return None
        return found
    value = const_value(tensor)
    return None if value is None else np.dtype(value.dtype)


def onnx_type_name(dtype: object) -> str:
    """Readable name of a numpy dtype or an ONNX element type (``bfloat16``, ``float8e4m3fn``...)."""
    if isinstance(dtype, int):
        try:
            return onnx.helper.tensor_dtype_to_string(dtype).split(".")[-1].lower()
        except (KeyError, ValueError):
            return str(dtype)
    return str(dtype)


def constant_node_value(node: gs.Node) -> np.ndarray | None:
    """The value of a ``Constant`` node (``value``, ``value_float(s)``, ``value_int(s)``), else None."""
    for key, value in node.attrs.items():
        if key == "value" and isinstance(value, gs.Constant):
            return np.asarray(value.values)
        if key in ("value_float", "value_floats"):
            return np.asarray(value, dtype=np.float32)
        if key in ("value_int", "value_ints"):
            return np.asarray(value, dtype=np.int64)
    return None


def const_value(tensor: gs.Tensor) -> np.ndarray | None:
    """Value of an initializer or of a ``Constant`` node's output (any scope), else None."""
    if isinstance(tensor, gs.Constant):
        return np.asarray(tensor.values)
    prod = producer(tensor)
    if prod is not None and prod.op == "Constant" and is_default_domain(prod.domain):
        return constant_node_value(prod)
    return None


def set_const(tensor: gs.Tensor, values: np.ndarray) -> None:
    """Give ``tensor`` (an initializer or a ``Constant`` node output) new ``values``, keeping its name."""
    if isinstance(tensor, gs.Constant):
        tensor.values = values
        return
    prod = producer(tensor)
    if prod is not None:
        prod.outputs.clear()
    tensor.to_constant(values)


def renew_const(tensor: gs.Tensor, values: np.ndarray) -> gs.Tensor:
    """Give constant ``tensor`` new ``values`` as a *new* constant of the same name that takes over every use
    (O(fan-out)); returns it. Unlike `set_const`, the change is visible to the pipeline's change measure, which
    compares wiring and constants' identities, not their values (rescaled weights keep shape and dtype)."""
    if not isinstance(tensor, gs.Constant):
        set_const(tensor, values)
        return tensor
    new = gs.Constant(tensor.name, values)
    redirect(tensor, new)
    return new


def consumers(tensor: gs.Tensor) -> list[gs.Node]:
    """Distinct consumer nodes of ``tensor`` in every scope, in first-use order."""
    seen: dict[int, gs.Node] = {}
    for node in tensor.outputs:
        seen.setdefault(id(node), node)
    return list(seen.values())


def redirect(old: gs.Tensor, new: gs.Tensor, keep: Iterable[gs.Node] = ()) -> int:
    """Make every consumer of ``old`` (except ``keep``) read ``new`` instead; returns the uses moved.

    Works in O(fan-out): inputs are rewritten with plain list operations and both tensors' consumer lists
    are rebuilt once, instead of graphsurgeon's per-element bookkeeping.
    """
    keep_ids = {id(n) for n in keep}
    kept: list[gs.Node] = []
    moved: list[gs.Node] = []
    done: set[int] = set()
    for node in list(old.outputs):
        if id(node) in keep_ids:
            kept.append(node)
            continue
        if id(node) in done:
            continue
        done.add(id(node))
        for i, t in enumerate(node.inputs):
            if t is old:
                list.__setitem__(node.inputs, i, new)
                moved.append(node)
    list.clear(old.outputs)
    list.extend(old.outputs, kept)
    list.extend(new.outputs, moved)
    return len(moved)


def detach(nodes: Sequence[gs.Node]) -> None:
    """Disconnect ``nodes`` from all their tensors in O(total degree) (bulk, fan-out safe)."""
    dead = {id(n) for n in nodes}
    touched: dict[int, gs.Tensor] = {}
    for node in nodes:
        for t in node.inputs:
            touched[id(t)] = t
        for t in node.outputs:
            touched[id(t)] = t
    for t in touched.values():
        if any(id(n) in dead for n in t.outputs):
            kept = [n for n in t.outputs if id(n) not in dead]
            list.clear(t.outputs)
            list.extend(t.outputs, kept)
        if any(id(n) in dead for n in t.inputs):
            kept = [n for n in t.inputs if id(n) not in dead]
            list.clear(t.inputs)
            list.extend(t.inputs, kept)
    for node in nodes:
        list.clear(node.inputs)
        list.clear(node.outputs)


def unlink(node: gs.Node, data_inputs: int = 1) -> None:
    """Disconnect ``node``'s outputs and its first ``data_inputs`` inputs right away, so later matching
    sees the new topology; the remaining inputs (typically shared parameters) are detached later in bulk
    by `rebuild`, which keeps this O(1) even for parameters shared by thousands of nodes."""
    for t in node.outputs:
        if any(p is node for p in t.inputs):
            kept = [p for p in t.inputs if p is not node]
            list.clear(t.inputs)
            list.extend(t.inputs, kept)
    list.clear(node.outputs)
    head = list(node.inputs[:data_inputs])
    for t in head:
        kept = [c for c in t.outputs if c is not node]
        list.clear(t.outputs)
        list.extend(t.outputs, kept)
    list.__delitem__(node.inputs, slice(0, len(head)))


def rebuild(
    graph: gs.Graph,
    removed: Iterable[gs.Node] = (),
    replacements: dict[int, list[gs.Node]] | None = None,
) -> None:
    """Rewrite ``graph.nodes`` in one pass: drop ``removed`` and put ``replacements[id(node)]`` where
    ``node`` stood. Dropped nodes (removed, or replaced and not listed again) are detached in bulk."""
    repl = replacements or {}
    dropped = list(removed)
    gone = {id(n) for n in dropped}
    out: list[gs.Node] = []
    for node in graph.nodes:
        if id(node) in repl:
            new = repl[id(node)]
            out.extend(new)
            if not any(n is node for n in new):
                dropped.append(node)
        elif id(node) not in gone:
            out.append(node)
    if dropped:
        detach(dropped)
    if dropped or repl:
        graph.nodes = out


def outer_inputs(graph: gs.Graph) -> list[gs.Tensor]:
    """Tensors that ``graph``'s nodes (recursively) read from enclosing scopes (initializers excluded)."""
    local = {id(t) for t in graph.inputs}
    for node in graph.nodes:
        local.update(id(t) for t in node.outputs)
    out: dict[int, gs.Tensor] = {}
    for node in graph.nodes:
        for t in dependencies(node):
            if id(t) not in local and not isinstance(t, gs.Constant) and t.name:
                out.setdefault(id(t), t)
    return list(out.values())


def pinned_tensors(scope: gs.Graph) -> set[int]:
    """Ids of the tensors of ``scope`` whose producer a rewrite must keep although `consumers` may show none or one:
    the scope's outputs and every tensor a nested subgraph reads from it (an If branch's implicit inputs)."""
    pinned = {id(t) for t in scope.outputs}
    for node in scope.nodes:
        if node_subgraphs(node):
            pinned.update(id(t) for t in dependencies(node))
    return pinned


def dependencies(node: gs.Node) -> Iterator[gs.Tensor]:
    """``node``'s inputs plus whatever its subgraphs read from the scope ``node`` lives in."""
    yield from node.inputs
    for sub in node_subgraphs(node):
        yield from outer_inputs(sub)


def _positions(nodes: Sequence[gs.Node]) -> dict[int, int]:
    pos: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for t in node.outputs:
            pos[id(t)] = i
    return pos


def is_topological(nodes: Sequence[gs.Node]) -> bool:
    """Whether every node comes after the producers of everything it reads (a node reading its own output does
    not: sorted nodes are acyclic)."""
    pos = _positions(nodes)
    for j, node in enumerate(nodes):
        for t in dependencies(node):
            i = pos.get(id(t))
            if i is not None and i >= j:
                return False
    return True


def topological_order(nodes: Sequence[gs.Node]) -> list[gs.Node] | None:
    """Kahn's algorithm over tensor names (iterative, stable w.r.t. the given order); None if cyclic."""
    producer: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for t in node.outputs:
            producer[t.name] = i
    indegree = [0] * len(nodes)
    successors: list[list[int]] = [[] for _ in nodes]
    for j, node in enumerate(nodes):
        deps = {producer[t.name] for t in dependencies(node) if t.name in producer}  # a node reading itself: a cycle
        indegree[j] = len(deps)
        for i in deps:
            successors[i].append(j)
    ready = collections.deque(i for i, d in enumerate(indegree) if d == 0)
    # A heap would give the smallest-index-first order; a deque keeps it O(N) and is stable enough.
    out: list[int] = []
    while ready:
        i = ready.popleft()
        out.append(i)
        for j in successors[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
    if len(out) != len(nodes):
        return None
    return [nodes[i] for i in out]


def tensor_shape(tensor: gs.Tensor, inferred: Inferred | None = None) -> Shape | None:
    """Shape of ``tensor`` with unknown dims as None: from the tensor itself, its unknown (symbolic) dims filled
    from ``inferred`` where that has the same rank (e.g. sizes inferred from a calibration sample's input
    shape), else from ``inferred``."""
    if isinstance(tensor, gs.Constant):
        return tuple(int(d) for d in tensor.shape)
    shape = tensor.shape
    other = inferred[tensor.name][0] if inferred is not None and tensor.name in inferred else None
    if shape is not None:
        own = tuple(d if isinstance(d, int) and d >= 0 else None for d in shape)
        if other is None or len(other) != len(own) or None not in own:
            return own
        return tuple(o if o is not None else i for o, i in zip(own, other, strict=True))
    return other


def tensor_dtype(tensor: gs.Tensor, inferred: Inferred | None = None) -> np.dtype | None:
    """numpy dtype of ``tensor`` if known (from the tensor itself, else from ``inferred``)."""
    dtype = tensor.dtype
    if dtype is not None:
        try:
            return np.dtype(dtype) if not isinstance(dtype, int) else onnx.helper.tensor_dtype_to_np_dtype(dtype)
        except (TypeError, KeyError):
            return None
    if inferred is not None and tensor.name in inferred and inferred[tensor.name][1]:
        try:
            return onnx.helper.tensor_dtype_to_np_dtype(inferred[tensor.name][1])
        except KeyError:
            return None
    return None
