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
    AFFINE_OPS,
    NoMatch,
    affine_step,
    const_value,
    consumers,
    conv_params,
    fold_after_conv,
    is_default_domain,
    pinned_tensors,
    producer,
    rebuild,
    set_conv_params,
)

__all__ = ["FuseAffine", "FuseAffineConfig"]

HOSTS = ("Conv", "ConvTranspose")


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
        params = [conv_params(r) for r in readers]
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
        set_conv_params(graph, conv, w64 * s_oi, b0 + (w64 * d_oi).reshape(m, -1).sum(axis=1), w.dtype)
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
                fold = fold_after_conv(graph, conv, kept)
                res.matched += fold.matched
                for node, why in fold.refusals:
                    res.skip(node, why)
                removed += fold.folded
                after += len(fold.folded)
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
