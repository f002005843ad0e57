"""Local quantization error of every quantized node from one paired run of the float and the QDQ model.

For each quantized node ``n`` of a QDQ model, the *probe* model computes, in the same onnxruntime run:

- ``y = n(x)``, the node as it runs in the float model ``F`` (the QDQ model with every quantized node fallen
  back, `qgraph.remedy.fallback.fall_back`: the float tensors keep their names, so ``x`` are F's inputs to ``n``);
- ``ŷ = n(DQ(Q(x)), DQ(w_q))``, a copy of ``n`` fed the *same float inputs* through the QDQ model's own Q/DQ
  chains (activation pairs, weight pairs or stored integer weights; pairs that quantize ``n``'s output on its
  way to a graph output are applied too);
- the scalars ``err_n = Σ (ŷ - y)²`` and ``sig_n = Σ y²``, reduced inside onnxruntime right after ``n``, so
  every copy and difference is freed as soon as it is reduced and memory stays near one inference of ``F``.

The local noise ratio ``η_n = err_n / sig_n`` (local SQNR ``-10 log10 η_n``) is the relative error ``n``
injects when everything upstream is exact. Cost: one session and one pass over the evaluation data, whatever
the number of nodes; per node, a constant number of extra graph nodes.

`output_weights` gives, for every node, how much of its relative error reaches each scored part of the graph
outputs (one reverse walk, with the signal power of the inputs and outputs of merging ops measured in the same
run): a part of an output that a final Concat joins (`qgraph.runtime.output_parts`) starts at the Concat's input, so the
boxes' signal does not dilute the error of the scores written beside them.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from qgraph.analysis.sensitivity import probe_parts
from qgraph.analysis.sensitivity.probe_dynamic import copy_nodes, unit_copy, unit_nodes
from qgraph.data import Feed
from qgraph.graph import GraphHandle, ProtoNames, model_names
from qgraph.io.model_io import save_model
from qgraph.quant.qdq import is_dequantize, is_quantize, pairs_reading
from qgraph.remedy.apply import fall_back_all
from qgraph.runtime.compare import make_session, session_run
from qgraph.runtime.output_parts import OutputParts

#: Free namespaces (`qgraph.graph.ProtoNames.prefix`) for: node and chain copies, copies of a node's own output
#: pairs (the same Q may also start a chain), reductions (apart, so a copied ``0/0/err`` cannot meet one).
COPY_STEM, OUT_STEM, SUM_STEM = "qgraph_local", "qgraph_local_out", "qgraph_local_sum"
UNIT_STEM = "qgraph_local_unit"  # copies of dynamically quantized MatMul units (`probe_dynamic`)
#: Ops where branches merge: a branch's relative error is diluted by the other inputs' signal (`output_weights`).
MERGE_OPS = frozenset({"Add", "Sub", "Sum", "Concat"})
StepProgress = Callable[[int, int | None], None]


@dataclass
class LocalError:
    """One node's local error: ``Σ(ŷ - y)²`` and ``Σy²`` over every output and sample, and its outputs reached."""

    name: str
    err: float = 0.0
    sig: float = 0.0
    weights: list[float] = field(default_factory=list)  # κ per scored output part (`output_weights`); 0: unreached

    @property
    def reach(self) -> int:
        """Bit mask of the graph outputs this node can change."""
        return sum(1 << o for o, k in enumerate(self.weights) if k > 0)

    @property
    def eta(self) -> float:
        """Local noise ratio ``err / sig`` (inf for noise on a zero signal or a non-finite copy)."""
        if math.isnan(self.err) or math.isinf(self.err):
            return math.inf
        if self.sig <= 0:
            return 0.0 if self.err == 0 else math.inf
        return self.err / self.sig

    @property
    def sqnr_db(self) -> float:
        """Local SQNR in dB, ``-10 log10 η``."""
        eta = self.eta
        return math.inf if eta == 0 else (-math.inf if math.isinf(eta) else -10.0 * math.log10(eta))


@dataclass
class Probe:
    """The probe model and the reduction outputs per node (``(err, sig)`` names, one pair per node output)."""

    model: onnx.ModelProto
    outputs: dict[str, list[tuple[str, str]]]
    skipped: dict[str, str]  # node -> why it has no local measure
    powers: dict[str, str]  # tensor -> output holding Σ t² (inputs and outputs of merging ops)
    #: node -> (scored unit, Σ err output, Σ sig output) per part of a split graph output it writes
    parts: dict[str, list[probe_parts.PartReduction]] = field(default_factory=dict)
    copies: str = COPY_STEM + "/"  # the namespace of the quantized copies (not the float model's nodes)


