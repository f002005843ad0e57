"""Per-run state of the opset engine: value types, constants, fresh names and emitted helpers.

The context is built once per model (one pass over every graph to index names, types and constants),
so adapters can answer "what dtype/rank/constant value is this input" in O(1).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qgraph.graph import NoMatch, is_default_domain, proto_scopes

from .schemas import type_str


def iter_graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """``graph`` and every subgraph nested in its nodes' attributes, parents first (`qgraph.graph.proto_scopes`)."""
    return proto_scopes(graph)


class LowerContext:
    """Index of a model plus the services adapters use to emit nodes that are valid at ``target``."""

    def __init__(self, model: onnx.ModelProto, target: int, types: dict[str, onnx.TypeProto]) -> None:
        self.target = target
        self.types = types
        self.consts: dict[str, np.ndarray] = {}
        self.names: set[str] = set()
        self.trusted: set[str] = set()
        self.initializers: list[onnx.TensorProto] = []
        self.counts: Counter[str] = Counter()
        self.final_ids: set[int] = set()
        self.levels: dict[int, int] = {}
        self._keep_alive: list[onnx.NodeProto] = []
        self._counter = 0
        graph_inputs = {i.name for g in iter_graphs(model.graph) for i in g.input}
        for g in iter_graphs(model.graph):
            for t in g.initializer:
                self.names.add(t.name)
                if t.name not in graph_inputs and not t.data_location:
                    self.consts[t.name] = numpy_helper.to_array(t)
            for vi in list(g.input) + list(g.output) + list(g.value_info):
                self.names.add(vi.name)
            for n in g.node:
                self.names.update(n.output)
                self.names.add(n.name)
                if n.op_type == "Constant" and is_default_domain(n.domain) and len(n.output) == 1:
                    v = constant_value(n)
                    if v is not None:
                        self.consts[n.output[0]] = v

    # ----------------------------------------------------------------------------------------- names
    def fresh(self, hint: str) -> str:
        """A value/node name not used anywhere in the model."""
        base = (hint or "v").split("/")[-1][:48]
        while True:
            self._counter += 1
            name = f"{base}__lo{self._counter}"
            if name not in self.names:
                self.names.add(name)
                return name

    # ----------------------------------------------------------------------------------------- types
    def type_str(self, name: str) -> str | None:
        """Schema-style type string of value ``name`` (None when unknown)."""
        tp = self.types.get(name)
        return None if tp is None else type_str(tp)

    def dtype(self, name: str) -> int | None:
        """Element type of tensor ``name`` (None when unknown or not a tensor)."""
        tp = self.types.get(name)
        if tp is None or tp.WhichOneof("value") != "tensor_type" or tp.tensor_type.elem_type == 0:
            c = self.consts.get(name)
            return None if c is None else helper.np_dtype_to_tensor_dtype(c.dtype)
        return int(tp.tensor_type.elem_type)

    def shape(self, name: str) -> list[int | None] | None:
        """Static shape of ``name`` with None for unknown dims; None when even the rank is unknown."""
        c = self.consts.get(name)
        if c is not None:
            return list(c.shape)
        tp = self.types.get(name)
        if tp is None or tp.WhichOneof("value") != "tensor_type" or not tp.tensor_type.HasField("shape"):
            return None
        return [d.dim_value if d.HasField("dim_value") else None for d in tp.tensor_type.shape.dim]

    def rank(self, name: str) -> int | None:
        """Rank of ``name`` when known."""
        s = self.shape(name)
        return None if s is None else len(s)

    def require_rank(self, name: str, why: str) -> int:
        """Rank of ``name``; `NoMatch` naming ``why`` when unknown."""
        r = self.rank(name)
        if r is None:
            raise NoMatch(f"rank of {name!r} is unknown ({why})")
        return r

    def set_type(self, name: str, elem: int | None, shape: list[int | None] | None = None) -> None:
        """Record the type of an engine-created value."""
        self.trusted.add(name)
        if elem is None:
            return
        self.types[name] = helper.make_tensor_type_proto(elem, shape)

    # ----------------------------------------------------------------------------------------- consts
    def const(self, name: str) -> np.ndarray | None:
        """Constant value of ``name`` (initializer not overridable by an input, or Constant output)."""
        if not name:
            return None
        return self.consts.get(name)

    def add_const(self, value: Any, hint: str, dtype: Any = None) -> str:
        """Add an initializer holding ``value`` and return its name."""
        arr = np.asarray(value, dtype=dtype)
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(arr, name))
        self.consts[name] = arr
        self.set_type(name, helper.np_dtype_to_tensor_dtype(arr.dtype), list(arr.shape))
        return name

    def i64(self, values: list[int] | int, hint: str = "c") -> str:
        """An int64 constant (1-D for a list, scalar for an int)."""
        return self.add_const(np.asarray(values, dtype=np.int64), hint)

    # ----------------------------------------------------------------------------------------- nodes
    def make(
        self,
        op: str,
        inputs: list[str],
        n_out: int = 1,
        *,
        hint: str = "",
        outputs: list[str] | None = None,
        final: bool = True,
        **attrs: Any,
    ) -> onnx.NodeProto:
        """A node with fresh output names; ``final`` marks it as already valid at the target opset."""
        outs = outputs if outputs is not None else [self.fresh(hint or op) for _ in range(n_out)]
        node = helper.make_node(op, inputs, outs, name=self.fresh(f"{hint or op}_n"), **attrs)
        for o in outs:
            if o:
                self.trusted.add(o)
        if final:
            self.mark_final(node)
        return node

    def mark_final(self, node: onnx.NodeProto) -> None:
        """Mark ``node`` as written for the target opset (the engine only validates it)."""
        self._keep_alive.append(node)
        self.final_ids.add(id(node))

    def at_level(self, node: onnx.NodeProto, opset: int) -> onnx.NodeProto:
        """Declare that ``node`` is written with the semantics of ``opset`` (the engine lowers it from there)."""
        self._keep_alive.append(node)
        self.levels[id(node)] = opset
        return node


def constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The value a Constant node produces (None for sparse values)."""
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name == "value_float":
            return np.asarray(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.asarray(list(a.floats), dtype=np.float32)
        if a.name == "value_int":
            return np.asarray(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.asarray(list(a.ints), dtype=np.int64)
        if a.name == "value_string":
            return np.asarray(a.s.decode())
        if a.name == "value_strings":
            return np.asarray([s.decode() for s in a.strings])
    return None


def get_attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """Python value of attribute ``name`` of ``node`` (``default`` when absent)."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def set_attr(node: onnx.NodeProto, name: str, value: Any) -> None:
    """Set (replace) attribute ``name`` on ``node``."""
    del_attr(node, name)
    node.attribute.append(helper.make_attribute(name, value))


def del_attr(node: onnx.NodeProto, name: str) -> None:
    """Remove attribute ``name`` from ``node`` if present."""
    keep = [a for a in node.attribute if a.name != name]
    if len(keep) != len(node.attribute):
        del node.attribute[:]
        node.attribute.extend(keep)


def has_attr(node: onnx.NodeProto, name: str) -> bool:
    """Whether ``node`` carries attribute ``name``."""
    return any(a.name == name for a in node.attribute)


def copy_node(node: onnx.NodeProto) -> onnx.NodeProto:
    """A deep copy of ``node``."""
    out = onnx.NodeProto()
    out.CopyFrom(node)
    return out


def input_at(node: onnx.NodeProto, i: int) -> str:
    """Name of input ``i`` ("" when absent)."""
    return node.input[i] if i < len(node.input) else ""


def trim_inputs(node: onnx.NodeProto, n: int) -> None:
    """Keep only the first ``n`` inputs and drop trailing empty names."""
    ins = list(node.input)[:n]
    while ins and not ins[-1]:
        ins.pop()
    del node.input[:]
    node.input.extend(ins)
