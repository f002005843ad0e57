"""How a pass says a rewrite does not apply: one mechanism, used by every pass.

A matcher that finds the pattern does not apply raises `NoMatch` with a sentence a user can act on, however deep
inside the matcher it is found; the pass catches it where it loops over nodes and hands it to
``PassResult.skip(node, refusal)``, so the user sees why that node was left alone. A failed match is not an error
(that is `qgraph.errors.PassError`). Refusals that are collected rather than skipped one by one (``lower_opset``
lists every node it cannot lower before refusing the model) keep the `NoMatch` objects: each knows its node and op.

    try:
        found = match_conv_bn(graph, node)
    except NoMatch as refusal:
        res.skip(node.name, refusal)
        continue
"""

from __future__ import annotations

import numpy as np


class NoMatch(Exception):
    """The pattern does not apply, for ``reason`` (a sentence a user can act on); ``node`` / ``op`` say where,
    when the code raising it knows. ``str()`` is the reason alone; `where` adds the node."""

    def __init__(self, reason: str, node: str = "", op: str = "") -> None:
        super().__init__(reason)
        self.reason, self.node, self.op = reason, node, op

    @property
    def where(self) -> str:
        """``<op> node '<name>': <reason>`` (or ``<name>: <reason>`` without an op; the reason alone without a
        node): the refusal as a line of a list."""
        place = f"{self.op} node {self.node!r}" if self.op else self.node
        return f"{place}: {self.reason}" if place else self.reason


def channel_vector(c: np.ndarray, channels: int, out_rank: int) -> np.ndarray:
    """``c`` as the length-``channels`` vector it adds or multiplies per channel (axis 1 of a rank-``out_rank``
    tensor), or `NoMatch` when ``c`` is not constant over every other axis (or would broadcast the tensor to more
    axes). How ``fuse_bias`` and ``fuse_affine`` read a per-channel constant."""
    if c.ndim > out_rank:
        raise NoMatch(f"the constant has rank {c.ndim} > the tensor's rank {out_rank}")
    if c.size == 1:
        return np.full(channels, c.reshape(-1)[0], dtype=c.dtype)
    full = (1,) * (out_rank - c.ndim) + tuple(c.shape)  # numpy broadcasting aligns the trailing axes
    if full[1] != channels or any(d != 1 for i, d in enumerate(full) if i != 1):
        raise NoMatch(f"the constant of shape {list(c.shape)} is not one value per channel ({channels})")
    return c.reshape(channels)
