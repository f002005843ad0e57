"""Dynamically quantized MatMuls on the graphsurgeon graph: the *dynamic units* a fallback can return to float.

Dynamic quantization (qgraph's ``insert_qdq`` with ``mode: dynamic``, onnxruntime's ``quantize_dynamic``) replaces
``Y = MatMul(X, W)`` with a constant ``W`` by one of three forms; each is one `DynamicUnit`:

- standard ops: ``DynamicQuantizeLinear(X) -> (Xq, Xs, Xz)``, ``MatMulInteger(Xq, Wq, Xz, Wz)``, ``Cast`` to
  float, ``Mul(Xs, Ws)`` and ``Mul(acc, scale) -> Y`` (``Gemm``'s bias stays a separate float ``Add``);
- ``com.microsoft.MatMulIntegerToFloat(Xq, Wq, Xs, Ws, Xz, Wz[, bias]) -> Y`` after a ``DynamicQuantizeLinear``;
- ``com.microsoft.DynamicQuantizeMatMul(X, Wq, Ws, Wz[, bias]) -> Y`` (what onnxruntime fuses the first into).

A unit is found structurally (no names, no doc strings): the integer node (its *anchor*), a 2-D integer constant
weight with constant per-tensor or per-column scale and zero point, and the float tensor ``X`` behind the run-time
quantization. Its `name` is the MatMul's it replaced when that can be told (the anchor's name without the suffix
qgraph (``/matmul_int``) or onnxruntime (``_quant``) appends, if no other node uses it), else the anchor's name,
so a unit is chosen by the name of the layer in the float model or by the name the quantized graph shows.
The ``DynamicQuantizeLinear`` is shared by every unit reading ``X``; it is not part of a unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qgraph.graph import GraphHandle
from qgraph.quant.math import dequantize
from qgraph.quant.qdq import is_dynamic_quantize

#: Suffixes quantizers append to the name of the MatMul they replace (qgraph's insert_qdq, onnxruntime).
ANCHOR_SUFFIXES = ("/matmul_int", "_quant")
_MS = "com.microsoft"
#: The integer ops a dynamic unit is built around.
DYNAMIC_OPS = frozenset({"MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"})


@dataclass
class DynamicUnit:
    """One dynamically quantized MatMul (see module docs)."""

    name: str
    anchor: gs.Node
    x: gs.Tensor  # the float activation the unit quantizes at run time
    output: gs.Tensor  # the float tensor the unit produces (the replaced MatMul's output)
    codes: np.ndarray  # the stored integer weight, (K, N)
    scale: np.ndarray  # the weight scale: scalar or (N,)
    zero_point: np.ndarray  # the weight zero point: scalar or (N,)
    weight_name: str  # the integer constant's name (its float twin is found by it, `ReferenceWeights`)
    bias: gs.Tensor | None = None  # a fused bias input (com.microsoft forms)
    nodes: list[gs.Node] = field(default_factory=list)  # the unit's own nodes (anchor, Cast, Muls)
    op: str = "MatMul"

    @property
    def anchor_name(self) -> str:
        """The integer node's name, as the quantized graph shows it."""
        return str(self.anchor.name)

    def dequantized(self) -> np.ndarray:
        """``(codes - zero_point) * scale``, float32: the weight the quantized unit computes with."""
        axis = 1 if np.asarray(self.scale).size > 1 else None
        return dequantize(self.codes, self.scale, self.zero_point, axis).astype(np.float32)


def dynamic_units(graph: GraphHandle) -> list[DynamicUnit]:
    """Every dynamic unit of the top graph, in graph order (one walk over the index)."""
    units = [u for n in graph.index.nodes if (u := _unit(graph, n)) is not None]
    taken = {n.name for n in graph.index.nodes}
    names: set[str] = set()
    for u in units:
        origin = origin_name(u.anchor_name)
        u.name = origin if origin and origin not in taken and origin not in names else u.anchor_name
        names.add(u.name)
    return units


def has_dynamic_units(graph: GraphHandle) -> bool:
    """Whether the top graph has a dynamically quantized MatMul (cheap: stops at the first)."""
    return any(_unit(graph, n) is not None for n in graph.index.nodes if n.op in DYNAMIC_OPS)


def units_by_name(units: list[DynamicUnit]) -> dict[str, DynamicUnit]:
    """Units by their name and by their anchor's name (both choose a unit)."""
    found = {u.anchor_name: u for u in units}
    found.update({u.name: u for u in units})
    return found


def origin_name(anchor: str) -> str:
    """The name of the MatMul an integer node named ``anchor`` replaced, by the quantizers' suffixes ("" if none)."""
    for suffix in ANCHOR_SUFFIXES:
        if anchor.endswith(suffix):
            return anchor[: -len(suffix)]
    return ""


