"""Groups and folds of ``smooth_quant``: which layers share an input X, and where ``X / s`` can be absorbed.

A *group* is every reader of one tensor X when they are all selected MatMul/Gemm layers with constant weights
(Q/K/V projections after one LayerNorm): one ``s`` serves them all, with ``w_j`` the largest of their input
channel ``j`` ranges. The *fold* walks back from X through ops that can carry a per-last-axis factor exactly:

- ``LayerNormalization`` over the last axis: ``γ ← γ / s``, ``β ← β / s``;
- ``Mul`` by a constant: ``c ← c / s`` (e.g. the 0.5 of an exported GELU: ``x·(1 + erf(x/√2))·(0.5/s)``);
- ``Add`` of a constant (a bias, the β of a decomposed LayerNorm): ``c ← c / s``, then the other operand
  carries ``1 / s`` too (it must be read only by this Add);
- a preceding MatMul/Gemm with a constant weight: its output columns and bias ``/ s``.

A constant shared with other nodes (one 0.5 for every GELU) is copied for this node, never changed in place.
Anything else (a residual Add of two variables, a graph input, GELU, Reshape, a tensor read elsewhere) cannot
absorb ``1 / s`` exactly: the group is skipped with that reason, or, with ``insert_mul``, gets a float
``Mul(X, 1/s)`` in front of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qgraph import GraphHandle
from qgraph.graph import NoMatch, const_value, consumers, is_default_domain, producer, renew_const
from qgraph.recovery.equalize import LinearLayer, as_linear, scale_const_per_channel, sole_use


@dataclass
class Fold:
    """Where ``1 / s`` goes: constants scaled on their last axis and layers scaled per output channel."""

    consts: list[tuple[gs.Node, int]] = field(default_factory=list)  # (node, input index of the constant)
    layers: list[LinearLayer] = field(default_factory=list)
    via: list[str] = field(default_factory=list)

    def label(self) -> str:
        """``LayerNormalization 'ln'`` / ``Add 'b' -> MatMul 'mm'`` for reports."""
        return " <- ".join(self.via)


@dataclass
class Group:
    """The layers reading ``x`` and how their ``1 / s`` is absorbed (``fold`` None: an inserted Mul)."""

    x: gs.Tensor
    layers: list[LinearLayer]
    channels: int
    fold: Fold | None
    others: list[gs.Node] = field(default_factory=list)  # readers of x outside the group (insert_mul only)


def _channel_const(node: gs.Node, tensor: gs.Tensor, channels: int) -> None:
    value = const_value(tensor)
    if value is None:
        raise NoMatch(f"{node.op} {node.name!r}: {tensor.name!r} is not a constant")
    if value.dtype.kind != "f":
        raise NoMatch(f"{node.op} {node.name!r}: {tensor.name!r} is not a float constant")
    fits = scale_const_per_channel(value, np.ones(channels), -1, max(value.ndim, 1)) is not None
    if value.size not in (1, channels) or not fits:
        raise NoMatch(f"{node.op} {node.name!r}: constant of shape {value.shape} is not per last-axis channel")


def plan_fold(x: gs.Tensor, channels: int, outputs: set[int]) -> Fold:
    """How ``x / s`` can be produced exactly by rescaling constants upstream, or `NoMatch` with why not."""
    fold, t = Fold(), x
    for _ in range(16):
        if id(t) in outputs:
            raise NoMatch(f"{t.name!r} is a graph output")
        node = producer(t)
        if node is None:
            raise NoMatch(f"{t.name!r} is a graph input: nothing upstream can absorb 1/s")
        if not is_default_domain(node.domain):
            raise NoMatch(f"{t.name!r} comes from {node.domain}.{node.op} {node.name!r}")
        fold.via.append(f"{node.op} {node.name!r}")
        if node.op == "LayerNormalization":
            if int(node.attrs.get("axis", -1)) != -1:
                raise NoMatch(f"LayerNormalization {node.name!r} does not normalize the last axis alone (axis=-1)")
            for index in (1, 2):
                if len(node.inputs) > index and node.inputs[index].name:
                    _channel_const(node, node.inputs[index], channels)
                    fold.consts.append((node, index))
            return fold
        if node.op in ("Mul", "Add") and len(node.inputs) == 2:
            held = [i for i, v in enumerate(node.inputs) if const_value(v) is not None]
            if len(held) != 1:
                what = "a residual Add / product of two variables" if not held else "constant-only"
                raise NoMatch(f"{t.name!r} comes from {node.op} {node.name!r} ({what}), which cannot absorb 1/s")
            _channel_const(node, node.inputs[held[0]], channels)
            fold.consts.append((node, held[0]))
            if node.op == "Mul":
                return fold
            t = node.inputs[1 - held[0]]
            if not sole_use(t, node):
                raise NoMatch(f"{t.name!r} (before Add {node.name!r}) has other readers")
            continue
        if node.op in ("MatMul", "Gemm"):
            layer = as_linear(node)
            if layer.out_channels(layer.value()) != channels:
                raise NoMatch(f"{node.name!r} has {layer.out_channels(layer.value())} outputs, {channels} expected")
            fold.layers.append(layer)
            return fold
        raise NoMatch(f"{t.name!r} comes from {node.op} {node.name!r}, which cannot absorb a per-channel 1/s")
    raise NoMatch("fold path too long")


def find_groups(
    graph: gs.Graph, selected: set[int] | None, insert_mul: bool, skip: list[tuple[str, str]]
) -> list[Group]:
    """Every smoothable group of the top graph (a refusal goes to ``skip`` as ``(node name, reason)``)."""
    outputs = {id(t) for t in graph.outputs}
    seen: set[int] = set()
    groups: list[Group] = []
    for node in graph.nodes:
        if node.op not in ("MatMul", "Gemm") or (selected is not None and id(node) not in selected):
            continue
        if len(node.inputs) < 2 or const_value(node.inputs[1]) is None or id(node.inputs[0]) in seen:
            continue  # activation x activation products (attention scores) are not candidates
        x = node.inputs[0]
        seen.add(id(x))
        try:
            groups.append(_group(x, selected, insert_mul, outputs))
        except NoMatch as refusal:
            skip.append((node.name, str(refusal)))
    return groups


def _group(x: gs.Tensor, selected: set[int] | None, insert_mul: bool, outputs: set[int]) -> Group:
    layers: list[LinearLayer] = []
    others: list[gs.Node] = []
    for user in consumers(x):
        try:
            if selected is not None and id(user) not in selected:
                raise NoMatch(f"{user.name!r} is not selected")
            layer = as_linear(user)
            if user.inputs[0] is not x or sum(1 for t in user.inputs if t is x) != 1:
                raise NoMatch(f"{user.name!r} reads it other than as its data input")
        except NoMatch as err:
            if not insert_mul:
                raise NoMatch(f"{x.name!r} is also read by {user.op} {user.name!r} ({err})") from None
            others.append(user)
            continue
        layers.append(layer)
    if not layers:
        raise NoMatch(f"no reader of {x.name!r} can be smoothed")
    widths = {layer.in_channels(layer.value()) for layer in layers}
    if len(widths) != 1:
        raise NoMatch(f"readers of {x.name!r} disagree on the channel count: {sorted(widths)}")
    channels = widths.pop()
    fold: Fold | None = None
    if not others:
        try:
            fold = plan_fold(x, channels, outputs)
        except NoMatch:
            if not insert_mul:
                raise
    return Group(x, layers, channels, fold, others)


def weight_dtype(tensor: gs.Tensor) -> np.dtype:
    """The float type of constant ``tensor``."""
    value = const_value(tensor)
    assert value is not None
    return value.dtype


def scale_group_weights(group: Group, s: np.ndarray) -> None:
    """``W ← diag(s) · W`` for every layer of the group (input channel ``j`` times ``s_j``)."""
    for layer in group.layers:
        renew_const(layer.weight, layer.scale_in(layer.value(), s).astype(weight_dtype(layer.weight)))


def apply_fold(graph: GraphHandle, group: Group, s: np.ndarray) -> dict[str, tuple[int, np.ndarray]]:
    """Scale the group's weights by ``s`` and fold ``1 / s`` into its producer (``group.fold``, not None): the
    model computes the same function. Returns the tensors now scaled by ``1 / s`` on their last axis, for
    `qgraph.quant.rescaling.record_rescaling` (once per pass: the record is one JSON text). Used by ``smooth_quant``
    and by ``quantize_weights``' AWQ."""
    assert group.fold is not None
    scale_group_weights(group, s)
    inv = 1.0 / s
    for node, index in group.fold.consts:
        const = node.inputs[index]
        value = const_value(const)
        assert value is not None
        scaled = scale_const_per_channel(value, inv, -1, max(value.ndim, 1))
        assert scaled is not None  # checked by plan_fold
        if sole_use(const, node):
            renew_const(const, scaled)
        else:  # shared (one 0.5 for every GELU): this node gets its own copy
            node.inputs[index] = gs.Constant(graph.unique_name(f"{const.name}/smoothed", kind="tensor"), scaled)
    for layer in group.fold.layers:
        renew_const(layer.weight, layer.scale_out(layer.value(), inv).astype(weight_dtype(layer.weight)))
        if layer.bias is not None:
            bias = const_value(layer.bias)
            assert bias is not None
            scaled = scale_const_per_channel(bias, inv, -1, max(bias.ndim, 1))
            assert scaled is not None
            renew_const(layer.bias, scaled)
    # every tensor the fold scaled now holds value / s on its last axis: for the caller to record once
    # (`qgraph.quant.rescaling`), so that a diff or the culprit ranking compares like with like
    names = {group.x.name, *(node.outputs[0].name for node, _ in group.fold.consts),
             *(la.node.outputs[0].name for la in group.fold.layers)}
    return {name: (-1, np.asarray(inv, np.float64)) for name in sorted(names)}
