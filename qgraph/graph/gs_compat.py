"""What onnx-graphsurgeon 0.6 cannot carry through import/export, kept beside the graph and put back on export.

graphsurgeon drops ``TYPE_PROTO`` attributes on import (the ``type`` of an ``Optional`` node: "Attribute of type
TYPE_PROTO is currently unsupported. Skipping attribute.") and crashes on export for a tensor typed ``optional(...)``
(``UnboundLocalError`` in its value-info exporter). Any model that onnx.checker and onnxruntime accept must
round-trip unchanged, so `TypeKeeper` records those pieces at import (one walk over the model) and restores them
around export: the dropped attributes go back onto their nodes, optional-typed tensors are exported as plain tensors
and their exact types written back by name.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx
import onnx_graphsurgeon as gs

from .ops import graph_scopes, proto_scopes


class TypeKeeper:
    """The ONNX types and attributes of one model that graphsurgeon cannot represent."""

    def __init__(self, model: onnx.ModelProto, graph: gs.Graph) -> None:
        #: value name -> its full type, for values whose type graphsurgeon cannot export (optional, nested).
        self.types: dict[str, onnx.TypeProto] = {}
        for proto_graph, gs_graph in _pairs(model.graph, graph):
            self._record(proto_graph, gs_graph)

    def _record(self, proto: onnx.GraphProto, graph: gs.Graph) -> None:
        for info in [*proto.input, *proto.output, *proto.value_info]:
            if not _gs_can_export(info.type):
                self.types[info.name] = _own(info.type)
        if len(proto.node) != len(graph.nodes):  # graphsurgeon keeps node order; anything else is not ours to fix
            return
        for pnode, gnode in zip(proto.node, graph.nodes, strict=True):
            for attr in pnode.attribute:
                if attr.type == onnx.AttributeProto.TYPE_PROTO and attr.name not in gnode.attrs:
                    gnode.attrs[attr.name] = _own(attr.tp)  # onnx.helper.make_attribute exports a TypeProto as is
                elif attr.type == onnx.AttributeProto.TYPE_PROTOS and attr.name not in gnode.attrs:
                    gnode.attrs[attr.name] = [_own(tp) for tp in attr.type_protos]

    def export(self, graph: gs.Graph) -> onnx.ModelProto:
        """``gs.export_onnx(graph)`` with the recorded types put back."""
        changed: list[tuple[gs.Tensor, str, object]] = []
        if self.types:
            for tensor in _tensors(graph):
                if tensor.name in self.types and not isinstance(tensor, gs.Constant):
                    # graphsurgeon stores an optional's element TypeProto as its dtype: export an untyped value
                    # and write the recorded type back below.
                    changed.append((tensor, tensor.type, tensor.dtype))
                    tensor.type, tensor.dtype = "tensor_type", None
        try:
            model: onnx.ModelProto = gs.export_onnx(graph, do_type_check=False)
        finally:
            for tensor, kind, dtype in changed:
                tensor.type, tensor.dtype = kind, dtype
        if self.types:
            for g in proto_scopes(model.graph):
                for info in [*g.input, *g.output, *g.value_info]:
                    if info.name in self.types:
                        info.type.CopyFrom(self.types[info.name])
        return model


def _own(tp: onnx.TypeProto) -> onnx.TypeProto:
    """A copy of ``tp`` in its own protobuf: a reference into the model would keep the whole model (every weight)
    in memory (`qgraph.graph.detach`)."""
    copy = onnx.TypeProto()
    copy.CopyFrom(tp)
    return copy


def _gs_can_export(tp: onnx.TypeProto) -> bool:
    kind = tp.WhichOneof("value")
    if kind == "tensor_type" or kind == "sparse_tensor_type":
        return True
    if kind == "sequence_type":
        return bool(tp.sequence_type.elem_type.WhichOneof("value") == "tensor_type")
    return kind is None


def _pairs(proto: onnx.GraphProto, graph: gs.Graph) -> Iterator[tuple[onnx.GraphProto, gs.Graph]]:
    """(proto graph, graphsurgeon graph) for the top graph and every subgraph, matched by node position."""
    stack = [(proto, graph)]
    while stack:
        p, g = stack.pop()
        yield p, g
        if len(p.node) != len(g.nodes):
            continue
        for pnode, gnode in zip(p.node, g.nodes, strict=True):
            for attr in pnode.attribute:
                value = gnode.attrs.get(attr.name)
                if attr.type == onnx.AttributeProto.GRAPH and isinstance(value, gs.Graph):
                    stack.append((attr.g, value))
                elif attr.type == onnx.AttributeProto.GRAPHS and isinstance(value, list):
                    stack.extend((pg, gg) for pg, gg in zip(attr.graphs, value, strict=False)
                                 if isinstance(gg, gs.Graph))


def _tensors(root: gs.Graph) -> Iterator[gs.Tensor]:
    for g in graph_scopes(root):
        yield from g.inputs
        yield from g.outputs
        for node in g.nodes:
            yield from node.outputs
