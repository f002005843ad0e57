"""Light, name-keyed views of ONNX protos shared by the diff, the QDQ analyses and ``inspect``.

Everything here is one O(N) walk over ``ModelProto`` fields: no graphsurgeon import, no copies of weights.
Subgraph (If/Loop/Scan body) nodes are included with a scoped key ``<parent node>.<attr>/<node name>``, and
their inputs resolve to outer-scope producers, as ONNX scoping rules say.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from qgraph.graph import TAG_PREFIX, proto_node_names
from qgraph.graph.ops import is_default_domain


@dataclass
class NodeRef:
    """A node with the key it is known by: its name as `qgraph.graph.naming` gives it (an unnamed node's is
    ``<OpType>(<first output>)``), prefixed by the scope inside subgraphs."""

    key: str
    node: onnx.NodeProto
    index: int  # position in the flattened topological order
    scope: str  # "" for the top graph, else the subgraph path
    name: str = ""  # the node's own name by the rule (``key`` without the scope): what selectors take

    @property
    def op(self) -> str:
        """``op_type``, prefixed with the domain for non-default domains."""
        return op_label(self.node)

    @property
    def pass_name(self) -> str | None:
        """The qgraph pass that created the node (from its ``doc_string`` tag), if any."""
        doc = self.node.doc_string
        return doc[len(TAG_PREFIX) :] if doc.startswith(TAG_PREFIX) else None


@dataclass
class ModelIndex:
    """Nodes, producers, consumers and initializers of a model, by name."""

    model: onnx.ModelProto
    nodes: list[NodeRef] = field(default_factory=list)
    by_key: dict[str, NodeRef] = field(default_factory=dict)
    producer: dict[str, NodeRef] = field(default_factory=dict)  # tensor -> producing node (all scopes)
    consumers: dict[str, list[NodeRef]] = field(default_factory=dict)
    initializers: dict[str, onnx.TensorProto] = field(default_factory=dict)
    graph_inputs: list[str] = field(default_factory=list)
    graph_outputs: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, model: onnx.ModelProto) -> ModelIndex:
        """Index ``model`` in one walk (subgraphs included)."""
        idx = cls(model)
        idx.graph_inputs = [v.name for v in model.graph.input]
        idx.graph_outputs = [v.name for v in model.graph.output]
        scopes, _ = proto_node_names(model.graph)  # the names GraphHandle gives on load (`qgraph.graph.naming`)
        idx._add_graph(scopes[0][0], "", {id(g): names for g, names in scopes})  # `scopes` holds the wrappers
        return idx

    def _add_graph(self, graph: onnx.GraphProto, scope: str, names: dict[int, list[str]]) -> None:
        for t in graph.initializer:
            self.initializers.setdefault(t.name, t)
        for node, name in zip(graph.node, names[id(graph)], strict=True):
            key = f"{scope}/{name}" if scope else name
            ref = NodeRef(key, node, len(self.nodes), scope, name)
            self.nodes.append(ref)
            self.by_key[key] = ref
            for t in node.output:
                if t:
                    self.producer[t] = ref
            for t in node.input:
                if t:
                    self.consumers.setdefault(t, []).append(ref)
            for attr in node.attribute:
                for j, g in enumerate(subgraphs_of(attr)):
                    suffix = f"[{j}]" if attr.type == onnx.AttributeProto.GRAPHS else ""
                    self._add_graph(g, f"{key}.{attr.name}{suffix}", names)

    def constant(self, name: str) -> np.ndarray | None:
        """Value of tensor ``name`` if it is an initializer or a ``Constant`` node's output."""
        init = self.initializers.get(name)
        if init is not None:
            return numpy_helper.to_array(init)
        ref = self.producer.get(name)
        if ref is None or ref.node.op_type != "Constant":
            return None
        for attr in ref.node.attribute:
            if attr.name == "value":
                return numpy_helper.to_array(attr.t)
            if attr.name in ("value_float", "value_floats", "value_int", "value_ints"):
                return np.asarray(onnx.helper.get_attribute_value(attr))
        return None

    def elem_type(self, name: str) -> int | None:
        """ONNX element type of a constant tensor (initializer or Constant ``value``), else None."""
        init = self.initializers.get(name)
        if init is not None:
            return int(init.data_type)
        ref = self.producer.get(name)
        if ref is not None and ref.node.op_type == "Constant":
            for attr in ref.node.attribute:
                if attr.name == "value":
                    return int(attr.t.data_type)
        return None

    def is_constant(self, name: str) -> bool:
        """Whether ``name`` is an initializer or produced by a ``Constant`` node."""
        if name in self.initializers:
            return True
        ref = self.producer.get(name)
        return ref is not None and ref.node.op_type == "Constant"

    def op_histogram(self) -> Counter[str]:
        """Count of nodes per op label (subgraphs included)."""
        return Counter(r.op for r in self.nodes)


