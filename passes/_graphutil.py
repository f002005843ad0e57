"""Graph helpers shared by the preparation passes (``fold_constants``, ``fuse_batchnorm``, ``cleanup``).

Everything here works on onnx-graphsurgeon objects through their own producer/consumer links
(``tensor.inputs`` / ``tensor.outputs``), so it works the same in the top graph and in If/Loop/Scan bodies
(which the handle's index does not cover) and every helper is O(size of what it touches):

- `graph_scopes` lists the top graph and every nested graph, outermost first;
- `const_value` reads an initializer or a ``Constant`` node output in any scope;
- `redirect` moves every consumer of one tensor to another in O(fan-out) (graphsurgeon's own list
  bookkeeping is O(fan-out) per consumer, O(fan-out²) for a whole fan-out);
- `detach` and `rebuild` drop and insert nodes in one pass over the node list;
- `static_shapes` runs ONNX shape inference once on a weight-free export when a pass needs ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from qgraph import GraphHandle
from qgraph.graph import constant_node_value, topological_order

Shape = tuple[int | None, ...]
#: What shape inference found for a tensor: its shape (None if unknown) and its ONNX element type (0 if unknown).
Inferred = dict[str, tuple[Shape | None, int]]

#: Initializers at most this large stay in the model given to shape inference (Reshape targets etc.).
_SHAPE_INFERENCE_KEEP_BYTES = 4096


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


def const_value(tensor: gs.Tensor) -> np.ndarray | None:
    """Value of an initializer or of a ``Constant`` node's output (any scope), else None."""
    if isinstance(tensor, gs.Constant):
        return np.asarray(tensor.values)
    prod = producer(tensor)
    if prod is not None and prod.op == "Constant" and prod.domain in ("", "ai.onnx", None):
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
    """Whether every node comes after the producers of everything it reads."""
    pos = _positions(nodes)
    for j, node in enumerate(nodes):
        for t in dependencies(node):
            i = pos.get(id(t))
            if i is not None and i > j:
                return False
    return True


def topological(nodes: Sequence[gs.Node]) -> list[gs.Node] | None:
    """Kahn's algorithm (iterative, stable); None if the nodes form a cycle (the core's implementation)."""
    return topological_order(nodes)


def tensor_shape(tensor: gs.Tensor, inferred: Inferred | None = None) -> Shape | None:
    """Shape of ``tensor`` with unknown dims as None: from the tensor itself, else from ``inferred``."""
    if isinstance(tensor, gs.Constant):
        return tuple(int(d) for d in tensor.shape)
    shape = tensor.shape
    if shape is not None:
        return tuple(d if isinstance(d, int) and d >= 0 else None for d in shape)
    if inferred is not None and tensor.name in inferred:
        return inferred[tensor.name][0]
    return None


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


def static_shapes(handle: GraphHandle) -> Inferred:
    """Shapes and types of every tensor of the model (all scopes) after ONNX shape inference (data propagation on).

    Runs on an export whose large initializers are turned into typed graph inputs, so inference costs
    O(nodes) and copies no weights. Returns what inference could find; never raises.
    """
    model = handle.to_onnx()
    graph = model.graph
    big = [t for t in graph.initializer if _proto_bytes(t) > _SHAPE_INFERENCE_KEEP_BYTES]
    if big:
        small = [t for t in graph.initializer if _proto_bytes(t) <= _SHAPE_INFERENCE_KEEP_BYTES]
        for t in big:
            graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        del graph.initializer[:]
        graph.initializer.extend(small)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:
        return {}
    shapes: Inferred = {}
    stack = [inferred.graph]
    while stack:
        g = stack.pop()
        for info in [*g.input, *g.output, *g.value_info]:
            if not info.type.HasField("tensor_type"):
                continue
            tt = info.type.tensor_type
            shape: Shape | None = None
            if tt.HasField("shape"):
                shape = tuple(int(d.dim_value) if d.HasField("dim_value") else None for d in tt.shape.dim)
            shapes[info.name] = (shape, int(tt.elem_type))
        for init in g.initializer:
            shapes[init.name] = (tuple(int(d) for d in init.dims), int(init.data_type))
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    stack.append(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    stack.extend(attr.graphs)
    return shapes


def _proto_bytes(t: onnx.TensorProto) -> int:
    return len(t.raw_data) if t.HasField("raw_data") else t.ByteSize()


class NameRegistry:
    """Unique names for new tensors and nodes across every scope (the handle's index sees the top graph only)."""

    def __init__(self, handle: GraphHandle, scopes: Sequence[gs.Graph]) -> None:
        self._handle = handle
        self._taken: set[str] = set()
        for g in scopes[1:]:
            for t in g.inputs:
                self._taken.add(t.name)
            for node in g.nodes:
                self._taken.add(node.name)
                self._taken.update(t.name for t in node.inputs)
                self._taken.update(t.name for t in node.outputs)

    def __call__(self, base: str) -> str:
        """A name not used by any node or tensor: ``base`` or ``base_<k>``."""
        name = self._handle.unique_name(base)
        k = 0
        while name in self._taken:
            k += 1
            name = self._handle.unique_name(f"{base}_{k}")
        self._taken.add(name)
        return name