def float_model(qdq: onnx.ModelProto) -> onnx.ModelProto:
    """``qdq`` with every quantized node (dynamic ones too) fallen back: the float model whose tensors keep the QDQ
    model's names."""
    handle = GraphHandle(qdq)
    fall_back_all(handle)
    try:
        return handle.to_onnx()
    finally:
        handle.release()


def build_probe(qdq: onnx.ModelProto, names: Sequence[str], parts: OutputParts | None = None) -> Probe:
    """The float model plus, right after each node of ``names``, its quantized copy and the two reductions (and
    per part of a split graph output it writes, `qgraph.analysis.sensitivity.probe_parts`)."""
    f = float_model(qdq)
    g = qdq.graph
    producer = {o: n for n in g.node for o in n.output if o}
    inits = {t.name: t for t in g.initializer}
    graph_outputs = {o.name for o in g.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    by_name = {n.name: n for n in g.node}
    available = {t.name for t in f.graph.initializer} | {i.name for i in f.graph.input}
    available |= {o for n in f.graph.node for o in n.output}
    names_in_use = ProtoNames(chain(model_names(qdq), model_names(f)))
    ctx = _Builder(producer, inits, available, names_in_use.prefix(COPY_STEM), names_in_use.prefix(OUT_STEM))
    sums, unit_space = names_in_use.prefix(SUM_STEM), names_in_use.prefix(UNIT_STEM)
    groups: dict[str, list[onnx.NodeProto]] = {}
    outputs: dict[str, list[tuple[str, str]]] = {}
    skipped: dict[str, str] = {}
    position = {n.name: i for i, n in enumerate(f.graph.node)}
    by_output, per_part = probe_parts.cuts(parts), {}
    units = unit_nodes(qdq)  # dynamically quantized MatMuls (`probe_dynamic`)
    # In the float model's order, so a Q/DQ copy shared by several nodes sits before every one of them.
    for k, name in enumerate(sorted(names, key=lambda n: position.get(n, -1))):
        node = by_name.get(name)
        if (node is None and name not in units) or name not in position:
            skipped[name] = "not in the QDQ model"
            continue
        chains = dict(ctx.chains)
        try:
            if name in units:
                nodes, pairs = unit_copy(units[name], f"{unit_space}{k}/", ctx.need)
            else:
                assert node is not None
                nodes, pairs = ctx.node_copy(node, consumers, graph_outputs)
        except _NoProbe as why:
            ctx.chains = chains  # copies made for this node are dropped with it
            skipped[name] = str(why)
            continue
        reductions, names_out = _reductions(f"{sums}{k}/", pairs)
        sliced, consts, per_part[name] = probe_parts.part_reductions(f"{sums}{k}/", pairs, by_output)
        ctx.initializers += consts
        groups[name] = nodes + reductions + sliced
        outputs[name] = names_out
    ordered: list[onnx.NodeProto] = list(ctx.constants)
    powers: dict[str, str] = {}
    for node in f.graph.node:
        ordered.append(node)
        ordered.extend(groups.pop(node.name, []))
        if node.op_type in MERGE_OPS and node.domain in ("", "ai.onnx"):
            for t in [*node.input, *node.output]:
                if t and t not in powers:
                    powers[t] = f"{sums}power/{len(powers)}"
                    ordered += [helper.make_node("Cast", [t], [powers[t] + "/f"], to=TensorProto.FLOAT),
                                helper.make_node("ReduceSumSquare", [powers[t] + "/f"], [powers[t]], keepdims=0)]
    del f.graph.node[:]
    f.graph.node.extend(ordered)
    f.graph.initializer.extend(ctx.initializers)
    fetch = [t for pairs in outputs.values() for pair in pairs for t in pair] + list(powers.values())
    fetch += [t for cuts in per_part.values() for _, *sums in cuts for t in sums]
    f.graph.output.extend(helper.make_value_info(t, onnx.TypeProto()) for t in fetch)
    return Probe(f, outputs, skipped, powers, {n: c for n, c in per_part.items() if c}, ctx.prefix)


class _NoProbe(Exception):
    """A node whose quantized copy cannot be fed the float model's tensors."""


class _Builder:
    """Copies Q/DQ chains (once per DQ output, shared by the nodes reading it) and nodes into the probe."""

    def __init__(self, producer: dict[str, onnx.NodeProto], inits: dict[str, TensorProto], available: set[str],
                 prefix: str, out_prefix: str):
        self.producer, self.inits, self.available = producer, inits, available
        self.prefix, self.out_prefix = prefix, out_prefix  # free namespaces (`ProtoNames.prefix`)
        self.chains: dict[str, str] = {}  # DQ output -> the copy's output name
        self.constants: list[onnx.NodeProto] = []  # Constant nodes the float model dropped
        self.initializers: list[TensorProto] = []  # initializers the float model dropped (scales, codes)

    def need(self, tensor: str) -> None:
        """Make ``tensor`` (a constant of the QDQ model) available in the probe."""
        if not tensor or tensor in self.available:
            return
        if tensor in self.inits:
            self.initializers.append(self.inits[tensor])
        elif (p := self.producer.get(tensor)) is not None and p.op_type == "Constant":
            self.constants.append(p)
        else:
            raise _NoProbe(f"{tensor!r} is not in the float model")
        self.available.add(tensor)

    def chain(self, tensor: str, emitted: list[onnx.NodeProto]) -> str:
        """The copy of the Q/DQ chain producing ``tensor``, fed the float model's tensor behind it."""
        if tensor in self.chains:
            return self.chains[tensor]
        links: list[onnx.NodeProto] = []
        current = tensor
        for _ in range(64):
            p = self.producer.get(current)
            if p is None or not is_dequantize(p.op_type, p.domain):
                break
            links.append(p)
            q = self.producer.get(p.input[0])
            if q is None or q.op_type == "Constant":
                break  # stored integer weights
            if not is_quantize(q.op_type, q.domain):
                raise _NoProbe(f"{p.name!r} dequantizes the output of {q.op_type} {q.name!r}")
            links.append(q)
            current = q.input[0]
        copies, renamed = copy_nodes(list(reversed(links)), self.prefix, self.need)
        emitted.extend(copies)
        self.chains[tensor] = renamed.get(tensor, tensor)
        return self.chains[tensor]

    def node_copy(self, node: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]],
                  graph_outputs: set[str]) -> tuple[list[onnx.NodeProto], list[tuple[str, str]]]:
        """Nodes computing ``ŷ`` and the ``(ŷ, y)`` tensor pairs to compare."""
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise _NoProbe("it has subgraphs")
        emitted: list[onnx.NodeProto] = []
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = self.prefix + node.name
        for i, t in enumerate(node.input):
            p = self.producer.get(t)
            if p is not None and is_dequantize(p.op_type, p.domain):
                copy.input[i] = self.chain(t, emitted)
            elif t and t not in self.available:
                raise _NoProbe(f"its input {t!r} is not in the float model")
        pairs: list[tuple[str, str]] = []
        tail: list[onnx.NodeProto] = []
        for i, y in enumerate(node.output):
            if not y:
                continue
            copy.output[i] = self.prefix + y
            pairs.append(self._output_pair(y, copy.output[i], consumers, graph_outputs, tail))
        return [*emitted, copy, *tail], pairs

    def _output_pair(self, y: str, y_copy: str, consumers: dict[str, list[onnx.NodeProto]],
                     graph_outputs: set[str], tail: list[onnx.NodeProto]) -> tuple[str, str]:
        """``(ŷ, y)``; when ``y`` reaches a graph output through its own ``Q → DQ``, both sides at that output."""
        for q, dq in pairs_reading(y, consumers):
            if dq.output[0] in graph_outputs:
                qc, dqc = onnx.NodeProto(), onnx.NodeProto()
                qc.CopyFrom(q)
                dqc.CopyFrom(dq)
                out = self.out_prefix
                qc.name, dqc.name = out + q.name, out + dq.name
                qc.input[0], qc.output[0] = y_copy, out + q.output[0]
                dqc.input[0], dqc.output[0] = qc.output[0], out + dq.output[0]
                for t in [*qc.input[1:], *dqc.input[1:]]:
                    self.need(t)
                tail.extend([qc, dqc])
                return dqc.output[0], dq.output[0]
        return y_copy, y


