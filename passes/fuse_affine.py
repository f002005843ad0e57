"""``fuse_affine``: fold constant per-channel scales and shifts on either side of a convolution into its weight and
bias.

Exporters write affine steps as separate elementwise nodes: Paddle's PP-LCNetV3 (the PP-OCRv4 detector's and
recognizer's backbone) follows every convolution with a "learnable affine block" ``Mul(a) -> Add(b)`` of one
learned scalar each, and another one after the activation; other exporters leave a bias Add, a folded Scale, a
division by a constant. Quantized as written, each sits between the convolution and its output Q/DQ: the
convolution's output is rounded before the affine step, the step runs in float on dequantized tensors, and the
activation after it is not "read only by an activation" (so its flat side is not clipped, ``insert_qdq``). Folded:

- **after** ``y = Conv(x, W, b)``: ``s * y + d = Conv(x, s W, s b + d)``, ``s`` and ``d`` constant per output channel
  (or one value). Exact for Conv and ConvTranspose (whose output channels are axis 1 of ``W`` per group), any
  padding. A chain ``Mul -> Add -> Div -> Sub ...`` folds as one composed affine map.
- **before** a Conv, ``Conv(s x + d, W, b) = Conv(x, W s, b + sum_k W d)`` with ``s``/``d`` per *input* channel: exact
  where the convolution pads nothing (``pads`` all 0 or ``auto_pad: VALID``), since a padded border would read 0 where
  the unfolded model reads ``d``; a pure scale (``d = 0``) folds whatever the padding. Every reader of the affine
  output must be a Conv that can take it (the affine nodes then go).

Left alone (an affine node next to a convolution is listed in the pass result with the reason): a constant that is
not per channel (per pixel), ``c - x`` and ``c / x`` (not affine in ``x`` in this form), a division by a zero,
non-constant or non-float weights, a padded convolution after a shift; a chain also stops at a tensor with other
readers, a graph or subgraph output, or a tensor a nested subgraph reads. Exact up to float rounding (the PP-OCRv4
detector's probability map moves by 5e-5; onnxruntime's own graph optimizations move it by 1.9e-4). Each
convolution is visited once, each affine node at most twice: O(nodes).

Measured (PP-OCRv4 detector, rapidocr wheel, 64 held-out pages, ``ort-x86-vnni`` on an AVX512-VNNI host): 58
affine nodes fold after their convolutions and 20 (ten ``Mul -> Add`` blocks) into the 1x1 convolutions after them;
the INT8 model's probability map 19.6 -> 21.2 dB against float, text-box F1 0.994 either way, and INT8/float
latency x0.79 -> x0.67 on 2 threads (the float Mul/Add on dequantized 368x368 maps were a third of the INT8 model's
time). ``docs/accuracy.md`` has both CPUs and the recognizer.
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

__all__ = ["FuseAffine", "FuseAffineConfig", "affine_step"]

HOSTS = ("Conv", "ConvTranspose")
AFFINE_OPS = ("Mul", "Add", "Sub", "Div")


@dataclass(frozen=True)
class FuseAffineDetails(PassDetails):
    """How many affine nodes `FuseAffine` folded into the convolution before them (``after``) and into the
    convolutions after them (``before``)."""

    after: int
    before: int


class FuseAffineConfig(PassConfig):
    """Options of ``fuse_affine``."""

    op_types: tuple[str, ...] = Field(
        default=HOSTS, description="Convolutions whose weight and bias take an affine step after them: Conv and/or "
        "ConvTranspose.")
    before: bool = Field(
        default=True, description="Also fold an affine step into the Conv(s) reading it, where that is exact (no "
        "padding, or a pure scale).")


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


def _weights(conv: gs.Node) -> tuple[np.ndarray, np.ndarray | None]:
    w = const_value(conv.inputs[1]) if len(conv.inputs) > 1 else None
    if w is None or w.dtype.kind != "f":
        raise NoMatch(f"{conv.name}'s weight is not a float constant")
    has_bias = len(conv.inputs) > 2 and bool(conv.inputs[2].name)
    b = const_value(conv.inputs[2]) if has_bias else None
    if has_bias and b is None:
        raise NoMatch(f"{conv.name}'s bias is computed, not a constant")
    return w, b


def _set_params(graph: GraphHandle, conv: gs.Node, w: np.ndarray, b: np.ndarray, dtype: np.dtype) -> None:
    """New constants (the old ones may be shared by other nodes) for ``conv``'s weight and bias."""
    conv.inputs[1] = gs.Constant(graph.unique_name(f"{conv.name}/weight", "tensor"),
                                 np.ascontiguousarray(w.astype(dtype)))
    bias = gs.Constant(graph.unique_name(f"{conv.name}/bias", "tensor"), np.ascontiguousarray(b.astype(dtype)))
    if len(conv.inputs) > 2:
        conv.inputs[2] = bias
    else:
        conv.inputs.append(bias)


