"""Finding the layer pairs of ``equalize_weights``: ``L1 → f → ... → L2`` with every ``f`` scale-equivariant.

Walk from each linear layer's output along sole consumers through ops that commute with a positive
per-channel scale (``f(x / s) = f(x) / s``) until the tensor is read only by linear layers (the "second"
layers; several readers, e.g. an Inception or Fire module's branches, share one ``s``). Every refusal is a
`NoMatch` whose message names the tensor or node that stopped the walk. O(path length) per layer.

What is exact, and why (``s > 0`` per channel):

- Relu, LeakyRelu, PRelu (any slope shape: PReLU is elementwise, a positive factor keeps each sign), Identity,
  inference Dropout, MaxPool / GlobalMaxPool (max of positives scales), AveragePool / GlobalAveragePool (linear;
  zero padding scales), Mul by a constant (elementwise: any constant commutes), Add of a constant (exact when
  the constant is divided by ``s`` too, so it must be unshared and broadcast per channel), Flatten after a
  global pool (channel ``c`` stays at index ``c`` of the ``[N, C]`` result).
- Clip(lo, hi) is exact only for ``lo ∈ {0, -inf}`` and ``hi = +inf``: ``Clip(x / s, lo, hi) · s =
  Clip(x, lo · s, hi · s)``, and a scalar bound cannot follow a per-channel ``s`` (ReLU6 would need the bound
  ``6 · s_i`` per channel). Clip with a finite max (ReLU6), HardSwish, HardSigmoid, Sigmoid, Tanh, Gelu, LRN
  are not positively homogeneous, so those pairs are skipped with that reason rather than approximated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from qgraph.graph import NoMatch, const_value, consumers, is_default_domain
from qgraph.recovery.equalize import LinearLayer, as_linear, scale_const_per_channel, sole_use

_SIMPLE = {"Relu", "LeakyRelu", "Identity", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"}
_NOT_HOMOGENEOUS = {
    "HardSwish": "HardSwish(x) = x·ReLU6(x + 3)/6 is not positively homogeneous",
    "HardSigmoid": "HardSigmoid has a fixed offset and saturation",
    "Sigmoid": "Sigmoid(x / s) ≠ Sigmoid(x) / s",
    "Tanh": "Tanh(x / s) ≠ Tanh(x) / s",
    "BatchNormalization": "an unfused BatchNormalization adds a shift (run fuse_batchnorm first)",
}


@dataclass
class Pair:
    """``first`` → (``path``) → ``second`` layers; ``shifts`` are constants added on the way (scaled by 1/s)."""

    first: LinearLayer
    second: list[LinearLayer]
    path: list[gs.Node] = field(default_factory=list)
    shifts: list[tuple[gs.Tensor, int, int]] = field(default_factory=list)  # (constant, channel axis, rank)
    #: Tensors from ``first``'s output to ``second``'s input, with their channel axis: they hold ``x / s``.
    scaled: list[tuple[str, int]] = field(default_factory=list)

    @property
    def label(self) -> str:
        """``first -> second[, ...]`` for reports."""
        via = "".join(f" -> {n.op}" for n in self.path)
        return f"{self.first.node.name}{via} -> {', '.join(s.node.name for s in self.second)}"


class NoSecondLayer(NoMatch):
    """The walk ended at a graph output or an unread tensor: the last layer of a model, nothing to pair with."""


class _Walk:
    """State of one walk: where the channels are and what the tensor's rank is (None: unknown)."""

    def __init__(self, first: LinearLayer) -> None:
        self.axis = first.channel_axis
        w = const_value(first.weight)
        assert w is not None
        self.rank: int | None = int(w.ndim) if first.kind == "conv" else (2 if first.node.op == "Gemm" else None)
        self.pooled = False  # spatial dims are 1 (after a global pool)
        self.channels = first.out_channels(w)
        self.pair = Pair(first, [])


def _clip_bounds(node: gs.Node) -> tuple[float, float]:
    lo, hi = -math.inf, math.inf
    if len(node.inputs) > 1 or "min" not in node.attrs:
        for i, default in ((1, -math.inf), (2, math.inf)):
            if len(node.inputs) > i and node.inputs[i].name:
                v = const_value(node.inputs[i])
                if v is None or v.size != 1:
                    raise NoMatch(f"Clip {node.name!r} has a non-constant bound")
                if i == 1:
                    lo = float(v.reshape(-1)[0])
                else:
                    hi = float(v.reshape(-1)[0])
            elif i == 1:
                lo = default
    else:
        lo, hi = float(node.attrs.get("min", -math.inf)), float(node.attrs.get("max", math.inf))
    return lo, hi


def _const_operand(node: gs.Node, t: gs.Tensor, walk: _Walk) -> tuple[gs.Tensor, np.ndarray]:
    if len(node.inputs) != 2 or sum(1 for x in node.inputs if x is t) != 1:
        raise NoMatch(f"{node.op} {node.name!r} does not combine the tensor with one constant")
    other = node.inputs[1] if node.inputs[0] is t else node.inputs[0]
    value = const_value(other)
    if value is None:
        raise NoMatch(f"{node.op} {node.name!r} adds a non-constant tensor {other.name!r} (e.g. a residual)")
    limit = walk.rank if walk.rank is not None else 1
    if value.ndim > limit:
        raise NoMatch(f"{node.op} {node.name!r}: constant of shape {value.shape} broadcasts beyond the tensor")
    return other, value