def _unit(graph: GraphHandle, node: gs.Node) -> DynamicUnit | None:
    if node.op not in DYNAMIC_OPS or (node.op != "MatMulInteger") != (node.domain == _MS):
        return None
    if node.op == "DynamicQuantizeMatMul":
        return _fused(graph, node, node.inputs[0], (1, 2, 3), 4)
    dq = graph.producer(node.inputs[0])
    if dq is None or not is_dynamic_quantize(dq.op, dq.domain):
        return None
    if node.op == "MatMulIntegerToFloat":  # (A, B, a_scale, b_scale, a_zp, b_zp, bias)
        if len(node.inputs) > 2 and node.inputs[2] is not dq.outputs[1]:
            return None
        return _fused(graph, node, dq.inputs[0], (1, 3, 5), 6)
    return _integer(graph, node, dq)


def _weight(graph: GraphHandle, node: gs.Node, positions: tuple[int, int, int]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Codes, scale and zero point at ``positions`` of a fused ``node``: codes and scale constant, the zero point
    constant or absent."""
    def const(i: int) -> tuple[bool, np.ndarray | None]:
        present = i < len(node.inputs) and bool(node.inputs[i].name)
        return present, graph.constant_value(node.inputs[i]) if present else None

    (_, codes), (_, scale), (has_zp, zp) = (const(i) for i in positions)
    if codes is None or scale is None or (has_zp and zp is None):
        return None
    return _weight_values(codes, scale, zp)


def _fused(graph: GraphHandle, node: gs.Node, x: gs.Tensor, positions: tuple[int, int, int],
           bias_at: int) -> DynamicUnit | None:
    got = _weight(graph, node, positions)
    if got is None or not node.outputs:
        return None
    bias = node.inputs[bias_at] if len(node.inputs) > bias_at and node.inputs[bias_at].name else None
    return DynamicUnit(node.name, node, x, node.outputs[0], *got, node.inputs[positions[0]].name, bias, [node])


def _only_consumer(graph: GraphHandle, tensor: gs.Tensor, op: str) -> gs.Node | None:
    readers = graph.consumers(tensor)
    if len(readers) != 1 or readers[0].op != op or graph.is_graph_output(tensor):
        return None
    return readers[0]


def _integer(graph: GraphHandle, node: gs.Node, dq: gs.Node) -> DynamicUnit | None:
    """``MatMulInteger -> Cast -> Mul(acc, Mul(Xs, Ws))``: the standard-op form."""
    if len(node.inputs) > 2 and node.inputs[2].name and node.inputs[2] is not dq.outputs[2]:
        return None
    codes = graph.constant_value(node.inputs[1])
    zp = graph.constant_value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3].name else None
    if codes is None or (len(node.inputs) > 3 and node.inputs[3].name and zp is None):
        return None
    cast = _only_consumer(graph, node.outputs[0], "Cast")
    rescale = _only_consumer(graph, cast.outputs[0], "Mul") if cast is not None else None
    if cast is None or rescale is None or int(cast.attrs.get("to", 0)) != 1:
        return None
    scale_t = rescale.inputs[1] if rescale.inputs[0] is cast.outputs[0] else rescale.inputs[0]
    scale_mul = graph.producer(scale_t)
    if scale_mul is None or scale_mul.op != "Mul" or dq.outputs[1] not in scale_mul.inputs:
        return None
    ws_t = scale_mul.inputs[1] if scale_mul.inputs[0] is dq.outputs[1] else scale_mul.inputs[0]
    ws = graph.constant_value(ws_t)
    if ws is None or len(graph.consumers(scale_t)) != 1:
        return None
    got = _weight_values(codes, ws, zp)
    if got is None:
        return None
    return DynamicUnit(node.name, node, dq.inputs[0], rescale.outputs[0], *got, node.inputs[1].name, None,
                       [node, cast, scale_mul, rescale])


def _weight_values(codes: np.ndarray, scale: np.ndarray, zp: np.ndarray | None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    if codes.ndim != 2 or codes.dtype not in (np.int8, np.uint8):
        return None
    n = codes.shape[1]
    zp = np.zeros((), codes.dtype) if zp is None else zp
    if scale.size not in (1, n) or zp.size not in (1, n):
        return None
    return (codes, scale.reshape(-1) if scale.size > 1 else scale.reshape(()),
            zp.reshape(-1) if zp.size > 1 else zp.reshape(()))


def unit_aliases(units: list[DynamicUnit]) -> list[tuple[gs.Node, str, str]]:
    """``(integer node, name, op)`` per unit: a selector (`qgraph.graph.selectors.select`) that names the MatMul a
    unit replaced, or its op type, chooses the unit's integer node."""
    return [(u.anchor, u.name, u.op) for u in units]
