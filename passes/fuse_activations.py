"""``fuse_activations``: rebuild HardSwish / HardSigmoid that an exporter spelled out as Add/Clip/Mul/Div.

Paddle and older PyTorch exporters write ``hardswish(x) = x * relu6(x + 3) / 6`` as four nodes::

    a = Add(x, 3);  c = Clip(a, 0, 6);  m = Mul(x, c);  y = Div(m, 6)        (or Mul by 1/6, or Div before Mul)

Quantized as written, each of the four outputs gets its own Q/DQ pair: three extra requantizations per activation,
measured as most of the error of a PicoDet detector. Fused, the activation reads one quantized tensor and writes
one. The rewrite is exact up to float rounding: ``HardSwish(x) = x * max(0, min(1, x/6 + 1/2))`` and
``HardSigmoid(x; 1/6, 1/2) = max(0, min(1, x/6 + 1/2))``.

``y = x * c / 6`` becomes ``HardSwish(x)`` (opset 14 and later); ``c / 6`` alone becomes ``HardSigmoid(x)``
(any opset). Below opset 14 a full HardSwish becomes ``Mul(x, HardSigmoid(x))`` (two nodes instead of four).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx_graphsurgeon as gs
from pydantic import Field

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassDetails, PassError, PassResult, get_pass, register
from qgraph.graph import NoMatch, const_value, consumers, is_default_domain, producer, rebuild

__all__ = ["FuseActivations", "FuseActivationsConfig"]

HARDSWISH_OPSET = 14


@dataclass(frozen=True)
class FuseActivationsDetails(PassDetails):
    """How many spelled-out activations `FuseActivations` fused, per kind (``HardSwish``, ``HardSigmoid``)."""

    fused: dict[str, int]


class FuseActivationsConfig(PassConfig):
    """Options of ``fuse_activations``."""

    hardswish: bool = Field(default=True, description="Fuse x * Clip(x + 3, 0, 6) / 6 into HardSwish.")
    hardsigmoid: bool = Field(default=True, description="Fuse Clip(x + 3, 0, 6) / 6 into HardSigmoid.")
    opset: Literal["raise", "keep"] = Field(
        default="raise",
        description="HardSwish needs opset 14: raise an older model's opset (a reported decision) when it has a "
        "HardSwish to fuse; keep: write Mul(x, HardSigmoid(x)) instead.")


def _scalar(t: gs.Tensor) -> float | None:
    value = const_value(t)
    if value is None or value.size != 1 or value.dtype.kind != "f":
        return None
    return float(value.reshape(-1)[0])


def _only_consumer(t: gs.Tensor, graph: GraphHandle) -> gs.Node:
    users = consumers(t)
    if len(users) != 1 or graph.is_graph_output(t):
        raise NoMatch(f"{t.name} has {len(users)} consumers or is a graph output")
    return users[0]


def _clip_bounds(clip: gs.Node) -> tuple[float | None, float | None]:
    if len(clip.inputs) > 1:  # opset >= 11: bounds are inputs
        lo = _scalar(clip.inputs[1]) if clip.inputs[1].name else None
        hi = _scalar(clip.inputs[2]) if len(clip.inputs) > 2 and clip.inputs[2].name else None
        return lo, hi
    return clip.attrs.get("min"), clip.attrs.get("max")


def _divides_by_six(node: gs.Node, data: gs.Tensor) -> bool:
    other = [t for t in node.inputs if t is not data]
    if len(other) != 1 or (node.inputs[0] is not data and node.op == "Div"):
        return False
    k = _scalar(other[0])
    return k is not None and ((node.op == "Div" and k == 6.0) or (node.op == "Mul" and abs(k * 6.0 - 1.0) < 1e-6))


class _Match:
    """One matched spelled-out activation: its input, output, the nodes it replaces, and its kind."""

    def __init__(self, x: gs.Tensor, y: gs.Tensor, nodes: list[gs.Node], kind: str) -> None:
        self.x, self.y, self.nodes, self.kind = x, y, nodes, kind


def match(clip: gs.Node, graph: GraphHandle) -> _Match:
    """The HardSwish/HardSigmoid spelled out around ``clip``; `NoMatch` with the reason otherwise."""
    if _clip_bounds(clip) != (0.0, 6.0):
        raise NoMatch("Clip bounds are not (0, 6)")
    add = producer(clip.inputs[0])
    if add is None or add.op != "Add" or not is_default_domain(add.domain) or len(add.inputs) != 2:
        raise NoMatch("Clip's input is not an Add")
    three = [i for i, t in enumerate(add.inputs) if _scalar(t) == 3.0]
    if not three:
        raise NoMatch("the Add does not add 3")
    x = add.inputs[1 - three[0]]
    _only_consumer(add.outputs[0], graph)
    nxt = _only_consumer(clip.outputs[0], graph)
    if nxt.op in ("Div", "Mul") and _divides_by_six(nxt, clip.outputs[0]):  # c / 6 first
        sig = nxt
        users = consumers(sig.outputs[0])
        if (len(users) == 1 and users[0].op == "Mul" and not graph.is_graph_output(sig.outputs[0])
                and {id(t) for t in users[0].inputs} == {id(x), id(sig.outputs[0])}):
            return _Match(x, users[0].outputs[0], [add, clip, sig, users[0]], "HardSwish")
        return _Match(x, sig.outputs[0], [add, clip, sig], "HardSigmoid")
    if nxt.op == "Mul" and {id(t) for t in nxt.inputs} == {id(x), id(clip.outputs[0])}:
        div = _only_consumer(nxt.outputs[0], graph)
        if div.op in ("Div", "Mul") and _divides_by_six(div, nxt.outputs[0]):
            return _Match(x, div.outputs[0], [add, clip, nxt, div], "HardSwish")
    raise NoMatch("Clip(x + 3, 0, 6) is not followed by / 6")


@register
class FuseActivations(Pass[FuseActivationsConfig]):
    """Fuse spelled-out HardSwish (x * Clip(x + 3, 0, 6) / 6) and HardSigmoid (Clip(x + 3, 0, 6) / 6) into one op.

    Fewer tensors to quantize: a spelled-out HardSwish costs four Q/DQ pairs, a fused one none of its own (it
    runs in float between the Q/DQ of its input and output). Exact up to float rounding. HardSwish needs opset
    14; on older models it becomes Mul(x, HardSigmoid(x)).
    """

    name = "fuse_activations"
    config_class = FuseActivationsConfig
    preserves_float = True

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Match around every Clip of the top graph, replace each match by one (or two) nodes."""
        res = PassResult()
        self._reach_opset(graph, ctx, res)
        replacements: dict[int, list[gs.Node]] = {}
        removed: list[gs.Node] = []
        taken: set[int] = set()
        counts = {"HardSwish": 0, "HardSigmoid": 0}
        for clip in list(graph.index.nodes):
            if clip.op != "Clip" or not is_default_domain(clip.domain):
                continue
            try:
                found = match(clip, graph)
            except NoMatch:
                continue
            if any(id(n) in taken for n in found.nodes):
                continue
            res.matched += 1
            if found.kind == "HardSwish" and not self.config.hardswish:
                res.skip(clip.name, "hardswish: false")
                continue
            if found.kind == "HardSigmoid" and not self.config.hardsigmoid:
                res.skip(clip.name, "hardsigmoid: false")
                continue
            new = self._replacement(graph, found)
            taken.update(id(n) for n in found.nodes)
            replacements[id(found.nodes[-1])] = new
            removed += found.nodes[:-1]
            counts[found.kind] += 1
            res.rewritten += 1
        if replacements:
            rebuild(graph.graph, removed, replacements)
            graph.changed()
        res.details = FuseActivationsDetails(fused=counts)
        if graph.opset < HARDSWISH_OPSET and counts["HardSwish"]:
            res.decisions.append(f"opset {graph.opset} < {HARDSWISH_OPSET}: {counts['HardSwish']} HardSwish written "
                                 "as Mul(x, HardSigmoid(x)) (raise the opset first for the single op)")
        return res

    def _reach_opset(self, graph: GraphHandle, ctx: PassContext, res: PassResult) -> None:
        """Raise the opset to 14 when a HardSwish will be fused and the options allow it (one cheap scan first)."""
        if self.config.opset == "keep" or not self.config.hardswish or graph.opset >= HARDSWISH_OPSET:
            return
        wanted = False
        for clip in graph.index.nodes:
            if clip.op == "Clip" and is_default_domain(clip.domain):
                try:
                    wanted = match(clip, graph).kind == "HardSwish"
                except NoMatch:
                    continue
                if wanted:
                    break
        if not wanted:
            return
        before = graph.opset
        try:
            ctx.run_pass(get_pass("raise_opset")(opset=HARDSWISH_OPSET), graph)
        except PassError as exc:
            res.decisions.append(f"opset {before} kept (raising to {HARDSWISH_OPSET} failed: "
                                 f"{exc.message.splitlines()[0]})")
            return
        graph.changed()
        res.decisions.append(f"opset raised {before} -> {HARDSWISH_OPSET} for HardSwish (set `opset: keep` to write "
                             "Mul(x, HardSigmoid(x)) instead)")

    @staticmethod
    def _replacement(graph: GraphHandle, found: _Match) -> list[gs.Node]:
        base = found.nodes[1].name or found.y.name
        y = found.y
        attrs = {"alpha": np.float32(1.0 / 6.0).item(), "beta": 0.5}
        if found.kind == "HardSigmoid":
            return [gs.Node("HardSigmoid", graph.unique_name(f"{base}/hardsigmoid", "node"), attrs=attrs,
                            inputs=[found.x], outputs=[y])]
        if graph.opset >= HARDSWISH_OPSET:
            return [gs.Node("HardSwish", graph.unique_name(f"{base}/hardswish", "node"), inputs=[found.x],
                            outputs=[y])]
        gate = gs.Variable(graph.unique_name(f"{base}/hardsigmoid_output", "tensor"), dtype=y.dtype)
        return [gs.Node("HardSigmoid", graph.unique_name(f"{base}/hardsigmoid", "node"), attrs=attrs,
                        inputs=[found.x], outputs=[gate]),
                gs.Node("Mul", graph.unique_name(f"{base}/hardswish", "node"), inputs=[found.x, gate], outputs=[y])]
