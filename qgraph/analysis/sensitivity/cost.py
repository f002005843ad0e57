"""What falling nodes back to float costs in latency, and the ranking that buys output error cheapest.

Latency model of a QDQ model with a set ``S`` of its quantized nodes in float (units: µs, on the target runtime,
from a per-preset cost table, `qgraph.runtime.latency.LatencyTable`). Every compute node ``n`` (Q/DQ nodes are not
nodes here) is *int8* when it is quantized and not in ``S``, else *float*; it costs the table's int8 or float
time of its `op_signature`, ``work × median over the table's entries of that kind of (time / work)`` (a per-kind
rate: robust to single entries measured on a loaded machine; 0 when the table has no such kind, so only its
conversions count then). Shapes are those of one sample (``input_shapes``). Every float
tensor ``x`` (what a Q/DQ pair quantizes, seen through any ``DQ → Q → DQ`` chain) with producer ``p`` costs a
conversion at each float/int8 boundary:

    c_x(S) = q_x · [p float ∧ some int8 node reads x] + dq_x · [p int8 ∧ (some float node reads x ∨ x is an output)]

with ``q_x``, ``dq_x`` the table's per-element QuantizeLinear/DequantizeLinear cost times ``|x|``. The model's
time is ``T(S) = Σ_n t_n(label) + Σ_x c_x(S)``. The added time of one more node,
``Δ(n | S) = T(S ∪ {n}) - T(S)``, touches only the tensors ``n`` reads or writes, so it is O(degree): a node
kept float between float neighbours removes conversions (``Δ`` can be negative), an isolated one adds a DQ on
each input and a Q on its output.

Ranking (`cost_aware_order`), the same greedy as `NoiseModel.order` with a price: take the output ``o`` whose
predicted SQNR is lowest, then the node with the largest gain per added time
``κ_n,o η_n / (max(Δ(n | S), 0) + δ)`` among the nodes reaching ``o`` (``δ``: 5% of the mean positive ``Δ``
of a single node, so free nodes come first but not regardless of their gain), update the sums, repeat. Each
output keeps a lazy max-heap; picking a node re-prices only its neighbours (``Δ`` changes nowhere else), so the
order costs O((N + E) · outputs · log N).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from qgraph.analysis.sensitivity.noise import NoiseModel
from qgraph.analysis.sensitivity.targets import Target
from qgraph.graph import GraphHandle, tensor_shape
from qgraph.quant.qdq_graph import is_dq, is_qdq, pair_q, quantized_nodes
from qgraph.runtime.latency import LatencyTable, op_signature

#: Share of the mean positive added time of one node that prices a free node (see module docs).
FREE_PRICE = 0.05


@dataclass
class _Tensor:
    producer: int  # node index, -1 for graph inputs and constants
    q_us: float
    dq_us: float
    output: bool = False
    int8_readers: int = 0
    float_readers: int = 0


@dataclass
class _Node:
    name: str
    float_us: float
    int8_us: float
    tensors: list[int] = field(default_factory=list)  # inputs then outputs (deduplicated)
    inputs: list[int] = field(default_factory=list)  # float tensors read (with repetition)
    known: bool = True


class LatencyModel:
    """Modelled latency of a QDQ model with any set of its quantized nodes in float (see module docs)."""

    def __init__(self, qdq: onnx.ModelProto, table: LatencyTable, preset: str,
                 input_shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        handle = GraphHandle(qdq)
        if input_shapes:  # one sample's shapes: drop the stored (batch-symbolic) ones so inference redoes them
            inputs = {t.name for t in handle.graph.inputs}
            for t in handle.graph.tensors().values():
                if isinstance(t, gs.Variable) and t.name not in inputs:
                    t.shape = None
            for t in handle.graph.inputs:
                if t.name in input_shapes:
                    t.shape = list(input_shapes[t.name])
            handle.changed()
        shapes = handle.shapes()
        costs = table.presets[preset]
        rates = kind_rates(table, preset)
        quantized = {id(n) for n in quantized_nodes(handle)}
        self.nodes: list[_Node] = []
        self.tensors: list[_Tensor] = []
        self.int8: list[bool] = []
        self.unknown = 0
        tid: dict[str, int] = {}
        compute = [n for n in handle.index.nodes if not is_qdq(n)]
        index = {id(n): i for i, n in enumerate(compute)}

        def tensor(t: gs.Tensor) -> int:
            if t.name not in tid:
                elems = _elements(tensor_shape(t, shapes))
                prod = handle.producer(t)
                tid[t.name] = len(self.tensors)
                self.tensors.append(_Tensor(index.get(id(prod), -1) if prod is not None else -1,
                                            costs.quantize_ns * elems / 1e3, costs.dequantize_ns * elems / 1e3))
            return tid[t.name]

        for n in compute:
            sig = op_signature(n.op, n.attrs, tensor_shape(n.outputs[0], shapes) if n.outputs else None,
                               _weight_shape(handle, n))
            rate = rates.get(sig[0]) if sig is not None else None
            est = (rate[0] * sig[2], rate[1] * sig[2]) if rate is not None and sig is not None else None
            node = _Node(n.name, est[0] if est else 0.0, est[1] if est else 0.0, known=est is not None)
            self.unknown += est is None
            for t in n.inputs:
                x = _float_tensor(handle, t)
                if x is not None:
                    node.inputs.append(tensor(x))
            outs = [tensor(t) for t in n.outputs]
            node.tensors = list(dict.fromkeys([*node.inputs, *outs]))
            self.nodes.append(node)
            self.int8.append(id(n) in quantized)
        for out in handle.graph.outputs:
            x = _float_tensor(handle, out)
            if x is not None:
                self.tensors[tensor(x)].output = True
        for i, node in enumerate(self.nodes):
            for x in node.inputs:
                self._count(x, self.int8[i], +1)
        self.by_name = {n.name: i for i, n in enumerate(self.nodes) if n.name}
        handle.release()

    # ------------------------------------------------------------------ state
    def _count(self, x: int, int8: bool, step: int) -> None:
        t = self.tensors[x]
        if int8:
            t.int8_readers += step
        else:
            t.float_readers += step

    def _conversion(self, x: int) -> float:
        t = self.tensors[x]
        p_int8 = t.producer >= 0 and self.int8[t.producer]
        if p_int8:
            return t.dq_us if (t.float_readers > 0 or t.output) else 0.0
        return t.q_us if t.int8_readers > 0 else 0.0

    def _local(self, i: int) -> float:
        node = self.nodes[i]
        own = node.int8_us if self.int8[i] else node.float_us
        return own + sum(self._conversion(x) for x in node.tensors)

    def _flip(self, i: int, int8: bool) -> None:
        for x in self.nodes[i].inputs:
            self._count(x, self.int8[i], -1)
            self._count(x, int8, +1)
        self.int8[i] = int8

    def delta(self, name: str) -> float:
        """Added time (µs) of also keeping ``name`` float, given the nodes already float (0: already float)."""
        i = self.by_name.get(name)
        if i is None or not self.int8[i]:
            return 0.0
        before = self._local(i)
        self._flip(i, False)
        after = self._local(i)
        self._flip(i, True)
        return after - before

    def set_float(self, name: str) -> None:
        """Keep ``name`` float from now on."""
        i = self.by_name.get(name)
        if i is not None:
            self._flip(i, False)

    def neighbours(self, name: str) -> set[str]:
        """Nodes whose added time changes when ``name`` goes float (readers and producers of its tensors)."""
        i = self.by_name.get(name)
        if i is None:
            return set()
        touched = set(self.nodes[i].tensors)
        out = {self.nodes[t.producer].name for x in touched if (t := self.tensors[x]).producer >= 0}
        return out | self._readers(touched)

    def _readers(self, tensors: set[int]) -> set[str]:
        if not hasattr(self, "_reader_index"):
            self._reader_index: dict[int, list[int]] = {}
            for j, node in enumerate(self.nodes):
                for x in set(node.inputs):
                    self._reader_index.setdefault(x, []).append(j)
        return {self.nodes[j].name for x in tensors for j in self._reader_index.get(x, [])}

    def total(self) -> float:
        """Modelled time (µs) of the current state."""
        own = sum(n.int8_us if q else n.float_us for n, q in zip(self.nodes, self.int8, strict=True))
        return own + sum(self._conversion(x) for x in range(len(self.tensors)))

    def snapshot(self) -> tuple[list[bool], list[tuple[int, int]]]:
        """The current labels and reader counts, for `restore`."""
        return list(self.int8), [(t.int8_readers, t.float_readers) for t in self.tensors]

    def restore(self, state: tuple[list[bool], list[tuple[int, int]]]) -> None:
        """Go back to a `snapshot`."""
        self.int8 = list(state[0])
        for t, (a, b) in zip(self.tensors, state[1], strict=True):
            t.int8_readers, t.float_readers = a, b

    def predict(self, floats: Iterable[str]) -> float:
        """Modelled time (µs) with ``floats`` also kept float; the state is left as it was."""
        state = self.snapshot()
        for name in floats:
            self.set_float(name)
        try:
            return self.total()
        finally:
            self.restore(state)

    def all_float(self) -> float:
        """Modelled time (µs) of the float model (every node float, no conversion)."""
        return sum(n.float_us for n in self.nodes)


def _elements(shape: Sequence[int | str | None] | None) -> int:
    """Elements of a fully known shape, else 0 (no conversion cost is charged then)."""
    n = 1
    for d in shape or [0]:
        if not isinstance(d, int):
            return 0
        n *= d
    return n


def kind_rates(table: LatencyTable, preset: str) -> dict[str, tuple[float, float]]:
    """Per op kind of ``preset``: median float and int8 µs per unit of work over the table's entries."""
    per: dict[str, list[tuple[float, float]]] = {}
    for e in table.presets[preset].entries:
        per.setdefault(e.kind, []).append((e.float_us / e.work, e.int8_us / e.work))
    return {k: (float(np.median([f for f, _ in v])), float(np.median([q for _, q in v]))) for k, v in per.items()}