def _reductions(p: str, pairs: list[tuple[str, str]]) -> tuple[list[onnx.NodeProto], list[tuple[str, str]]]:
    """``Σ(ŷ - y)²`` and ``Σy²`` (in float32: float16 sums of squares overflow) per compared pair."""
    nodes: list[onnx.NodeProto] = []
    names = []
    for j, (cand, ref) in enumerate(pairs):
        q = f"{p}{j}/"
        nodes += [
            helper.make_node("Cast", [cand], [q + "c"], to=TensorProto.FLOAT),
            helper.make_node("Cast", [ref], [q + "r"], to=TensorProto.FLOAT),
            helper.make_node("Sub", [q + "c", q + "r"], [q + "e"]),
            helper.make_node("ReduceSumSquare", [q + "e"], [q + "err"], keepdims=0),
            helper.make_node("ReduceSumSquare", [q + "r"], [q + "sig"], keepdims=0),
        ]
        names.append((q + "err", q + "sig"))
    return nodes, names


def output_weights(model: onnx.ModelProto, power: dict[str, float],
                   seeds: Sequence[str] | None = None) -> dict[str, list[float]]:
    """Per node, ``κ_o``: how much of a relative error on its output reaches scored output ``o`` (one reverse walk).

    Relative error passes through an op unchanged, except where branches merge (Add, Sub, Sum, Concat): there
    an input's absolute error joins a larger signal, so its relative error is scaled by ``P_in / P_out``
    (``P``: sum of squares over the evaluation data, when measured). Errors reaching an output along several
    paths add. Scored output ``o`` is the tensor ``seeds[o]`` (default: the graph outputs; a part of an output
    that a Concat joins is that Concat's input, `qgraph.runtime.output_parts`) with ``κ_o = 1``; a node that cannot
    reach ``o`` has ``κ_o = 0``.
    """
    targets = list(seeds) if seeds is not None else [o.name for o in model.graph.output]
    n_out = len(targets)
    kappa: dict[str, list[float]] = {}
    for o, name in enumerate(targets):
        kappa.setdefault(name, [0.0] * n_out)[o] = 1.0
    result: dict[str, list[float]] = {}
    for node in reversed(model.graph.node):
        k = [0.0] * n_out
        for t in node.output:
            for o, v in enumerate(kappa.get(t, ())):
                k[o] = max(k[o], v)
        result[node.name] = k
        if not any(k):
            continue
        merge = node.op_type in MERGE_OPS and node.output and node.output[0] in power
        for t in node.input:
            if not t:
                continue
            scale = 1.0
            if merge and t in power and power[node.output[0]] > 0:
                scale = min(1.0, power[t] / power[node.output[0]])
            acc = kappa.setdefault(t, [0.0] * n_out)
            for o in range(n_out):
                acc[o] += k[o] * scale
    return result


