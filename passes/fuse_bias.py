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
producer whose output has other readers or is a graph or subgraph output, a non-constant weight or bias, non-float
dtypes. The mechanism is ``fuse_affine``'s (`qgraph.graph.fold_after_conv`, restricted to Add; ``fuse_affine`` also
folds Mul/Sub/Div and does what this pass does in the ready recipes). One visit per convolution: O(nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs
from pydantic import Field

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassDetails, PassResult, register
from qgraph.graph import fold_after_conv, is_default_domain, pinned_tensors, rebuild

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


@register
class FuseBias(Pass[FuseBiasConfig]):
    """Fold ``Add(Conv(x, W[, b]), c)`` with ``c`` constant per output channel into ``Conv(x, W, b + c)``.

    Also for ConvTranspose (channels on axis 1 of its weight, times ``group``). The fused op writes the Add's
    output tensor, so names downstream are kept; a BatchNormalization after the Add can then fold."""

    name = "fuse_bias"
    config_class = FuseBiasConfig
    preserves_float = True

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Fold every matching Add of every scope (`qgraph.graph.fold_after_conv` restricted to Add); an Add after
        a host op that cannot fold is skipped with why."""
        res = PassResult()
        for scope in graph.scopes():
            removed: list[gs.Node] = []
            pinned = pinned_tensors(scope)  # a subgraph's output or implicit input keeps its producer
            for conv in [n for n in scope.nodes if n.op in self.config.op_types and is_default_domain(n.domain)]:
                fold = fold_after_conv(graph, conv, pinned, ops=("Add",))
                res.matched += fold.matched
                for node, why in fold.refusals:
                    res.skip(node, why)
                removed += fold.folded
            res.rewritten += len(removed)
            if removed:
                rebuild(scope, removed)
        if res.rewritten:
            graph.changed()
        res.nodes_removed = res.rewritten
        res.details = FuseBiasDetails(folded=res.rewritten)
        return res