def _weight_shape(handle: GraphHandle, node: gs.Node) -> tuple[int, ...] | None:
    """Shape of the constant weight (input 1) of a Conv/Gemm/MatMul, read through its DequantizeLinear."""
    if node.op not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or len(node.inputs) < 2:
        return None
    w = node.inputs[1]
    prod = handle.producer(w)
    if prod is not None and is_dq(prod):
        w = prod.inputs[0]
    value = handle.constant_value(w)
    return None if value is None else tuple(value.shape)


def _float_tensor(handle: GraphHandle, t: gs.Tensor) -> gs.Tensor | None:
    """The activation behind ``t`` (through ``DQ → Q`` chains); None for constants and weights."""
    for _ in range(16):
        if isinstance(t, gs.Constant) or handle.constant_value(t) is not None:
            return None
        dq = handle.producer(t)
        if dq is None or not is_dq(dq):
            return t
        q = pair_q(handle, dq)
        if q is None:
            return None  # an integer constant or input: no float activation behind it
        t = q.inputs[0]
    return t


def cost_aware_order(noise: NoiseModel, latency: LatencyModel) -> list[str]:
    """Every node of ``noise``, in the order that buys the worst output's noise cheapest (see module docs)."""
    names = list(noise.eta)
    first = {n: latency.delta(n) for n in names}
    positive = [d for d in first.values() if d > 0]
    price = FREE_PRICE * (sum(positive) / len(positive)) if positive else 1.0
    version = dict.fromkeys(names, 0)
    heaps: dict[int, list[tuple[float, str, int]]] = {o: [] for o in noise.outputs}

    def push(name: str, added: float) -> None:
        for o in noise.bits[name]:
            gain = noise.contrib[name][o]
            if gain > 0:
                heapq.heappush(heaps[o], (-gain / (max(added, 0.0) + price), name, version[name]))

    for n in names:
        push(n, first[n])
    chosen: set[str] = set()
    out: list[str] = []
    rem = list(noise.total)
    state = latency.snapshot()
    sqnr = Target("sqnr", "sqnr")
    while True:
        worst, worst_score = None, math.inf
        for o in noise.outputs:
            heap = heaps[o]
            while heap and (heap[0][1] in chosen or heap[0][2] != version[heap[0][1]]):
                heapq.heappop(heap)
            if heap:
                s = noise._output_score(sqnr, o, rem[o])
                if worst is None or s < worst_score:
                    worst, worst_score = o, s
        if worst is None:
            break
        name = heapq.heappop(heaps[worst])[1]
        chosen.add(name)
        out.append(name)
        for o in noise.bits[name]:
            rem[o] -= noise.contrib[name][o]
        latency.set_float(name)
        for other in latency.neighbours(name):
            if other in version and other not in chosen:
                version[other] += 1
                push(other, latency.delta(other))
    latency.restore(state)
    by_eta = sorted(names, key=lambda n: -noise.eta[n])
    return out + [n for n in by_eta if n not in chosen]


