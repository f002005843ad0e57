"""Placement: which nodes run on integers and which tensors get one shared QuantizeLinear/DequantizeLinear pair.

The rules follow what onnxruntime's CPU graph optimizer fuses (its QDQ selectors):

- a *unit* is an op with an integer kernel: Conv (+ConvTranspose), Gemm and MatMul (weights quantized, bias int32
  with scale ``input_scale x weight_scale``), Add/Mul, Concat, average pools, LeakyRelu, Sigmoid, Softmax;
  it needs a DequantizeLinear on every input, and all but MatMul/Gemm need their output to go *only* to a
  QuantizeLinear (MatMul/Gemm fuse with a float output too: MatMulIntegerToFloat, QGemm);
- a Relu/Clip that is the only consumer of a unit's output is absorbed: the Q goes after it, and onnxruntime
  drops it (an asymmetric output range starts at 0, so the Q's zero point already clips);
- ``MatMul -> Add(constant bias)`` is one unit: the bias becomes int32 and onnxruntime fuses both into QGemm;
- data-movement ops (Reshape, Transpose, MaxPool, Flatten, Squeeze, Gather, Slice, Split...) join their input
  and outputs into one *group* sharing one scale/zero point, so onnxruntime drops the Q/DQ around them and they
  run on integers;
- a tensor is quantized when a unit reads it or a unit that needs an output Q writes it; then its whole group
  is, each tensor with one Q/DQ pair shared by all its consumers (no float islands between integer ops);
- ``placement: tensorrt`` drops the output rule: a tensor is quantized only where a unit reads it, and float
  readers keep the exact tensor (TensorRT fuses the Q into the producing layer itself).

Everything is computed from the name index in O(N).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qgraph import GraphHandle
from qgraph.quant.qdq_graph import is_qdq

from .config import InsertQDQConfig
from .ops import BINARY, CLIPPING, MOVEMENT, NEEDS_Q_OUT, UNARY, VARIADIC, WEIGHTED
from .tails import integer_fed
from .units import Plan, Unit, UnitKind, is_depthwise, label


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        root = x
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while self.parent.get(x, x) != root:  # path compression
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        self.parent.setdefault(a, a)
        self.parent.setdefault(b, b)
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


class Planner:
    """Computes a `Plan` for the top-level graph (see module docs)."""

    def __init__(
        self,
        graph: GraphHandle,
        config: InsertQDQConfig,
        selected: set[int],
        float_names: set[str],
        forbidden: dict[str, str] | None = None,
        float_nodes: dict[int, str] | None = None,
    ) -> None:
        self.g = graph
        self.cfg = config
        self.selected = selected
        self.floats = float_names
        self.forbidden = dict(forbidden or {})
        self.float_nodes = dict(float_nodes or {})  # id(node) -> why it stays float (decided after calibration)
        self.idx = graph.index
        self.skipped: list[tuple[str, str]] = []

    # ------------------------------------------------------------------ helpers
    def _const(self, t: gs.Tensor) -> np.ndarray | None:
        return None if not t.name else self.g.constant_value(t)

    def _act_ok(self, t: gs.Tensor) -> str | None:
        """Why ``t`` cannot be a quantized activation, or None."""
        if t.name not in self.floats:
            return f"input {t.name!r} is not a float32 tensor"
        prod = self.idx.producer.get(t.name)
        if prod is not None and is_qdq(prod, dynamic=True):
            return "already quantized (an input comes from a Q/DQ node)"
        return None

    def _single_consumer(self, t: gs.Tensor) -> gs.Node | None:
        cons = self.idx.consumers.get(t.name, [])
        if len(cons) != 1 or t.name in self.idx.graph_outputs:
            return None
        return cons[0] if id(cons[0]) in self.selected else None

    # ------------------------------------------------------------------ classification
    def _weighted(self, node: gs.Node) -> Unit | str:
        op, ins = node.op, node.inputs
        consts = [self._const(t) for t in ins[:2]]
        if op == "MatMul":
            if consts[0] is None and consts[1] is None:
                if self.cfg.mode == "dynamic" or not self.cfg.activation_matmuls:
                    return "MatMul of two activations (enable activation_matmuls to quantize it)"
                bad = self._act_ok(ins[0]) or self._act_ok(ins[1])
                return bad or Unit(node, "matmul2", list(dict.fromkeys([ins[0].name, ins[1].name])))
            if consts[0] is not None and consts[1] is not None:
                return "both MatMul inputs are constant: run fold_constants first"
            widx = 1 if consts[1] is not None else 0
        else:
            if consts[1] is None:
                return f"weight input {ins[1].name!r} is not a constant"
            widx = 1
        w = consts[widx]
        assert w is not None
        if w.dtype != np.float32:
            return f"weight {ins[widx].name!r} is {w.dtype}, not float32"
        group = int(node.attrs.get("group", 1))
        if self.cfg.depthwise == "float" and is_depthwise(node, w):
            return (f"depthwise Conv (group {group}) left float (depthwise: float): its per-tensor input scale "
                    "would serve channels of very different ranges")
        x = ins[1 - widx]
        bad = self._act_ok(x)
        if bad:
            return bad
        if op == "Gemm" and self.cfg.mode == "dynamic":
            if int(node.attrs.get("transA", 0)):
                return "Gemm with transA=1 has no dynamic integer form"
            c = ins[2] if len(ins) > 2 and ins[2].name else None
            if c is not None and float(node.attrs.get("beta", 1.0)) != 1.0 and self._const(c) is None:
                return "Gemm with beta != 1 and a computed C has no dynamic integer form"
        unit = Unit(node, "dynamic" if self.cfg.mode == "dynamic" else "weighted", [x.name], widx)
        unit.weight_axis = self._axis(node, widx, w)
        unit.needs_q_out = op in NEEDS_Q_OUT
        if op in ("Conv", "ConvTranspose", "Gemm") and len(ins) > 2 and ins[2].name:
            b = self._const(ins[2])
            n_out = self._out_channels(node, w)
            if b is not None and b.dtype == np.float32 and b.size == n_out and (op != "Gemm" or b.ndim <= 2):
                unit.bias = (node, 2)
        return unit

    def _axis(self, node: gs.Node, widx: int, w: np.ndarray) -> int | None:
        if not self.cfg.weights.per_channel:
            return None
        if node.op == "Conv":
            return 0
        if node.op == "ConvTranspose":
            return 1 if int(node.attrs.get("group", 1)) == 1 else None
        if node.op == "Gemm":
            return 0 if int(node.attrs.get("transB", 0)) else 1
        return 1 if (widx == 1 and w.ndim == 2) else None

    @staticmethod
    def _out_channels(node: gs.Node, w: np.ndarray) -> int:
        if node.op == "Conv":
            return int(w.shape[0])
        if node.op == "ConvTranspose":
            return int(w.shape[1]) * int(node.attrs.get("group", 1))
        return int(w.shape[0] if int(node.attrs.get("transB", 0)) else w.shape[-1])

    def _elementwise(self, node: gs.Node) -> Unit | str:
        acts: list[str] = []
        consts: list[int] = []
        for i, t in enumerate(node.inputs):
            value = self._const(t)
            if value is None:
                bad = self._act_ok(t)
                if bad:
                    return bad
                acts.append(t.name)
            elif value.dtype != np.float32:
                return f"constant input {t.name!r} is {value.dtype}, not float32"
            elif value.size and float(np.max(np.abs(value))) >= self.cfg.outliers.mask_magnitude:
                return f"constant input {t.name!r} holds masking values (|x| >= {self.cfg.outliers.mask_magnitude:g})"
            else:
                consts.append(i)
        if not acts:
            return "all inputs are constant: run fold_constants first"
        kind: UnitKind = "variadic" if node.op in VARIADIC else "binary"  # a two-input Sum is an Add
        return Unit(node, kind, list(dict.fromkeys(acts)), const_inputs=consts, needs_q_out=True)

    def _classify(self, node: gs.Node) -> Unit | str | None:
        op = node.op
        for t in node.inputs:
            prod = self.idx.producer.get(t.name) if t.name else None
            if prod is not None and is_qdq(prod, dynamic=True) and op not in MOVEMENT and op not in CLIPPING:
                return "already quantized (an input comes from a Q/DQ node)"
        if self.cfg.mode == "dynamic":
            if op in ("MatMul", "Gemm"):
                return self._weighted(node)
            if op in MOVEMENT or op in CLIPPING:
                return None
            return f"{op}: dynamic mode quantizes MatMul/Gemm with constant weights only"
        if op in WEIGHTED:
            return self._weighted(node)
        if op in BINARY or op in VARIADIC or (op == "Sum" and len(node.inputs) == 2):
            return self._elementwise(node)
        if op in UNARY:
            bad = self._act_ok(node.inputs[0])
            return bad or Unit(node, "unary", [node.inputs[0].name], needs_q_out=True)
        if op in MOVEMENT or op in CLIPPING:
            return None  # groups / absorption
        return f"{op} has no integer kernel in onnxruntime; left float"

    def _absorb(self, unit: Unit) -> None:
        out = unit.node.outputs[0]
        if unit.kind == "weighted" and unit.node.op == "MatMul" and unit.weight_index == 1 and self.cfg.bias == "int32":
            add = self._single_consumer(out)
            if add is not None and add.op == "Add" and len(add.inputs) == 2:
                other = 1 if add.inputs[0] is out else 0
                b = self._const(add.inputs[other])
                n = int(self.g.constant_value(unit.node.inputs[1]).shape[-1])  # type: ignore[union-attr]
                if b is not None and b.dtype == np.float32 and b.size == n and b.shape and b.shape[-1] == n:
                    unit.bias = (add, other)
                    unit.absorbed.append(add)
                    out = add.outputs[0]
        if unit.kind in ("weighted", "binary"):
            nxt = self._single_consumer(out)
            if (
                nxt is not None
                and nxt.op in CLIPPING
                and all(self._const(t) is not None for t in nxt.inputs[1:] if t.name)
            ):
                unit.absorbed.append(nxt)
                out = nxt.outputs[0]
        unit.output = out.name

    # ------------------------------------------------------------------ the plan
    def plan(self) -> Plan:
        """Classify, absorb, group and propagate demand (one walk each)."""
        units: list[Unit] = []
        absorbed: set[int] = set()
        for node in self.idx.nodes:
            if id(node) not in self.selected or id(node) in absorbed:
                continue
            got = self._classify(node)
            if got is None:
                continue
            if isinstance(got, str):
                self.skipped.append((label(node), got))
                continue
            if got.kind != "dynamic":
                self._absorb(got)
            else:
                got.output = node.outputs[0].name
            absorbed.update(id(n) for n in got.absorbed)
            units.append(got)
        if self.cfg.mode == "dynamic":
            return Plan(units, [], {}, {}, set(), self.skipped)
        uf, members, moving = self._groups()
        kept: list[Unit] = []
        for u in units:
            why = self.float_nodes.get(id(u.node)) or next(
                (self._forbidden(uf, t) for t in u.act_inputs if self._forbidden(uf, t)), None)
            if why:
                self.skipped.append((label(u.node), why))
            else:
                kept.append(u)
        if self.cfg.elementwise != "always":
            kept, tails = integer_fed(kept, lambda t: uf.find(t) if t in uf.parent else t,
                                      on_grid=self.cfg.elementwise == "on_grid")
            self.skipped += [(label(u.node), why) for u, why in tails]
        return self._propagate(kept, uf, members, moving)

    def _forbidden(self, uf: _UnionFind, t: str) -> str | None:
        return self.forbidden.get(t) or self.forbidden.get(uf.find(t))

    def _groups(self) -> tuple[_UnionFind, dict[str, list[str]], dict[str, gs.Node]]:
        uf = _UnionFind()
        moving: dict[str, gs.Node] = {}  # group output tensor -> movement node producing it
        for node in self.idx.nodes:
            if node.op not in MOVEMENT or id(node) not in self.selected or not node.inputs:
                continue
            data = node.inputs[0]
            outs = [t for t in node.outputs if t.name]
            if node.op == "MaxPool" and len(outs) > 1 and self.idx.consumers.get(outs[1].name):
                continue
            if node.op == "MaxPool":
                outs = outs[:1]
            if (
                self._const(data) is not None
                or self._act_ok(data)
                or any(t.name not in self.floats or t.name in self.idx.graph_outputs for t in outs)
            ):
                continue
            for t in outs:
                uf.union(data.name, t.name)
                moving[t.name] = node
        members: dict[str, list[str]] = {}
        for name in list(uf.parent):
            members.setdefault(uf.find(name), []).append(name)
        return uf, members, moving

    def _propagate(
        self, units: list[Unit], uf: _UnionFind, members: dict[str, list[str]], moving: dict[str, gs.Node]
    ) -> Plan:
        demanded: dict[str, None] = {}
        readers: dict[str, set[int]] = {}
        outputs = self.cfg.placement == "onnxruntime"  # tensorrt: Q/DQ on inputs only (config docs)
        for u in units:
            for t in u.act_inputs:
                demanded[t] = None
                readers.setdefault(t, set()).add(id(u.node))
            out = u.output
            if outputs and u.needs_q_out and out and (self.idx.consumers.get(out) or out in self.idx.graph_outputs):
                if out in self.floats and not self._forbidden(uf, out):
                    demanded[out] = None
        tensors: dict[str, str] = {}
        for t in demanded:
            group = members.get(uf.find(t), [t]) if t in uf.parent else [t]
            for m in group:
                if m not in tensors and not self._forbidden(uf, m):
                    tensors[m] = m
        # Roots: the member not written by a grouped movement node; every member shares its parameters.
        for t in tensors:
            root = t
            while root in moving and moving[root].inputs[0].name in tensors:
                root = moving[root].inputs[0].name
            tensors[t] = root
        movement = list({id(n): n for t, n in moving.items() if t in tensors}.values())
        # An integer producer's consumers all read the DQ (onnxruntime fuses the Q only when it is the sole reader);
        # with input-only placement no unit writes integers, so float readers keep the exact tensor.
        producers = {id(u.last) for u in units if outputs} | {id(n) for n in movement}
        for n in movement:
            readers.setdefault(n.inputs[0].name, set()).add(id(n))
        order = {t.name: i for i, t in enumerate(self.g.graph.inputs)}
        offset = len(order)
        for i, node in enumerate(self.idx.nodes):
            for t in node.outputs:
                order.setdefault(t.name, offset + i)
        ordered = dict(sorted(tensors.items(), key=lambda kv: order.get(kv[0], -1)))
        return Plan(units, movement, ordered, readers, producers, self.skipped)
