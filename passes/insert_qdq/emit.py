"""Activation Q/DQ insertion: one shared QuantizeLinear -> DequantizeLinear pair per quantized tensor.

Tensor ``T`` gets ``QuantizeLinear`` node ``T/q`` (output ``T/q``) and ``DequantizeLinear`` node ``T/dq``
(output ``T/dq``); the scale and zero point are the initializers ``R/scale`` and ``R/zero_point`` of the
group root ``R`` (``R == T`` outside data-movement groups). Consumers are rewired in bulk: every consumer when
the producer runs on integers (onnxruntime fuses only when the Q is the producer's sole consumer), otherwise
only the integer consumers (float consumers keep reading the exact float tensor). A graph output keeps its
name: its producer writes ``T/float``, and the DequantizeLinear writes ``T``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_graphsurgeon as gs

from qgraph.quant.math import QuantDtype

from .units import Plan
from .weights import Emitter, storage


@dataclass(frozen=True)
class ActParams:
    """Quantization parameters of one activation group."""

    scale: float
    zero_point: int
    dtype: QuantDtype
    rmin: float
    rmax: float

    def arrays(self) -> tuple[npt.NDArray[np.float32], npt.NDArray[Any]]:
        """Scalar scale and zero-point arrays (zero point in the storage dtype)."""
        return np.array(self.scale, np.float32), storage(np.array(self.zero_point, self.dtype.numpy_dtype), self.dtype)

    @property
    def storage_dtype(self) -> np.dtype[Any]:
        """numpy dtype of the quantized tensor."""
        return storage(np.zeros(0, self.dtype.numpy_dtype), self.dtype).dtype


def rewire(old: gs.Tensor, new: gs.Tensor, consumers: Iterable[gs.Node]) -> int:
    """Make ``consumers`` read ``new`` instead of ``old``; O(inputs of the consumers + fan-out of ``old``)."""
    moved: set[int] = set()
    for node in consumers:
        hit = False
        for i, t in enumerate(node.inputs):
            if t is old:
                list.__setitem__(node.inputs, i, new)
                hit = True
        if hit and id(node) not in moved:
            moved.add(id(node))
            list.append(new.outputs, node)
    if moved:
        keep = [n for n in old.outputs if id(n) not in moved]
        list.__setitem__(old.outputs, slice(None), keep)
    return len(moved)


def insert_activation_qdq(em: Emitter, plan: Plan, params: dict[str, ActParams]) -> dict[str, str]:
    """Insert the Q/DQ pairs of ``plan`` (``params`` keyed by group root); returns tensor -> DQ output name."""
    idx = em.g.index
    consts: dict[str, tuple[gs.Constant, gs.Constant]] = {}
    dq_of: dict[str, str] = {}
    graph_outputs = {t.name: i for i, t in enumerate(em.g.graph.outputs)}
    for name, root in plan.tensors.items():
        p = params.get(root)
        if p is None:
            continue
        if root not in consts:
            s, z = p.arrays()
            consts[root] = (em.const(f"{root}/scale", s), em.zero_point(root, z))
        scale, zp = consts[root]
        t = idx.tensors[name]
        prod = idx.producer.get(name)
        integer_producer = prod is not None and id(prod) in plan.producers
        consumers = list(idx.consumers.get(name, []))
        if name in graph_outputs and integer_producer:
            assert prod is not None
            src = gs.Variable(em.name(f"{name}/float"), dtype=np.float32, shape=t.shape)
            prod.outputs[prod.outputs.index(t)] = src
            q = gs.Variable(em.name(f"{name}/q"), dtype=p.storage_dtype, shape=t.shape)
            em.node("QuantizeLinear", q.name, [src, scale, zp], [q])
            em.node("DequantizeLinear", f"{name}/dq", [q, scale, zp], [t])
            dq_of[name] = name
            continue
        targets = consumers if integer_producer else [c for c in consumers if id(c) in plan.readers.get(name, ())]
        if not targets:
            continue
        q = gs.Variable(em.name(f"{name}/q"), dtype=p.storage_dtype, shape=t.shape)
        dq = gs.Variable(em.name(f"{name}/dq"), dtype=np.float32, shape=t.shape)
        rewire(t, dq, targets)
        em.node("QuantizeLinear", q.name, [t, scale, zp], [q])
        em.node("DequantizeLinear", dq.name, [q, scale, zp], [dq])
        dq_of[name] = dq.name
    return dq_of