def step(node: gs.Node, t: gs.Tensor, walk: _Walk) -> None:
    """Accept ``node`` (reading ``t``) on the path or raise `NoMatch` with the reason it is not exact."""
    op = node.op
    if not is_default_domain(node.domain):
        raise NoMatch(f"{node.domain}.{op} {node.name!r} is not a known scale-equivariant op")
    if op in _NOT_HOMOGENEOUS:
        raise NoMatch(f"{op} {node.name!r} is not scale-equivariant: {_NOT_HOMOGENEOUS[op]}")
    if op in _SIMPLE or op == "PRelu" or op == "Dropout":
        if node.inputs[0] is not t:
            raise NoMatch(f"{op} {node.name!r} reads the tensor as a parameter")
        if any(o.name and consumers(o) for o in node.outputs[1:]):
            raise NoMatch(f"{op} {node.name!r} has a second output in use")
        if op == "Dropout" and len(node.inputs) > 2 and node.inputs[2].name:
            mode = const_value(node.inputs[2])
            if mode is None or bool(mode.reshape(-1)[0]):
                raise NoMatch(f"Dropout {node.name!r} may run in training mode")
        if op.startswith("Global"):
            if walk.axis != 1:
                raise NoMatch(f"{op} {node.name!r} pools a tensor whose channels are not on axis 1")
            walk.pooled = True
    elif op == "Clip":
        lo, hi = _clip_bounds(node)
        if lo not in (0.0, -math.inf) or hi != math.inf:
            raise NoMatch(
                f"Clip {node.name!r} [{lo:g}, {hi:g}] is not scale-equivariant: Clip(x/s, lo, hi)·s = "
                "Clip(x, lo·s, hi·s) and a scalar bound cannot follow a per-channel s (only [0 or -inf, +inf] "
                "is exact)"
            )
    elif op == "Mul":
        _const_operand(node, t, walk)
    elif op == "Add":
        other, value = _const_operand(node, t, walk)
        if not sole_use(other, node):
            raise NoMatch(f"Add {node.name!r}: its constant {other.name!r} is shared")
        if walk.rank is None and value.ndim > 1:
            raise NoMatch(f"Add {node.name!r}: the tensor's rank is unknown")
        rank = walk.rank if walk.rank is not None else max(value.ndim, 1)
        if scale_const_per_channel(value, np.ones(walk.channels), walk.axis, rank) is None:
            raise NoMatch(f"Add {node.name!r}: constant of shape {value.shape} is not per channel")
        walk.pair.shifts.append((other, walk.axis, rank))
    elif op == "Flatten" and walk.pooled and int(node.attrs.get("axis", 1)) == 1:
        walk.axis, walk.rank = -1, 2
    else:
        raise NoMatch(f"{op} {node.name!r} is not scale-equivariant (f(x/s) ≠ f(x)/s) or moves channels")
    walk.pair.path.append(node)
    walk.pair.scaled.append((node.outputs[0].name, walk.axis))


def _second(users: list[gs.Node], t: gs.Tensor, walk: _Walk, channels: int) -> list[LinearLayer]:
    out = []
    for user in users:
        try:
            layer = as_linear(user)
        except NoMatch as err:
            raise NoMatch(f"{t.name!r} is read by {user.op} {user.name!r}: {err}") from None
        if user.inputs[0] is not t or sum(1 for x in user.inputs if x is t) != 1:
            raise NoMatch(f"{user.name!r} reads {t.name!r} other than as its data input")
        if walk.axis != (1 if layer.kind == "conv" else -1):
            raise NoMatch(f"{user.op} {user.name!r} reads the channels on another axis")
        w = const_value(layer.weight)  # only its shape: never a float64 copy of a large weight
        assert w is not None  # as_linear checked it
        if layer.in_channels(w) != channels:
            raise NoMatch(f"{user.name!r} has {layer.in_channels(w)} input channels, {channels} expected")
        out.append(layer)
    return out


def find_pair(first: LinearLayer, outputs: set[int], linear: dict[int, bool]) -> Pair:
    """The pair starting at ``first`` (``outputs``: ids of graph outputs; ``linear``: node id → selected)."""
    walk = _Walk(first)
    channels = walk.channels
    t = first.node.outputs[0]
    walk.pair.scaled.append((t.name, walk.axis))
    for _ in range(64):  # paths are short; a bound keeps a pathological graph linear
        users = consumers(t)
        if id(t) in outputs:
            raise (NoSecondLayer if not users else NoMatch)(f"{t.name!r} is a graph output")
        if not users:
            raise NoSecondLayer(f"{t.name!r} is not read by any node")
        if all(id(u) in linear for u in users):
            if not all(linear[id(u)] for u in users):
                raise NoMatch(f"a reader of {t.name!r} is not selected")
            walk.pair.second = _second(users, t, walk, channels)
            return walk.pair
        if len(users) > 1:
            ops = ", ".join(f"{u.op} {u.name!r}" for u in users[:4])
            raise NoMatch(f"{t.name!r} has {len(users)} readers ({ops}), not all Conv/Gemm/MatMul")
        step(users[0], t, walk)
        t = users[0].outputs[0]
    raise NoMatch("path too long")
