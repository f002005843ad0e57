"""The graph handle: one onnx-graphsurgeon graph for rewriting, one networkx view for analysis.

Every pass receives a `GraphHandle`. Rewrites go through ``handle.graph`` (a ``gs.Graph``); analysis goes
through ``handle.index`` (producers/consumers/nodes by name) and ``handle.nx`` (a ``networkx.DiGraph`` whose
nodes are integer positions in ``handle.graph.nodes``). Both are built once, in O(N), and cached until a pass
calls `GraphHandle.changed`. The handle counts its whole-graph walks in ``handle.walks`` so tests can prove
a pass does a bounded number of them (the guard against accidental O(N²)).
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx
import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.logger import logger as _gs_logger_module

from qgraph.errors import ModelError
from qgraph.gs_compat import TypeKeeper
from qgraph.model_io import normalize_ir_version


def _log_to_stderr(*args: Any, **kwargs: Any) -> None:
    kwargs.pop("file", None)
    print(*args, file=sys.stderr, **kwargs)


# onnx-graphsurgeon prints its warnings with print() to stdout, which would corrupt machine-readable output
# (`qgraph inspect --json`, `diff --json -`): its logger module resolves `print` in its own namespace first.
_gs_logger_module.print = _log_to_stderr

#: Prefix of NodeProto.doc_string values that record which pass created a node.
TAG_PREFIX = "qgraph:"


@dataclass
class GraphIndex:
    """Name-keyed lookups over the current graph, built in one O(N) walk."""

    nodes: list[gs.Node]
    position: dict[int, int]  # id(node) -> position in nodes
    by_name: dict[str, gs.Node]
    producer: dict[str, gs.Node]  # tensor name -> producing node
    consumers: dict[str, list[gs.Node]]  # tensor name -> consuming nodes (in graph order)
    tensors: dict[str, gs.Tensor]
    graph_outputs: set[str] = field(default_factory=set)

    def pos(self, node: gs.Node) -> int:
        """Position of ``node`` in the node list the index was built from."""
        return self.position[id(node)]


class GraphHandle:
    """A model being transformed: the graphsurgeon graph plus model-level fields and cached analyses."""

    def __init__(self, model: onnx.ModelProto) -> None:
        # Model-level fields only: copying the whole proto would double the cost of a load.
        self._model_fields = onnx.ModelProto(
            ir_version=model.ir_version,
            producer_name=model.producer_name,
            producer_version=model.producer_version,
            domain=model.domain,
            model_version=model.model_version,
            doc_string=model.doc_string,
        )
        self._model_fields.opset_import.extend(model.opset_import)
        self._model_fields.functions.extend(model.functions)
        try:
            self.graph: gs.Graph = gs.import_onnx(model)
        except Exception as exc:  # graphsurgeon raises bare exceptions on malformed graphs
            raise ModelError(f"the model's graph cannot be imported: {type(exc).__name__}: {exc}") from exc
        self._types = TypeKeeper(model, self.graph)
        # graphsurgeon shares these protos with the input model: copy so passes never edit the caller's model.
        self.graph.import_domains = [
            onnx.helper.make_opsetid(d.domain, d.version) for d in self.graph.import_domains or []
        ]
        self.tags: dict[str, str] = {
            n.name: n.doc_string[len(TAG_PREFIX) :]
            for n in model.graph.node
            if n.name and n.doc_string.startswith(TAG_PREFIX)
        }
        self.metadata: dict[str, str] = {p.key: p.value for p in model.metadata_props}
        self.walks: collections.Counter[str] = collections.Counter()
        self._index: GraphIndex | None = None
        self._nx: networkx.DiGraph | None = None

    # ------------------------------------------------------------------ model-level facts
    @property
    def opset(self) -> int:
        """The default-domain opset of the model."""
        return int(self.graph.opset)

    def opset_of(self, domain: str) -> int | None:
        """Opset version imported for ``domain`` (``""`` / ``"ai.onnx"`` is the default domain)."""
        if domain in ("", "ai.onnx"):
            return self.opset
        for imp in self.graph.import_domains or []:
            if imp.domain == domain:
                return int(imp.version)
        return None

    # ------------------------------------------------------------------ cached analyses
    def changed(self) -> None:
        """Invalidate the cached index and networkx view; call after mutating ``graph``."""
        self._index = None
        self._nx = None

    @property
    def index(self) -> GraphIndex:
        """Producers, consumers, nodes and tensors by name (built once per change)."""
        if self._index is None:
            self._index = self._build_index()
        return self._index

    def _build_index(self) -> GraphIndex:
        self.walks["index"] += 1
        nodes = list(self.graph.nodes)
        position: dict[int, int] = {}
        by_name: dict[str, gs.Node] = {}
        producer: dict[str, gs.Node] = {}
        consumers: dict[str, list[gs.Node]] = collections.defaultdict(list)
        tensors: dict[str, gs.Tensor] = {t.name: t for t in self.graph.inputs}
        for i, node in enumerate(nodes):
            position[id(node)] = i
            if node.name:
                by_name.setdefault(node.name, node)
            for t in node.inputs:
                if t.name:
                    consumers[t.name].append(node)
                    tensors.setdefault(t.name, t)
            for t in node.outputs:
                if t.name:
                    producer[t.name] = node
                    tensors.setdefault(t.name, t)
        for t in self.graph.outputs:
            tensors.setdefault(t.name, t)
        return GraphIndex(
            nodes=nodes,
            position=position,
            by_name=by_name,
            producer=producer,
            consumers=dict(consumers),
            tensors=tensors,
            graph_outputs={t.name for t in self.graph.outputs},
        )

    @property
    def nx(self) -> networkx.DiGraph:
        """Node-level dataflow view: nodes are positions in ``index.nodes``, edges carry ``tensors``."""
        if self._nx is None:
            self._nx = self._build_nx()
        return self._nx

    def _build_nx(self) -> networkx.DiGraph:
        idx = self.index
        self.walks["nx"] += 1
        g: networkx.DiGraph = networkx.DiGraph()
        g.add_nodes_from((i, {"op": n.op, "name": n.name}) for i, n in enumerate(idx.nodes))
        for i, node in enumerate(idx.nodes):
            for t in node.outputs:
                for consumer in idx.consumers.get(t.name, ()):
                    j = idx.position[id(consumer)]
                    if g.has_edge(i, j):
                        g.edges[i, j]["tensors"].append(t.name)
                    else:
                        g.add_edge(i, j, tensors=[t.name])
        return g

    # ------------------------------------------------------------------ helpers for passes
    def consumers(self, tensor: gs.Tensor | str) -> list[gs.Node]:
        """Nodes consuming ``tensor`` (by index, O(1))."""
        name = tensor if isinstance(tensor, str) else tensor.name
        return self.index.consumers.get(name, [])

    def producer(self, tensor: gs.Tensor | str) -> gs.Node | None:
        """Node producing ``tensor`` or None for graph inputs and constants."""
        name = tensor if isinstance(tensor, str) else tensor.name
        return self.index.producer.get(name)

    def is_graph_output(self, tensor: gs.Tensor | str) -> bool:
        """Whether ``tensor`` is one of the graph's outputs."""
        name = tensor if isinstance(tensor, str) else tensor.name
        return name in self.index.graph_outputs

    def constant_value(self, tensor: gs.Tensor) -> np.ndarray | None:
        """The value of ``tensor`` if it is an initializer or the output of a ``Constant`` node, else None."""
        if isinstance(tensor, gs.Constant):
            return np.asarray(tensor.values)
        prod = self.producer(tensor)
        if prod is None or prod.op != "Constant":
            return None
        return constant_node_value(prod)

    def tag(self, node: gs.Node | str, pass_name: str) -> None:
        """Record that ``pass_name`` created ``node`` (written to the node's doc_string on export)."""
        self.tags[node if isinstance(node, str) else node.name] = pass_name

    def unique_name(self, base: str) -> str:
        """``base`` if no node or tensor uses it yet, else ``base_1``, ``base_2``... (O(1) amortised)."""
        idx = self.index
        taken = self._taken_names
        name, k = base, 0
        while name in idx.by_name or name in idx.tensors or name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        return name

    @property
    def _taken_names(self) -> set[str]:
        # Names handed out since the last index build (the index does not see them yet).
        if getattr(self, "_taken_for", None) is not self._index:
            self._taken: set[str] = set()
            self._taken_for = self._index
        return self._taken

    def subgraphs(self) -> Iterator[gs.Graph]:
        """Every nested graph (If/Loop/Scan bodies), recursively."""
        stack: list[gs.Graph] = [self.graph]
        while stack:
            g = stack.pop()
            for node in g.nodes:
                for value in node.attrs.values():
                    if isinstance(value, gs.Graph):
                        yield value
                        stack.append(value)
                    elif isinstance(value, list):
                        for v in value:
                            if isinstance(v, gs.Graph):
                                yield v
                                stack.append(v)

    def cleanup(self, remove_unused_graph_inputs: bool = False) -> None:
        """Remove dead nodes and tensors (one graphsurgeon walk) and invalidate caches."""
        self.walks["cleanup"] += 1
        self.graph.cleanup(remove_unused_graph_inputs=remove_unused_graph_inputs)
        self.changed()

    # ------------------------------------------------------------------ ordering
    def toposort(self) -> None:
        """Sort nodes topologically (Kahn, iterative, stable); raise `ModelError` on a cycle."""
        self.walks["toposort"] += 1
        order = topological_order(self.graph.nodes)
        if order is None:
            raise ModelError(_cycle_message(self.graph.nodes))
        self.graph.nodes = order
        self.changed()

    # ------------------------------------------------------------------ export
    def to_onnx(self) -> onnx.ModelProto:
        """Export to a ModelProto with model-level fields, tags and metadata restored and a sane IR."""
        self.walks["export"] += 1
        try:
            model = self._types.export(self.graph)
        except Exception as exc:
            raise ModelError(f"the rewritten graph cannot be exported: {type(exc).__name__}: {exc}") from exc
        model.ir_version = self._model_fields.ir_version
        model.producer_name = self._model_fields.producer_name or "qgraph"
        model.producer_version = self._model_fields.producer_version
        model.domain = self._model_fields.domain
        model.model_version = self._model_fields.model_version
        model.doc_string = self._model_fields.doc_string
        if not model.functions and self._model_fields.functions:
            model.functions.extend(self._model_fields.functions)
        _merge_opsets(model, self._model_fields)
        del model.metadata_props[:]
        for key in sorted(self.metadata):
            model.metadata_props.add(key=key, value=self.metadata[key])
        if self.tags:
            for node in model.graph.node:
                tag = self.tags.get(node.name)
                if tag is not None:
                    node.doc_string = TAG_PREFIX + tag
        normalize_ir_version(model)
        return model

    def replace_model(self, model: onnx.ModelProto) -> None:
        """Replace the whole graph with ``model`` (for passes that rewrite protos, e.g. opset lowering)."""
        tags, metadata, walks = self.tags, self.metadata, self.walks
        self.__init__(model)  # type: ignore[misc]
        self.tags = {**tags, **self.tags}
        self.metadata = {**metadata, **self.metadata}
        self.walks = walks


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