#: Probe models larger than this go to onnxruntime through a file with external data (no in-memory bytes copy).
FILE_BYTES = 32 << 20


def _session(probe: Probe, optimization: ort.GraphOptimizationLevel) -> ort.InferenceSession:
    """The probe's session; the proto is released first, so its weights are held once (by the session)."""
    model = probe.model
    probe.model = onnx.ModelProto()
    if model.ByteSize() < FILE_BYTES:
        return make_session(model, optimization=optimization, mem_pattern=False)
    with tempfile.TemporaryDirectory(prefix="qgraph_probe_") as tmp:
        path = save_model(model, Path(tmp) / "probe.onnx", external_data=True)
        del model
        return make_session(path, optimization=optimization, mem_pattern=False)


def local_errors(
    qdq: onnx.ModelProto,
    batches: Sequence[Feed],
    names: Sequence[str],
    *,
    optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    progress: StepProgress | None = None,
    deadline: float | None = None,
    parts: OutputParts | None = None,
) -> tuple[dict[str, LocalError], dict[str, str], int]:
    """Local errors of ``names`` (see module docs), the nodes skipped with why, and the batches run.

    Each error's ``weights`` are per scored part of ``parts`` (default: per graph output). Stops after the batch
    during which ``deadline`` (``time.monotonic()``) passes: the sums then cover fewer samples, which still ranks
    every node (at least one batch always runs)."""
    probe = build_probe(qdq, names, parts)
    errors = {n: LocalError(n) for n in probe.outputs}
    fetch = [t for pairs in probe.outputs.values() for pair in pairs for t in pair] + list(probe.powers.values())
    fetch += [t for cuts in probe.parts.values() for _, *sums in cuts for t in sums]
    part_sums: dict[str, dict[int, list[float]]] = {n: {} for n in probe.parts}
    if not probe.outputs:
        return errors, probe.skipped, 0
    structure = onnx.ModelProto()  # the float model's wiring, for `output_weights` (no weights kept)
    structure.graph.node.extend(n for n in probe.model.graph.node if not n.name.startswith(probe.copies))
    structure.graph.output.extend(qdq.graph.output)
    power = dict.fromkeys(probe.powers, 0.0)
    session = _session(probe, optimization)
    done = 0
    for feed in batches:
        values = dict(zip(fetch, session_run(session, fetch, feed), strict=True))
        for name, pairs in probe.outputs.items():
            e = errors[name]
            for err, sig in pairs:
                e.err += float(values[err])
                e.sig += float(values[sig])
        for t, out in probe.powers.items():
            power[t] += float(values[out])
        for name, cuts in probe.parts.items():
            for unit, err, sig in cuts:
                acc = part_sums[name].setdefault(unit, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + float(values[err]), acc[1] + float(values[sig])
        done += 1
        if progress is not None:
            progress(done, len(batches))
        if deadline is not None and time.monotonic() > deadline:
            break
    del session
    weights = output_weights(structure, power, probe_parts.seeds(structure, parts))
    for name, e in errors.items():
        e.weights = probe_parts.part_weights(weights.get(name, []), e.eta, part_sums.get(name, {}))
    return errors, probe.skipped, done

