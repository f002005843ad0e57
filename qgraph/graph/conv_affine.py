"""Constant per-channel affine steps around a convolution, and folding them into its weight and bias.

The mechanism ``fuse_affine`` (Mul/Add/Sub/Div, on both sides of a Conv) and ``fuse_bias`` (an Add after a
Conv/ConvTranspose) share: `affine_step` reads one elementwise node as ``s * x + d`` per channel, `conv_params`
reads a convolution's constant weight and bias, `set_conv_params` gives it new ones, and `fold_after_conv` folds the
chain of such steps after a convolution into it (exact for Conv and ConvTranspose, any padding). Work is
O(the chain): no graph walk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from .handle import GraphHandle
from .match import NoMatch, channel_vector
from .ops import const_value, consumers, is_default_domain

#: Elementwise ops that are affine in one input when the other is a constant.
AFFINE_OPS = ("Mul", "Add", "Sub", "Div")


def affine_step(node: gs.Node, x: gs.Tensor, channels: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``node`` as ``s * x + d`` with ``s``, ``d`` one value per channel (axis 1 of a rank-``rank`` tensor), or
    `NoMatch` with why not."""
    if node.op not in AFFINE_OPS or not is_default_domain(node.domain) or len(node.inputs) != 2:
        raise NoMatch(f"{node.op} is not an elementwise Mul/Add/Sub/Div of two inputs")
    k = 1 if node.inputs[0] is x else 0
    if node.inputs[1 - k] is not x:
        raise NoMatch(f"{node.name} does not read {x.name}")
    c = const_value(node.inputs[k])
    if c is None:
        raise NoMatch(f"{node.name}'s other input is computed, not a constant")
    if k == 0 and node.op in ("Sub", "Div"):
        raise NoMatch(f"{node.name} computes c {'-' if node.op == 'Sub' else '/'} x, not affine in this form")
    if c.dtype.kind != "f":
        raise NoMatch(f"{node.name}'s constant is {c.dtype}, not float")
    vec = channel_vector(c, channels, rank).astype(np.float64)
    one, zero = np.ones(channels), np.zeros(channels)
    if node.op == "Mul":
        return vec, zero
    if node.op == "Add":
        return one, vec
    if node.op == "Sub":
        return one, -vec
    if np.any(vec == 0):
        raise NoMatch(f"{node.name} divides by zero in some channel")
    return 1.0 / vec, zero


def conv_params(conv: gs.Node) -> tuple[np.ndarray, np.ndarray | None]:
    """``conv``'s constant float weight and its constant bias (None when it has none), or `NoMatch`."""
    w = const_value(conv.inputs[1]) if len(conv.inputs) > 1 else None
    if w is None or w.dtype.kind != "f":
        raise NoMatch(f"{conv.name}'s weight is not a float constant")
    has_bias = len(conv.inputs) > 2 and bool(conv.inputs[2].name)
    b = const_value(conv.inputs[2]) if has_bias else None
    if has_bias and b is None:
        raise NoMatch(f"{conv.name}'s bias is computed, not a constant")
    return w, b


def set_conv_params(graph: GraphHandle, conv: gs.Node, w: np.ndarray | None, b: np.ndarray, dtype: np.dtype) -> None:
    """New constants for ``conv``'s weight (None: the weight stays) and bias; new ones because the old may be
    shared by other nodes."""
    if w is not None:
        conv.inputs[1] = gs.Constant(graph.unique_name(f"{conv.name}/weight", "tensor"),
                                     np.ascontiguousarray(w.astype(dtype)))
    bias = gs.Constant(graph.unique_name(f"{conv.name}/bias", "tensor"), np.ascontiguousarray(b.astype(dtype)))
    if len(conv.inputs) > 2:
        conv.inputs[2] = bias
    else:
        conv.inputs.append(bias)


@dataclass
class AffineFold:
    """What `fold_after_conv` did: the nodes folded (for the caller to remove), how many candidate steps it met,
    and the ones it refused (node name, why)."""

    folded: list[gs.Node] = field(default_factory=list)
    matched: int = 0
    refusals: list[tuple[str, NoMatch]] = field(default_factory=list)


def _scale_out_channels(conv: gs.Node, w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    if conv.op == "Conv":
        return np.asarray(w * scale.reshape((-1,) + (1,) * (w.ndim - 1)))
    # ConvTranspose: W is [C_in, M / group, k...], output channel g * (M / group) + j
    groups = int(conv.attrs.get("group", 1))
    per = scale.reshape(groups, 1, scale.size // groups, *(1,) * (w.ndim - 2))
    return np.asarray((w.reshape(groups, w.shape[0] // groups, *w.shape[1:]) * per).reshape(w.shape))


def fold_after_conv(graph: GraphHandle, conv: gs.Node, pinned: set[int],
                    ops: tuple[str, ...] = AFFINE_OPS) -> AffineFold:
    """Fold the chain of constant per-channel steps (``ops``) after ``conv`` (a Conv or ConvTranspose) into its
    weight and bias: ``s * Conv(x, W, b) + d = Conv(x, s W, s b + d)``. The convolution takes over the last step's
    output tensor; the chain stops at a tensor with other readers, a graph output or one in ``pinned``
    (`pinned_tensors`), each such step refused with why."""
    out = AffineFold()
    y = conv.outputs[0]
    scale = shift = np.zeros(0)
    params: tuple[np.ndarray, np.ndarray | None] | None = None
    while True:
        readers = consumers(y)
        steps = [r for r in readers if r.op in ops and is_default_domain(r.domain)
                 and any(const_value(t) is not None for t in r.inputs)]
        if not steps:
            break
        out.matched += len(steps)
        try:
            if len(readers) != 1:
                raise NoMatch(f"{y.name} has other readers than {steps[0].name}")
            if id(y) in pinned or graph.is_graph_output(y):
                raise NoMatch(f"{conv.name}'s output is a graph output, a subgraph output or read by a nested subgraph")
            if params is None:
                params = conv_params(conv)
                w = params[0]
                m = int(w.shape[0]) if conv.op == "Conv" else int(w.shape[1]) * int(conv.attrs.get("group", 1))
                scale, shift = np.ones(m), np.zeros(m)
            s, d = affine_step(steps[0], y, scale.size, params[0].ndim)
        except NoMatch as exc:
            out.refusals += [(r.name, exc) for r in steps]
            break
        scale, shift = scale * s, shift * s + d
        out.folded.append(steps[0])
        y = steps[0].outputs[0]
    if not out.folded or params is None:
        return out
    w, b = params
    b0 = np.zeros(scale.size) if b is None else b.reshape(-1).astype(np.float64)
    w2 = None if np.all(scale == 1.0) else _scale_out_channels(conv, w, scale)
    set_conv_params(graph, conv, w2, b0 * scale + shift, w.dtype)
    last = out.folded[-1].outputs[0]
    for node in out.folded:
        node.outputs.clear()  # each step gives up its output; the convolution writes the last one
    conv.outputs[0] = last
    return out
