"""``fuse_bias``: fold a constant per-channel Add after a Conv/ConvTranspose into the op's bias.

Paddle's exporter (and some others) write a convolution's bias as a separate node::

    y = ConvTranspose(x, W);  z = Add(y, c)          c: shape [1, M, 1, 1] (or [M, 1, 1], or one value)

Quantized as written, ``y`` gets a Q/DQ pair of its own before the Add, the Add another one after it, and a
BatchNormalization after the Add cannot fold into the convolution (``fuse_batchnorm`` needs the Conv right
before it), so it becomes Mul + Add with two more requantizations. Folded, ``z = Conv(x, W, b + c)``: the bias
is added in int32 inside the integer kernel and the BN folds next. Exact up to float rounding of ``b + c``
(``Conv(x, W, b) + c = Conv(x, W, b + c)`` for a ``c`` constant over every axis but the channel axis 1).

M, the output channel count, is read from the weight: ``W.shape[0]`` for Conv, ``W.shape[1] * group`` for
ConvTranspose. Left alone, with the reason: an Add whose constant is not per output channel (e.g. per pixel), a
producer whose output has other readers or is a graph output, a non-constant weight or bias, non-float dtypes.
One walk over the Adds of every scope: O(nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from pydantic import Field

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassDetails, PassResult, register
from qgraph.graph import (
    NoMatch,
    channel_vector,
    const_value,
    consumers,
    is_default_domain,
    pinned_tensors,
    producer,
    rebuild,
)

__all__ = ["FuseBias", "FuseBiasConfig"]

HOSTS = ("Conv", "ConvTranspose")


@dataclass(frozen=True)
class FuseBiasDetails(PassDetails):
    """How many bias Adds `FuseBias` folded into their Conv/ConvTranspose."""

    folded: int


class FuseBiasConfig(PassConfig):
    """Options of ``fuse_bias``."""

    op_types: tuple[str, ...] = Field(
        default=HOSTS, description="Producers whose bias input takes the constant: Conv and/or ConvTranspose."
    )


def match(add: gs.Node, graph: GraphHandle, hosts: tuple[str, ...]) -> tuple[gs.Node, np.ndarray]:
    """The Conv/ConvTranspose feeding ``add`` and the per-channel vector the Add adds; `NoMatch` otherwise."""
    if len(add.inputs) != 2:
        raise NoMatch("the Add does not have two inputs")
    consts = [const_value(t) for t in add.inputs]
    if sum(v is not None for v in consts) != 1:
        raise NoMatch("the Add does not add exactly one constant")
    k = 0 if consts[0] is not None else 1
    c, y = consts[k], add.inputs[1 - k]
    assert c is not None
    conv = producer(y)
    if conv is None or conv.op not in hosts or not is_default_domain(conv.domain) or len(conv.inputs) < 2:
        raise NoMatch(f"the Add's input is not produced by {'/'.join(hosts)}")
    if len(consumers(y)) != 1 or graph.is_graph_output(y):
        raise NoMatch(f"{conv.name}'s output has other readers or is a graph output")
    w = const_value(conv.inputs[1])
    if w is None or w.dtype.kind != "f" or c.dtype != w.dtype:
        raise NoMatch("the weight is not a float constant of the Add's dtype")
    channels = int(w.shape[0]) if conv.op == "Conv" else int(w.shape[1]) * int(conv.attrs.get("group", 1))
    vector = channel_vector(c, channels, w.ndim)
    if len(conv.inputs) > 2 and conv.inputs[2].name and const_value(conv.inputs[2]) is None:
        raise NoMatch("the bias is not a constant")
    return conv, vector


@register
class FuseBias(Pass[FuseBiasConfig]):
    """Fold ``Add(Conv(x, W[, b]), c)`` with ``c`` constant per output channel into ``Conv(x, W, b + c)``.

    Also for ConvTranspose (channels on axis 1 of its weight, times ``group``). The fused op writes the Add's
    output tensor, so names downstream are kept; a BatchNormalization after the Add can then fold."""

    name = "fuse_bias"
    config_class = FuseBiasConfig
    preserves_float = True

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Fold every matching Add of every scope; an Add after a host op that cannot fold is skipped with why."""
        res = PassResult()
        hosts = tuple(self.config.op_types)
        for scope in graph.scopes():
            removed: list[gs.Node] = []
            pinned = pinned_tensors(scope)  # a subgraph's output or implicit input keeps its producer
            for add in list(scope.nodes):
                if add.op != "Add" or not is_default_domain(add.domain):
                    continue
                prod = [producer(t) for t in add.inputs]
                if not any(p is not None and p.op in hosts for p in prod):
                    continue
                if all(const_value(t) is None for t in add.inputs):
                    continue  # a join of two computed tensors (a residual sum): nothing to fold
                res.matched += 1
                try:
                    conv, vector = match(add, graph, hosts)
                    if id(conv.outputs[0]) in pinned:
                        raise NoMatch(f"{conv.name}'s output is a subgraph output or read by a nested subgraph")
                except NoMatch as exc:
                    res.skip(add.name, exc)
                    continue
                old = const_value(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2].name else None
                bias = (vector if old is None else old.reshape(-1) + vector).astype(vector.dtype)
                new = gs.Constant(graph.unique_name(f"{conv.name}/bias", "tensor"), np.ascontiguousarray(bias))
                if len(conv.inputs) > 2:
                    conv.inputs[2] = new
                else:
                    conv.inputs.append(new)
                out = add.outputs[0]
                add.outputs.clear()  # the Add gives up its output to the fused op
                conv.outputs[0] = out
                removed.append(add)
                res.rewritten += 1
            if removed:
                rebuild(scope, removed)
        if res.rewritten:
            graph.changed()
        res.nodes_removed = res.rewritten
        res.details = FuseBiasDetails(folded=res.rewritten)
        return res