def _merge_opsets(model: onnx.ModelProto, original: onnx.ModelProto) -> None:
    have = {o.domain for o in model.opset_import}
    for o in original.opset_import:
        if o.domain not in have and o.domain not in ("", "ai.onnx"):
            model.opset_import.add(domain=o.domain, version=o.version)


def topological_order(nodes: Sequence[gs.Node]) -> list[gs.Node] | None:
    """Kahn's algorithm over tensor names (iterative, stable w.r.t. the given order); None if cyclic."""
    producer: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for t in node.outputs:
            producer[t.name] = i
    indegree = [0] * len(nodes)
    successors: list[list[int]] = [[] for _ in nodes]
    for j, node in enumerate(nodes):
        deps = {producer[t.name] for t in _inputs_with_outer_scope(node) if t.name in producer}
        deps.discard(j)
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


def _inputs_with_outer_scope(node: gs.Node) -> Iterable[gs.Tensor]:
    yield from node.inputs
    for value in node.attrs.values():
        graphs = [value] if isinstance(value, gs.Graph) else value if isinstance(value, list) else []
        for g in graphs:
            if isinstance(g, gs.Graph):
                local = {t.name for n in g.nodes for t in n.outputs} | {t.name for t in g.inputs}
                for n in g.nodes:
                    for t in _inputs_with_outer_scope(n):
                        if t.name not in local and not isinstance(t, gs.Constant):
                            yield t


