"""Matching helpers of ``fuse_batchnorm``: reading BN parameters, checking weights, ranks and names.

`BNMatcher` holds the per-run state (handle, config, result, lazily built name registry and inferred shapes)
and every check that can refuse a rewrite; a refusal is a `NoMatch` whose message is the reason reported in
the `PassResult`. The rewrites themselves live in ``fuse_batchnorm``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from qgraph import GraphHandle, PassResult
from qgraph.graph import (
    Inferred,
    NoMatch,
    const_dtype,
    const_value,
    consumers,
    graph_scopes,
    onnx_type_name,
    producer,
    set_const,
    tensor_dtype,
    tensor_shape,
)

from . import bn_math as bnm
from .config import FuseBatchNormConfig


def float_constant(tensor: gs.Tensor, what: str) -> None:
    """Refuse unless ``tensor`` is a float16/32/64 constant (checked without loading exotic dtypes)."""
    if not isinstance(tensor, gs.Constant) and const_value(tensor) is None:
        raise NoMatch(f"{what} {tensor.name!r} is not a constant")
    dtype = const_dtype(tensor)
    if dtype not in bnm.FLOAT_DTYPES:
        raw = getattr(tensor, "dtype", None)
        shown = dtype if dtype is not None else onnx_type_name(raw)
        raise NoMatch(f"{what} {tensor.name!r} has non-float dtype {shown}")


class BNMatcher:
    """Per-run state and the checks shared by every BN rewrite."""

    def __init__(self, handle: GraphHandle, config: FuseBatchNormConfig, pass_name: str) -> None:
        self.handle = handle
        self.cfg = config
        self.pass_name = pass_name
        self.result = PassResult()
        self.scopes = graph_scopes(handle.graph, config.recurse_subgraphs)
        self.counts: Counter[str] = Counter()
        self._inferred: Inferred | None = None
        self._graph_outputs: set[int] = set()

    # ------------------------------------------------------------------ helpers
    def name(self, base: str) -> str:
        return self.handle.unique_name(base)

    def inferred(self) -> Inferred:
        if self._inferred is None:
            self._inferred = self.handle.shapes()
        return self._inferred

    def new_node(self, op: str, name: str, inputs: list[gs.Tensor], outputs: list[gs.Tensor]) -> gs.Node:
        node = gs.Node(op, name, inputs=inputs, outputs=outputs)
        self.handle.tag(node, self.pass_name)
        self.result.nodes_added += 1
        return node

    @staticmethod
    def cheap_rank(x: gs.Tensor) -> int | None:
        """Rank of ``x`` from its own shape or its producer (Conv output rank = weight rank), else None."""
        shape = tensor_shape(x)
        if shape is not None:
            return len(shape)
        prod = producer(x)
        if prod is not None and prod.op in ("Conv", "ConvTranspose") and len(prod.inputs) > 1:
            w = const_value(prod.inputs[1])
            if w is not None:
                return int(w.ndim)
        if prod is not None and prod.op == "Gemm":
            return 2
        return None

    def rank(self, x: gs.Tensor) -> int | None:
        rank = self.cheap_rank(x)
        if rank is None and self._inferred is not None:
            shape = tensor_shape(x, self._inferred)
            rank = None if shape is None else len(shape)
        return rank

    def needs_inference(self) -> bool:
        """Whether some BN may need a rank that only shape inference can give (checked before any rewrite)."""
        for g in self.scopes:
            for bn in g.nodes:
                if bn.op != "BatchNormalization" or not bn.inputs:
                    continue
                prod = producer(bn.inputs[0])
                feeders = [prod] if prod is not None and prod.op == "MatMul" else []
                if prod is not None and prod.op == "Add":
                    feeders = [p for p in map(producer, prod.inputs) if p is not None and p.op == "MatMul"]
                if any(self.cheap_rank(mm.inputs[0]) is None for mm in feeders):
                    return True
                if self.cheap_rank(bn.inputs[0]) is None and self.cheap_rank(bn.outputs[0]) is None:
                    return True
        return False

    def sole_consumer(self, tensor: gs.Tensor, node: gs.Node, what: str) -> None:
        if id(tensor) in self._graph_outputs:
            raise NoMatch(f"{what} is a graph output")
        users = consumers(tensor)
        if len(users) != 1 or users[0] is not node:
            raise NoMatch(f"{what} also feeds {len(users) - 1} other node(s)")

    @staticmethod
    def weight(tensor: gs.Tensor, what: str, ndim: int | None = None) -> np.ndarray:
        float_constant(tensor, what)
        value = const_value(tensor)
        assert value is not None
        if len(consumers(tensor)) > 1 or sum(1 for _ in tensor.outputs) > 1:
            raise NoMatch(f"{what} {tensor.name!r} is shared with other consumers")
        if ndim is not None and value.ndim != ndim:
            raise NoMatch(f"{what} {tensor.name!r} is {value.ndim}-D, expected {ndim}-D")
        return value

    @staticmethod
    def optional_const(node: gs.Node, index: int, what: str) -> np.ndarray | None:
        if len(node.inputs) <= index or not node.inputs[index].name:
            return None
        float_constant(node.inputs[index], what)
        return const_value(node.inputs[index])

    def put_const(self, node: gs.Node, index: int, values: np.ndarray, base: str) -> None:
        """Set input ``index`` of ``node`` to ``values``: in place when unshared, else as a new constant."""
        if len(node.inputs) > index and node.inputs[index].name:
            tensor = node.inputs[index]
            if len(consumers(tensor)) == 1 and sum(1 for _ in tensor.outputs) == 1:
                set_const(tensor, values)
                return
        const = gs.Constant(self.name(base), values)
        while len(node.inputs) <= index:
            node.inputs.append(gs.Variable.empty())
        node.inputs[index] = const

    # ------------------------------------------------------------------ BN parameters
    def params(self, bn: gs.Node) -> bnm.BNAffine:
        attrs: dict[str, Any] = bn.attrs
        if len(bn.inputs) != 5 or not all(t.name for t in bn.inputs):
            raise NoMatch(f"expected 5 inputs, got {len(bn.inputs)}")
        if int(attrs.get("training_mode", 0)) != 0:
            raise NoMatch("training_mode=1 (batch statistics): only inference BatchNormalization is folded")
        if self.handle.opset < 7 and int(attrs.get("is_test", 0)) == 0:
            raise NoMatch("is_test=0 declares training mode (opset < 7)")
        if int(attrs.get("spatial", 1)) == 0:
            raise NoMatch("spatial=0 (per-activation statistics) is not supported")
        for extra in bn.outputs[1:]:
            if extra.name and (extra.outputs or id(extra) in self._graph_outputs):
                raise NoMatch(f"its training output {extra.name!r} is used")
        values = []
        for tensor, what in zip(bn.inputs[1:], ("scale", "bias", "mean", "var"), strict=True):
            float_constant(tensor, what)
            value = const_value(tensor)
            assert value is not None
            values.append(value)
        if len({v.shape for v in values}) != 1 or values[0].ndim != 1:
            raise NoMatch(f"parameters must all be 1-D of one length, got {[v.shape for v in values]}")
        x_dtype = tensor_dtype(bn.inputs[0])
        if x_dtype is not None and x_dtype not in bnm.FLOAT_DTYPES:
            raise NoMatch(f"input has non-float dtype {x_dtype}")
        scale, bias, mean, var = values
        return bnm.BNAffine.from_params(scale, bias, mean, var, float(attrs.get("epsilon", 1e-5)))
