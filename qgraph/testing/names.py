"""Models that already use the names qgraph's helper nodes would take: the guard that generated names are fresh."""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import helper


def occupied(model: onnx.ModelProto, names: Iterable[str], *, as_outputs: bool = False) -> onnx.ModelProto:
    """A copy of ``model`` with one ``Identity`` of its first graph input per name of ``names``, the node and its
    output both called that name: code that adds those names without checking builds an invalid model (two
    producers of one tensor) or reads the squatter's value. ``as_outputs`` also declares them graph outputs, so
    code that removes unused nodes (a graphsurgeon cleanup) keeps them (typed as the input they copy)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    source, kind = out.graph.input[0].name, out.graph.input[0].type
    listed = list(names)
    out.graph.node.extend(helper.make_node("Identity", [source], [n], name=n) for n in listed)
    if as_outputs:
        out.graph.output.extend(helper.make_value_info(n, kind) for n in listed)
    return out