def prefix_latency(latency: LatencyModel, order: Sequence[str]) -> list[float]:
    """Modelled time (µs) with the first ``m`` nodes of ``order`` float, m = 0 .. len(order): O(N + E) in all."""
    state = latency.snapshot()
    total = latency.total()
    out = [total]
    for name in order:
        total += latency.delta(name)
        latency.set_float(name)
        out.append(total)
    latency.restore(state)
    return out


@dataclass(frozen=True)
class CostSpec:
    """Where the latency ranking reads its costs: a cost table and the preset whose entries apply."""

    table: LatencyTable
    preset: str


def latency_summary(latency: LatencyModel, base: Sequence[str], chosen: Sequence[str]) -> dict[str, float]:
    """Modelled µs of the INT8 model (``base`` float), the chosen model and the float model, and the ratios."""
    int8, mine, flt = latency.predict(base), latency.predict(chosen), latency.all_float()
    return {"modelled_int8_us": round(int8, 1), "modelled_chosen_us": round(mine, 1),
            "modelled_float_us": round(flt, 1), "modelled_int8_ratio": round(int8 / flt, 3) if flt > 0 else math.nan,
            "modelled_chosen_ratio": round(mine / flt, 3) if flt > 0 else math.nan}


def measure_latency(models: Mapping[str, onnx.ModelProto], feed: Mapping[str, np.ndarray], rounds: int = 5,
                    threads: int = 2, budget_seconds: float = 20.0) -> dict[str, float]:
    """Time of each model relative to the first (``label -> ratio``, plus ``label_ms``) on onnxruntime
    (``ORT_ENABLE_ALL``, ``threads`` threads, one sample), by `qgraph.runtime.latency.time_models`: models take
    turns of about 150 ms, the first two runs of every turn not counted, at least 3 and at most ``rounds`` rounds,
    none started after ``budget_seconds``. (Counting the runs right after another session ran, as this did before,
    read YOLOv8n's INT8 model at 0.48-0.97x float where its steady state is 0.6-0.7x.)"""
    from qgraph.runtime.latency import time_models

    ms = time_models(dict(models), feed, rounds=rounds, threads=threads, budget_seconds=budget_seconds)
    first = ms[next(iter(models))]
    out: dict[str, float] = {}
    for label, value in ms.items():
        out[label] = round(value / first, 3) if first > 0 else math.nan
        out[f"{label}_ms"] = round(value, 2)
    return out
