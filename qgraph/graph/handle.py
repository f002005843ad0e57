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
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import networkx
import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.logger import logger as _gs_logger_module

from qgraph.errors import ModelError
from qgraph.graph.ir_version import normalize_ir_version
from qgraph.graph.ops import is_default_domain

from .checks import gs_cycle_message
from .detach import Held, attach_weights, detach_constants, fill_weights, weightless
from .fresh import free_name
from .gs_compat import TypeKeeper
from .naming import Naming, name_graph
from .ops import Inferred, const_value, consumers, graph_scopes, producer, topological_order
from .shapes import shapes_with_inputs, static_shapes


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
    """A model being transformed: the graphsurgeon graph plus model-level fields and cached analyses.

    On load every node gets its one name (`qgraph.graph.naming`: unnamed nodes ``<OpType>(<first output>)``,
    repeated names ``name#2``; named nodes keep theirs), so passes, selectors, reports and the output agree."""

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
        #: How many times `changed` was called: equal numbers, the same graph (for code that caches a walk of it).
        self.version = 0
        try:
            self.graph: gs.Graph = gs.import_onnx(model)
        except Exception as exc:  # graphsurgeon raises bare exceptions on malformed graphs
            raise ModelError(f"the model's graph cannot be imported: {type(exc).__name__}: {exc}") from exc
        self._types = TypeKeeper(model, self.graph)
        detach_constants(self.graph)  # the graph owns its weights: the caller's proto can be freed
        # graphsurgeon shares these protos with the input model: copy so passes never edit the caller's model.
        self.graph.import_domains = [
            onnx.helper.make_opsetid(d.domain, d.version) for d in self.graph.import_domains or []
        ]
        #: Names given to unnamed nodes and repeated names (`qgraph.graph.naming`): the names every report shows
        #: and every selector takes; ``naming.notice()`` says so when any node was (re)named.
        self.naming: Naming = name_graph(self.graph)
        # graphsurgeon keeps the top graph's node order: the tag of proto node i belongs to graph node i.
        self.tags: dict[str, str] = {
            g.name: p.doc_string[len(TAG_PREFIX) :]
            for p, g in zip(model.graph.node, self.graph.nodes, strict=False)
            if p.doc_string.startswith(TAG_PREFIX)
        }
        self.metadata: dict[str, str] = {p.key: p.value for p in model.metadata_props}
        self.walks: collections.Counter[str] = collections.Counter()
        self._index: GraphIndex | None = None
        self._index_of: list[gs.Node] | None = None
        self._nx: networkx.DiGraph | None = None
        self._shapes: Inferred | None = None
        self._scope_names: tuple[set[str], set[str]] | None = None
        #: Names handed out by `unique_name` since the last `changed()`, per kind (nodes may not be inserted yet).
        self._taken_by_kind: dict[str, set[str]] = {}

    # ------------------------------------------------------------------ model-level facts
    @property
    def opset(self) -> int:
        """The default-domain opset of the model."""
        return int(self.graph.opset)

    def opset_of(self, domain: str) -> int | None:
        """Opset version imported for ``domain`` (``""`` / ``"ai.onnx"`` is the default domain)."""
        if is_default_domain(domain):
            return self.opset
        for imp in self.graph.import_domains or []:
            if imp.domain == domain:
                return int(imp.version)
        return None

    def import_domain(self, domain: str, version: int = 1) -> None:
        """Import operator set ``domain`` at ``version`` unless the model already imports it (e.g. ``com.microsoft``
        before adding a contrib op)."""
        if self.opset_of(domain) is None:
            self.graph.import_domains = [*(self.graph.import_domains or []), onnx.helper.make_opsetid(domain, version)]

    # ------------------------------------------------------------------ cached analyses
    def changed(self) -> None:
        """Invalidate the cached index, networkx view, shapes and names; call after mutating ``graph``.

        The engine's graph operations and the pipeline (after every pass) call it; the index also rebuilds
        itself when the node list was replaced or changed length since it was built."""
        self._drop_caches()
        self._taken_by_kind = {}
        self.version += 1

    def _drop_caches(self) -> None:
        self._index = None
        self._nx = None
        self._shapes = None
        self._scope_names = None

    @property
    def index(self) -> GraphIndex:
        """Producers, consumers, nodes and tensors by name (built once per change)."""
        nodes: list[gs.Node] = self.graph.nodes
        if self._index is not None and (self._index_of is not nodes or len(self._index.nodes) != len(nodes)):
            self._drop_caches()  # stale: the node list was replaced or edited without `changed()`
        if self._index is None:
            self._index = self._build_index()
            self._index_of = nodes
        return self._index

    def shapes(self) -> Inferred:
        """Shape and element type of every tensor in every scope after ONNX shape inference (run once per change
        on a weight-free export; what inference cannot find is absent)."""
        if self._shapes is None:
            self._shapes = static_shapes(self.to_onnx(weights=False))
        return self._shapes

    def dynamic_inputs(self) -> list[str]:
        """Graph inputs with a dimension of no fixed size (symbolic or unknown), or no shape at all."""
        return [
            t.name
            for t in self.graph.inputs
            if t.shape is None or any(not isinstance(d, int) or d < 0 for d in t.shape)
        ]

    def shapes_for(self, dims: dict[str, tuple[int, ...]]) -> Inferred:
        """Like `shapes`, with the graph inputs in ``dims`` given those sizes (not cached: one inference per
        call). For decisions that need concrete sizes on a model with dynamic inputs, e.g. a calibration
        sample's shapes for the latency cost model."""
        return shapes_with_inputs(self.to_onnx(weights=False), dims)

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
        """Distinct nodes reading ``tensor`` in every scope (a body node reading an outer tensor included), in
        first-use order: the tensor's own links, O(fan-out), never stale. A name is looked up among the top graph's
        tensors. The same answer as `qgraph.graph.consumers`."""
        found = self._tensor(tensor)
        return consumers(found) if found is not None else []

    def producer(self, tensor: gs.Tensor | str) -> gs.Node | None:
        """The node producing ``tensor`` in any scope, or None for graph inputs, initializers and omitted
        optionals (the tensor's own link, O(1)). The same answer as `qgraph.graph.producer`."""
        found = self._tensor(tensor)
        return producer(found) if found is not None else None

    def _tensor(self, tensor: gs.Tensor | str) -> gs.Tensor | None:
        return self.index.tensors.get(tensor) if isinstance(tensor, str) else tensor

    def is_graph_output(self, tensor: gs.Tensor | str) -> bool:
        """Whether ``tensor`` is one of the graph's outputs."""
        name = tensor if isinstance(tensor, str) else tensor.name
        return name in self.index.graph_outputs

    def constant_value(self, tensor: gs.Tensor) -> np.ndarray | None:
        """The value of ``tensor`` if it is an initializer or the output of a ``Constant`` node (any scope)."""
        return const_value(tensor)

    def tag(self, node: gs.Node | str, pass_name: str) -> None:
        """Record that ``pass_name`` created ``node`` (written to the node's doc_string on export)."""
        self.tags[node if isinstance(node, str) else node.name] = pass_name

    def unique_name(self, base: str, kind: Literal["any", "tensor", "node"] = "any") -> str:
        """``base`` if it is free, else ``base_1``, ``base_2``... (O(1) amortised after one walk of the subgraphs
        per change). ``kind`` says which namespace must be free: ONNX keeps node and tensor names apart (a node
        ``x/q`` may produce tensor ``x/q``); ``any`` keeps a name free in both."""
        # The index as last built (not rebuilt when stale): every name handed out since is in `_taken`.
        idx = self._index if self._index is not None else self.index
        scoped = self._scope_name_sets()
        taken = self._taken_by_kind.setdefault(kind, set())
        spaces: list[Container[str]] = [taken]
        if kind in ("any", "node"):
            spaces += [idx.by_name, scoped[0], self._taken_by_kind.get("any", set())]
        if kind in ("any", "tensor"):
            spaces += [idx.tensors, scoped[1], self._taken_by_kind.get("any", set())]
        if kind == "any":
            spaces += [self._taken_by_kind.get("node", set()), self._taken_by_kind.get("tensor", set())]
        name = free_name(base, lambda n: any(n in space for space in spaces))
        taken.add(name)
        return name

    def _scope_name_sets(self) -> tuple[set[str], set[str]]:
        """Node names and tensor names used inside subgraphs (built once per change)."""
        if self._scope_names is None:
            nodes: set[str] = set()
            tensors: set[str] = set()
            for g in graph_scopes(self.graph)[1:]:
                tensors.update(t.name for t in g.inputs)
                for node in g.nodes:
                    nodes.add(node.name)
                    tensors.update(t.name for t in (*node.inputs, *node.outputs))
            self._scope_names = (nodes, tensors)
        return self._scope_names

    def subgraphs(self) -> Iterator[gs.Graph]:
        """Every nested graph (If/Loop/Scan bodies), recursively, outermost first."""
        yield from graph_scopes(self.graph)[1:]

    def scopes(self) -> list[gs.Graph]:
        """The top graph and every nested graph, outermost first."""
        return graph_scopes(self.graph)

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
            raise ModelError(gs_cycle_message(self.graph.nodes))
        if len(order) == len(self.graph.nodes) and all(a is b for a, b in zip(order, self.graph.nodes, strict=True)):
            return  # already in order: the same graph (its `version` and cached walks stay valid)
        self.graph.nodes = order
        self.changed()

    # ------------------------------------------------------------------ export
    def to_onnx(self, weights: bool = True) -> onnx.ModelProto:
        """Export to a ModelProto with model-level fields, tags and metadata restored and a sane IR.

        Weights are written into the export one tensor at a time (never a second whole copy in flight); with
        ``weights=False`` tensors of at least `DETACH_BYTES` are data-less placeholders (`qgraph.graph.detach`):
        for shape inference, opset conversion and sessions given the weights separately (`weightless_export`)."""
        model, held = self.weightless_export()
        if weights:
            fill_weights(model, held)
        return model

    def weightless_export(self) -> tuple[onnx.ModelProto, Held]:
        """The export with large weights as placeholders, and those weights by name (values and data location)."""
        self.walks["export"] += 1
        try:
            with weightless(self.graph) as held:
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
        return model, held

    def release(self) -> None:
        """Break the graph's node <-> tensor reference cycles so it is freed at once by reference counting (the
        pipeline pauses the cyclic GC during passes: a pass that builds many temporary handles calls this)."""
        for g in graph_scopes(self.graph):
            for node in g.nodes:
                list.clear(node.inputs)
                list.clear(node.outputs)
            g.nodes.clear()
        self._drop_caches()

    def replace_model(self, model: onnx.ModelProto, held: Held | None = None) -> None:
        """Replace the whole graph with ``model`` (for passes that rewrite protos, e.g. opset lowering); ``held``
        gives the weights of a model rewritten from `weightless_export` back to its placeholders."""
        tags, metadata, walks = self.tags, self.metadata, self.walks
        self.release()  # the old graph's node <-> tensor cycles would keep its weights until a cyclic collection
        self.__init__(model)  # type: ignore[misc]
        if held:
            attach_weights(self.graph, held)
        self.tags = {**tags, **self.tags}
        self.metadata = {**metadata, **self.metadata}
        self.walks = walks


def _merge_opsets(model: onnx.ModelProto, original: onnx.ModelProto) -> None:
    have = {o.domain for o in model.opset_import}
    for o in original.opset_import:
        if o.domain not in have and not is_default_domain(o.domain):
            model.opset_import.add(domain=o.domain, version=o.version)


def describe(value: Any) -> str:
    """Compact JSON for provenance metadata (sorted keys, no spaces)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