def _cycle_message(nodes: Sequence[gs.Node]) -> str:
    g = networkx.DiGraph()
    producer = {t.name: n.name or n.op for n in nodes for t in n.outputs}
    for n in nodes:
        for t in n.inputs:
            if t.name in producer:
                g.add_edge(producer[t.name], n.name or n.op)
    try:
        cycle = [edge[0] for edge in networkx.find_cycle(g)]
    except networkx.NetworkXNoCycle:
        cycle = []
    shown = " -> ".join(cycle[:8]) + (" -> ..." if len(cycle) > 8 else "")
    return (
        f"the graph has a cycle ({shown}); ONNX graphs must be acyclic. Fix the exporter or the graph "
        "surgery that produced it."
    )


def check_acyclic(model: onnx.ModelProto) -> None:
    """Raise `ModelError` naming the nodes of a cycle if the model's top graph is cyclic."""
    producer: dict[str, int] = {}
    for i, node in enumerate(model.graph.node):
        for t in node.output:
            producer[t] = i
    g = networkx.DiGraph()
    g.add_nodes_from(range(len(model.graph.node)))
    for j, node in enumerate(model.graph.node):
        for t in node.input:
            if t in producer and producer[t] != j:
                g.add_edge(producer[t], j)
    if networkx.is_directed_acyclic_graph(g):
        return
    cycle = [model.graph.node[e[0]].name or model.graph.node[e[0]].op_type for e in networkx.find_cycle(g)]
    raise ModelError(
        f"the graph has a cycle ({' -> '.join(cycle[:8])}); ONNX graphs must be acyclic. Fix the exporter or "
        "the graph surgery that produced it."
    )


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
                other = seen[name]
                raise ModelError(f"tensor {name!r} is produced twice (by node {node.name or node.op_type!r} and by "
                                 f"{other}); every tensor must have exactly one producer. Rename one of them.")
            seen[name] = f"node {node.name or node.op_type!r}"


def check_model(model: onnx.ModelProto) -> None:
    """The structural checks every input model gets before any work: unique names, no cycle."""
    check_unique_names(model)
    check_acyclic(model)


def describe(value: Any) -> str:
    """Compact JSON for provenance metadata (sorted keys, no spaces)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