def _out_channels(conv: gs.Node, w: np.ndarray) -> int:
    return int(w.shape[0]) if conv.op == "Conv" else int(w.shape[1]) * int(conv.attrs.get("group", 1))


def _fold_after(graph: GraphHandle, conv: gs.Node, kept: set[int], res: PassResult, removed: list[gs.Node]) -> int:
    """Fold the chain of affine nodes after ``conv``; returns how many."""
    chain: list[gs.Node] = []
    try:
        w, b = _weights(conv)
    except NoMatch:
        return 0
    m, rank = _out_channels(conv, w), w.ndim
    scale, shift = np.ones(m), np.zeros(m)
    y = conv.outputs[0]
    while True:
        readers = consumers(y)
        if len(readers) != 1 or readers[0].op not in AFFINE_OPS or id(y) in kept or graph.is_graph_output(y):
            break
        res.matched += 1
        try:
            s, d = affine_step(readers[0], y, m, rank)
        except NoMatch as exc:
            res.skip(readers[0].name, exc)
            break
        scale, shift = scale * s, shift * s + d
        chain.append(readers[0])
        y = readers[0].outputs[0]
    if not chain:
        return 0
    if conv.op == "Conv":
        w2 = w * scale.reshape((-1,) + (1,) * (rank - 1))
    else:  # ConvTranspose: W is [C_in, M / group, k...], output channel g * (M / group) + j
        groups = int(conv.attrs.get("group", 1))
        per = scale.reshape(groups, 1, m // groups, *(1,) * (rank - 2))
        w2 = (w.reshape(groups, w.shape[0] // groups, *w.shape[1:]) * per).reshape(w.shape)
    b0 = np.zeros(m) if b is None else b.reshape(-1).astype(np.float64)
    _set_params(graph, conv, w2, b0 * scale + shift, w.dtype)
    out = chain[-1].outputs[0]
    for node in chain:
        node.outputs.clear()
    conv.outputs[0] = out
    removed.extend(chain)
    return len(chain)


def _padded(conv: gs.Node) -> bool:
    auto_pad = str(conv.attrs.get("auto_pad", "NOTSET"))
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return True
    return auto_pad == "NOTSET" and any(int(p) != 0 for p in conv.attrs.get("pads", ()))


def _chain_before(graph: GraphHandle, x: gs.Tensor, kept: set[int]) -> list[tuple[gs.Node, gs.Tensor]]:
    """The affine nodes (each with the tensor it reads) whose chain ends in ``x``, first to last; every tensor
    between them has that chain's next node as its only reader."""
    chain: list[tuple[gs.Node, gs.Tensor]] = []
    t = x
    while (p := producer(t)) is not None and p.op in AFFINE_OPS and is_default_domain(p.domain):
        if t is not x and (len(consumers(t)) != 1 or id(t) in kept or graph.is_graph_output(t)):
            break
        data = [u for u in p.inputs if const_value(u) is None]
        if len(data) != 1 or len(p.inputs) != 2:
            break
        chain.insert(0, (p, data[0]))
        t = data[0]
    return chain


def _fold_before(graph: GraphHandle, x: gs.Tensor, kept: set[int], res: PassResult, removed: list[gs.Node]) -> int:
    """Fold the affine chain ending in ``x`` into every Conv reading ``x``; returns how many nodes folded."""
    chain = _chain_before(graph, x, kept)
    if not chain:
        return 0
    res.matched += len(chain)
    last = chain[-1][0]
    try:
        readers = consumers(x)
        if id(x) in kept or graph.is_graph_output(x) or any(r.op != "Conv" or r.inputs[0] is not x or
                                           any(t is x for t in r.inputs[1:]) for r in readers):
            raise NoMatch(f"{x.name} is read by other nodes than Convs' data input, a subgraph, or is an output")
        params = [_weights(r) for r in readers]
        rank = params[0][0].ndim
        channels = {int(w.shape[1]) * int(r.attrs.get("group", 1)) for r, (w, _) in zip(readers, params, strict=True)}
        if len(channels) != 1:
            raise NoMatch(f"the Convs reading {x.name} disagree on its channel count")
        c = channels.pop()
        scale, shift = np.ones(c), np.zeros(c)
        for node, u in chain:
            s, d = affine_step(node, u, c, rank)
            scale, shift = scale * s, shift * s + d
        if np.any(shift != 0) and any(_padded(r) for r in readers):
            raise NoMatch(f"a Conv reading {x.name} pads its border with 0 where the affine step's output is "
                          "the shift: only a pure scale folds into a padded convolution")
    except NoMatch as exc:
        res.skip(last.name, exc)
        return 0
    for conv, (w, b) in zip(readers, params, strict=True):
        m, per_group = int(w.shape[0]), int(w.shape[1])
        groups = c // per_group
        # input channel of weight [o, i]: (o // (m / groups)) * per_group + i
        index = (np.arange(m) // (m // groups))[:, None] * per_group + np.arange(per_group)[None, :]
        tail = (1,) * (rank - 2)
        s_oi, d_oi = scale[index].reshape(m, per_group, *tail), shift[index].reshape(m, per_group, *tail)
        w64 = w.astype(np.float64)
        b0 = np.zeros(m) if b is None else b.reshape(-1).astype(np.float64)
        _set_params(graph, conv, w64 * s_oi, b0 + (w64 * d_oi).reshape(m, -1).sum(axis=1), w.dtype)
        conv.inputs[0] = chain[0][1]
    removed.extend(node for node, _ in chain)
    return len(chain)


@register
class FuseAffine(Pass[FuseAffineConfig]):
    """Fold constant per-channel ``Mul``/``Add``/``Sub``/``Div`` steps after a Conv/ConvTranspose into its weight and
    bias, and (``before``) steps before a Conv into its weight and bias where that is exact (module docstring).

    The convolution takes over the last folded node's output tensor, so names downstream are kept; a
    BatchNormalization after the chain can then fold (``fuse_batchnorm``)."""

    name = "fuse_affine"
    config_class = FuseAffineConfig
    preserves_float = True

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Fold every chain of every scope; a chain that cannot fold is skipped with why."""
        res = PassResult()
        after = before = 0
        for scope in graph.scopes():
            removed: list[gs.Node] = []
            hosts = [n for n in scope.nodes if n.op in self.config.op_types and is_default_domain(n.domain)]
            kept = pinned_tensors(scope)
            for conv in hosts:
                after += _fold_after(graph, conv, kept, res, removed)
            if self.config.before:
                seen: set[int] = set()
                for conv in hosts:
                    x = conv.inputs[0] if conv.op == "Conv" and conv.inputs else None
                    if x is not None and id(x) not in seen:
                        seen.add(id(x))
                        before += _fold_before(graph, x, kept, res, removed)
            if removed:
                rebuild(scope, removed)
        res.rewritten = res.nodes_removed = after + before
        if res.rewritten:
            graph.changed()
        res.details = FuseAffineDetails(after=after, before=before)
        return res