def subgraphs_of(attr: onnx.AttributeProto) -> Iterator[onnx.GraphProto]:
    """The graphs held by a node attribute (none for ordinary attributes)."""
    if attr.type == onnx.AttributeProto.GRAPH:
        yield attr.g
    elif attr.type == onnx.AttributeProto.GRAPHS:
        yield from attr.graphs


def op_label(node: onnx.NodeProto) -> str:
    """``op_type``, prefixed by its domain outside the default domain (``com.microsoft.QGemm``)."""
    return node.op_type if is_default_domain(node.domain) else f"{node.domain}.{node.op_type}"


def tensor_nbytes(t: onnx.TensorProto) -> int:
    """Bytes of a tensor's payload: numel × item size (4-bit types packed), strings by length."""
    if t.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    numel = 1
    for d in t.dims:
        numel *= int(d)
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (numel + 1) // 2
    try:
        itemsize = int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize)
    except (KeyError, TypeError, ValueError):
        itemsize = 1
    return numel * itemsize


def tensor_digest(t: onnx.TensorProto) -> str:
    """sha1 of a tensor's dtype, shape and payload (decoded, so raw and typed storage compare equal)."""
    h = hashlib.sha1()
    h.update(f"{t.data_type}:{list(t.dims)};".encode())
    if t.HasField("raw_data"):
        h.update(t.raw_data)
    else:
        try:
            h.update(np.ascontiguousarray(numpy_helper.to_array(t)).tobytes())
        except (ValueError, TypeError):
            h.update(t.SerializeToString())
    return h.hexdigest()


def dtype_name(elem_type: int) -> str:
    """``float32``, ``int8``... for an ONNX element type."""
    try:
        return str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)))
    except (KeyError, TypeError, ValueError):
        return str(onnx.TensorProto.DataType.Name(elem_type)).lower()


def describe_attribute(attr: onnx.AttributeProto, limit: int = 8) -> str:
    """Short human form of an attribute value: ``[1, 1, 2, 2]``, ``float32[64]``, ``<graph: 12 nodes>``."""
    if attr.type == onnx.AttributeProto.TENSOR:
        return f"{dtype_name(attr.t.data_type)}{list(attr.t.dims)}"
    if attr.type == onnx.AttributeProto.GRAPH:
        return f"<graph: {len(attr.g.node)} nodes>"
    if attr.type == onnx.AttributeProto.GRAPHS:
        return f"<{len(attr.graphs)} graphs>"
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return repr(value.decode("utf-8", "replace"))
    if isinstance(value, float):  # float32 attribute: 7 significant digits (1e-05, not 9.99999974e-06)
        return f"{value:.7g}"
    if isinstance(value, list):
        shown = [v.decode() if isinstance(v, bytes) else float(f"{v:.7g}") if isinstance(v, float) else v
                 for v in value[:limit]]
        return f"{shown}"[:-1] + (", ...]" if len(value) > limit else "]")
    return repr(value)
