"""Layer-by-layer numeric diff of two models on the same inputs, in bounded memory.

Every float tensor produced in both models under the same name (QDQ keeps original names) is exposed as an
extra graph output (a tensor a float-preserving pass rescaled per channel, recorded by `qgraph.quant.rescaling`, is
compared after dividing B's value by the recorded factors); both models run in onnxruntime with graph
optimizations disabled. Tensors are processed in
chunks whose estimated activation size stays under ``max_bytes`` (one pair of sessions per chunk), and every
(reference, candidate) pair is folded into a `DiffAccumulator` and dropped right away, so memory holds one
sample's activations of one chunk, never all activations of both models.

Where the error comes from (model A's topology): for each compared tensor, ``input SQNR`` is the lowest SQNR
among the nearest compared tensors upstream of it (graph inputs and constants are exact), ``drop = input SQNR -
SQNR``, and ``layer SQNR`` is the SQNR the layer would have with exact inputs, assuming relative error passes
through it unchanged: with noise ratios ``n = 10^(-SQNR/10)``, ``layer SQNR = -10 log10(n_out - n_in)``. A layer
*introduced* error when its layer SQNR is under the noise floor and its drop is at least ``jump_db`` (it at
least multiplied the error power by ``10^(jump_db/10)``); layers that only inherited error have a small drop.
The first such layer in topological order is where the error first jumps; ranked by layer SQNR, the layer that
added the most error comes first even when upstream layers added some too (e.g. one broken layer in a
quantized model).

Inside If/Loop bodies (which onnxruntime cannot return tensors from), each body of A and B's body of the same node
run as standalone models on their own executions, paired by sample (`qgraph.analysis.diff.bodies`); their tensors are
named by A's scoped keys (``If_0.then_branch/<node>``), and the walk above reaches a body's nodes before the
If/Loop holding it, whose input SQNR is then its bodies' outputs'. A body with no execution on the data is listed
in `NumericDiff.bodies` as not run, and nothing inside it is compared.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace

import numpy as np
import onnx

from qgraph.analysis.diff.bodies import BodyLevel, body_levels
from qgraph.analysis.diff.layers import LayerDiff, NumericDiff, part_drops
from qgraph.analysis.diff.protos import ModelIndex, NodeRef, subgraphs_of
from qgraph.data import DataSource, Feed, model_inputs
from qgraph.errors import DataError, ModelError
from qgraph.graph.shapes import skeleton
from qgraph.quant.rescaling import Rescaling, relative_rescaling, undo_rescaling
from qgraph.runtime.compare import DiffAccumulator, make_session, session_run
from qgraph.runtime.output_parts import OutputPart, output_parts_of

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def tensor_types(model: onnx.ModelProto) -> dict[str, tuple[int, list[int | str]]]:
    """Element type and shape of every typed tensor (shape inference on a weightless copy; best effort)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton(model))
    except Exception:  # inference is an optimisation here: unknown types are simply kept
        inferred = model
    out: dict[str, tuple[int, list[int | str]]] = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]:
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.elem_type:
            dims: list[int | str] = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tt.shape.dim]
            out[vi.name] = (int(tt.elem_type), dims if tt.HasField("shape") else [])
    return out


def estimate_bytes(info: tuple[int, list[int | str]] | None, batch: int) -> int:
    """Rough float32 size of a tensor from its inferred shape (dynamic dims = ``batch``; unknown: 4 MB)."""
    if info is None or not info[1]:
        return 4 << 20
    numel = 1
    for d in info[1]:
        numel *= d if isinstance(d, int) and d > 0 else batch
    return numel * 4


def plan_chunks(sizes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Split positions ``0..len(sizes)-1`` into consecutive chunks whose total size stays under ``max_bytes``."""
    chunks: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if current and total + size > max_bytes:
            chunks.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        chunks.append(current)
    return chunks


def _set_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """Make ``names`` the graph outputs of ``model`` (types left to the runtime) and return it."""
    del model.graph.output[:]
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    return model


def _limited(feeds: Iterable[Feed], samples: int | None) -> Iterable[Feed]:
    return itertools.islice(feeds, samples) if samples is not None else feeds


def reiterable(feeds: Iterable[Feed]) -> Iterable[Feed]:
    """``feeds`` itself when it can be iterated again (list, tuple, `DataSource`), else a list of it."""
    return feeds if isinstance(feeds, (list, tuple, DataSource)) else list(feeds)


def stream_tensors(
    model: onnx.ModelProto,
    chunks: Sequence[Sequence[str]],
    feeds: Iterable[Feed],
    samples: int | None = None,
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Yield ``(chunk_index, {tensor: value})`` per chunk of tensor names and per sample.

    One session per chunk, built on one working copy of ``model`` whose outputs are the chunk's names;
    the caller drops each dict before the next, so at most one sample's values of one chunk are alive.
    """
    feeds = reiterable(feeds)
    work = onnx.ModelProto()
    work.CopyFrom(model)
    for ci, names in enumerate(chunks):
        session = make_session(_set_outputs(work, list(names)))
        for feed in _limited(feeds, samples):
            yield ci, dict(zip(names, session_run(session, names, feed), strict=True))


def stream_pairs(
    a: onnx.ModelProto,
    b: onnx.ModelProto,
    pairs: Sequence[tuple[str, str]],
    feeds: Iterable[Feed],
    *,
    chunks: Sequence[Sequence[int]],
    samples: int | None = None,
    feeds_b: Iterable[Feed] | None = None,
) -> Iterator[tuple[int, dict[int, tuple[np.ndarray, np.ndarray] | str]]]:
    """Yield ``(chunk_index, {pair_position: (ref, cand) | skip_reason})`` per chunk and sample (B on ``feeds_b``
    when given, paired one to one with ``feeds``: e.g. a body's executions in each model)."""
    feeds = reiterable(feeds)
    feeds_b = feeds if feeds_b is None else reiterable(feeds_b)
    names_a = [list(dict.fromkeys(pairs[i][0] for i in c)) for c in chunks]
    names_b = [list(dict.fromkeys(pairs[i][1] for i in c)) for c in chunks]
    for (ci, ra), (_, rb) in zip(
        stream_tensors(a, names_a, feeds, samples), stream_tensors(b, names_b, feeds_b, samples), strict=True
    ):
        out: dict[int, tuple[np.ndarray, np.ndarray] | str] = {}
        for i in chunks[ci]:
            x, y = ra[pairs[i][0]], rb[pairs[i][1]]
            if x.dtype.kind != "f" or y.dtype.kind != "f":
                out[i] = f"not float ({x.dtype} vs {y.dtype})"
            elif x.shape != y.shape:
                out[i] = f"shapes differ: {list(x.shape)} vs {list(y.shape)}"
            else:
                out[i] = (x, y)
        del ra, rb
        yield ci, out


# --------------------------------------------------------------------------------------------- entry point
def _pair_tensors(
    ia: ModelIndex, ib: ModelIndex, types: dict[str, tuple[int, list[int | str]]]
) -> tuple[list[tuple[str, str]], list[tuple[str, str, int]], list[tuple[str, str]], set[str]]:
    """(A tensor, B tensor) pairs to compare (every float tensor of A's top graph also in B's), where each sits in
    A, the graph-output pairs, and the tensor names already paired."""
    top_b = {t for r in ib.nodes if not r.scope for t in r.node.output if t}
    pairs: list[tuple[str, str]] = []
    where: list[tuple[str, str, int]] = []
    seen: set[str] = set()
    for ref in ia.nodes:
        if ref.scope or ref.node.op_type == "Constant":
            continue
        for t in ref.node.output:
            info = types.get(t)
            if t and t in top_b and t not in seen and (info is None or info[0] in FLOAT_TYPES):
                seen.add(t)
                pairs.append((t, t))
                where.append((ref.key, ref.op, ref.index))
    # Outputs: by name when both models name them alike, else by position (when the counts agree).
    out_pairs: list[tuple[str, str]] = []
    if set(ia.graph_outputs) == set(ib.graph_outputs):
        out_pairs = [(o, o) for o in ia.graph_outputs]
    elif len(ia.graph_outputs) == len(ib.graph_outputs):
        out_pairs = list(zip(ia.graph_outputs, ib.graph_outputs, strict=True))
    return pairs, where, out_pairs, seen


def _same_input_types(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    """`ModelError` when an input both models take differs in dtype or in a fixed size: the numeric diff feeds both
    the same arrays, which one of them would refuse."""
    specs_a = {s.name: s for s in model_inputs(a)}
    for sb in model_inputs(b):
        sa = specs_a.get(sb.name)
        if sa is None:
            continue
        fixed_differ = sa.shape is not None and sb.shape is not None and (len(sa.shape) != len(sb.shape) or any(
            isinstance(x, int) and isinstance(y, int) and x != y for x, y in zip(sa.shape, sb.shape, strict=True)))
        if sa.dtype != sb.dtype or fixed_differ:
            raise ModelError(f"input {sa.describe()} in A, {sb.describe().split(': ', 1)[1]} in B: a numeric diff "
                             "feeds both models the same arrays, so a shared input must have the same dtype and "
                             "fixed sizes in both. Compare models with the same interface (or convert one).")


def numeric_diff(
    a: onnx.ModelProto,
    b: onnx.ModelProto,
    feeds: Iterable[Feed],
    *,
    samples: int | None = None,
    max_bytes: int = 256 << 20,
    noise_floor_db: float = 80.0,
    jump_db: float = 6.0,
    whole_outputs: bool = False,
) -> NumericDiff:
    """Compare every float tensor present in both models (by name) and the graph outputs on ``feeds``; tensors
    inside If/Loop bodies too, on the executions of each body (`qgraph.analysis.diff.bodies`). Each part of an output
    that
    a final Concat of A joins is compared too (`qgraph.runtime.output_parts`), unless ``whole_outputs``."""
    ia, ib = ModelIndex.build(a), ModelIndex.build(b)
    ins_a = {n for n in ia.graph_inputs if n not in ia.initializers}
    ins_b = {n for n in ib.graph_inputs if n not in ib.initializers}
    if not ins_b <= ins_a:  # B may take fewer inputs (fixed by specialize_inputs): it ignores those feeds
        raise ModelError(
            f"the models take different inputs ({sorted(ins_a)} vs {sorted(ins_b)}): a numeric diff runs both on "
            "the same feeds, so B's graph inputs must be inputs of A with the same names."
        )
    _same_input_types(a, b)
    types = tensor_types(a)
    pairs, where, out_pairs, seen = _pair_tensors(ia, ib, types)
    extra = [p for p in out_pairs if p[0] not in seen or p[0] != p[1]]
    for p in extra:
        prod = ia.producer.get(p[0])
        pairs.append(p)
        where.append((prod.key, prod.op, prod.index) if prod else ("", "input", -1))
    feeds = reiterable(feeds)
    rescaled = relative_rescaling(a, b)  # tensors a float-preserving pass rescaled per channel (equalization)
    top = _Compared(a, b, feeds, max_bytes, samples, rescaled)
    split = output_parts_of(a, enabled=not whole_outputs)
    position = {p: i for i, p in enumerate(pairs)}
    top.cuts = {position[p]: [(part, DiffAccumulator(part.label)) for part in s.parts]
                for p, s in zip(out_pairs, split.outputs, strict=False) if s.split and p in position}
    results = top.run(pairs, where, types, lambda t: ib.producer.get(t))
    if top.samples == 0:
        raise DataError("the numeric diff got no samples: the data is empty. Give at least one sample.")
    layers = {("", d.tensor): d for d in results if d.candidate is None}
    status: dict[str, str] = {}
    if any(r.scope for r in ia.nodes):
        for lv in body_levels(a, b, _limited(feeds, samples), index_a=ia, index_b=ib):
            status[lv.scope] = lv.status
            if lv.ran and lv.b is not None:
                layers.update(((lv.scope, d.tensor), d) for d in _body_layers(lv, ia, max_bytes, rescaled, top))
    _attribute_drops(ia, layers)
    part_drops(top.part_rows, layers)
    wanted = set(out_pairs)
    outputs = [d for d in results if (d.tensor, d.candidate or d.tensor) in wanted]
    ordered = sorted(layers.values(), key=lambda d: d.order)
    out = NumericDiff(top.samples, ordered, outputs, top.skipped, top.runs, noise_floor_db, jump_db)
    out.rescaled = sorted(t for t in rescaled if ("", t) in layers)
    out.bodies, out.output_parts, out.parts = status, split, top.part_rows
    return out


class _Compared:
    """Streams (A, B) tensor pairs of one pair of models on paired feeds into `LayerDiff` s (skips and counts kept
    across calls: the top graph, then each body)."""

    def __init__(self, a: onnx.ModelProto, b: onnx.ModelProto, feeds: Iterable[Feed], max_bytes: int,
                 samples: int | None, rescaled: Rescaling, feeds_b: Iterable[Feed] | None = None) -> None:
        self.a, self.b, self.feeds, self.feeds_b = a, b, feeds, feeds_b
        self.max_bytes, self.limit, self.rescaled = max_bytes, samples, rescaled
        self.skipped: dict[str, str] = {}
        self.samples = self.runs = 0
        #: pair position -> accumulators of the parts of that graph output, and their rows once run (by output)
        self.cuts: dict[int, list[tuple[OutputPart, DiffAccumulator]]] = {}
        self.part_rows: dict[str, list[LayerDiff]] = {}

    def run(self, pairs: list[tuple[str, str]], where: list[tuple[str, str, int]],
            types: dict[str, tuple[int, list[int | str]]], producer_b: Callable[[str], NodeRef | None]
            ) -> list[LayerDiff]:
        """Metrics of every pair that could be compared (the others in ``skipped`` with the reason)."""
        first = next(iter(_limited(self.feeds, 1)), None)
        batch = max((int(v.shape[0]) for v in (first or {}).values() if getattr(v, "ndim", 0)), default=1)
        chunks = plan_chunks([estimate_bytes(types.get(p[0]), batch) for p in pairs], self.max_bytes)
        accs = [DiffAccumulator(p[0]) for p in pairs]
        skipped: set[int] = set()
        for ci, values in stream_pairs(self.a, self.b, pairs, self.feeds, chunks=chunks, samples=self.limit,
                                       feeds_b=self.feeds_b):
            self.runs = max(self.runs, ci + 1)
            self.samples += ci == 0
            for i, v in values.items():
                if isinstance(v, str):
                    self.skipped[pairs[i][0]] = v
                    skipped.add(i)
                else:
                    cand = _undo(self.rescaled, pairs[i][1], v[1])
                    accs[i].add(v[0], cand)
                    for part, acc in self.cuts.get(i, ()):
                        acc.add(part.cut(v[0]), part.cut(cand))
            del values  # do not keep this sample's activations alive while the next one is computed
        for i, cuts in self.cuts.items():
            if i not in skipped:
                self.part_rows[pairs[i][0]] = [replace(self._layer(p.label, p.label, where[i], acc, None), part=p)
                                               for p, acc in cuts]
        return [self._layer(na, nb, w, acc, producer_b(nb))
                for i, ((na, nb), w, acc) in enumerate(zip(pairs, where, accs, strict=True)) if i not in skipped]

    @staticmethod
    def _layer(na: str, nb: str, where: tuple[str, str, int], acc: DiffAccumulator, prod_b: NodeRef | None
               ) -> LayerDiff:
        node, op, order = where
        r = acc.result()
        rel = math.sqrt(acc.err_sq / acc.ref_sq) if acc.ref_sq > 0 else (0.0 if acc.err_sq == 0 else math.inf)
        d = LayerDiff(na, node, op, order, r.max_abs, r.scale, r.cosine, r.sqnr_db, rel,
                      candidate=nb if nb != na else None, nonfinite_a=r.nonfinite_reference,
                      nonfinite_b=r.nonfinite_candidate)
        if prod_b is not None and prod_b.key != node:
            d.node_b, d.pass_name = prod_b.key, prod_b.pass_name
            d.op_b = prod_b.op if prod_b.op != op else None
        return d


def _body_layers(lv: BodyLevel, ia: ModelIndex, max_bytes: int, rescaled: Rescaling, top: _Compared
                 ) -> list[LayerDiff]:
    """Float tensors a body of A produces in its own scope that B's body produces too, compared on the paired
    executions (A's body on A's inputs, B's on B's), named and ordered by A's scoped keys."""
    assert lv.a is not None and lv.b is not None and lv.index_a is not None and lv.index_b is not None
    ka, kb, ib = lv.keys_a, lv.keys_b, lv.index_b
    types = tensor_types(lv.a.model)
    in_b = {t for r in ib.nodes if not r.scope for t in r.node.output if t}
    pairs: list[tuple[str, str]] = []
    where: list[tuple[str, str, int]] = []
    for ref in lv.index_a.nodes:
        glob = ia.by_key.get(ka.get(ref.key, "")) if not ref.scope else None
        if glob is None or ref.node.op_type == "Constant":
            continue
        for t in ref.node.output:
            info = types.get(t)
            if t and t in in_b and (info is None or info[0] in FLOAT_TYPES):
                pairs.append((t, t))
                where.append((glob.key, glob.op, glob.index))

    def producer_b(t: str) -> NodeRef | None:
        ref = ib.producer.get(t)
        return None if ref is None else NodeRef(kb.get(ref.key, f"{lv.scope}/{ref.key}"), ref.node, ref.index,
                                                lv.scope)

    body = _Compared(lv.a.model, lv.b.model, lv.runs_a, max_bytes, None, rescaled, lv.runs_b)
    out = body.run(pairs, where, types, producer_b)
    top.skipped.update({f"{lv.scope}/{t}": why for t, why in body.skipped.items()})
    top.runs += body.runs
    return out


def _undo(rescaled: Rescaling, name: str, value: np.ndarray) -> np.ndarray:
    """B's ``value`` of ``name`` in A's scale when a recorded rescaling applies (see `qgraph.quant.rescaling`)."""
    record = rescaled.get(name)
    if record is None:
        return value
    undone = undo_rescaling(value, *record)
    return value if undone is None else undone


def _noise(sqnr_db: float) -> float:
    return 10.0 ** (-sqnr_db / 10.0) if sqnr_db > -math.inf else math.inf


def _attribute_drops(ia: ModelIndex, layers: dict[tuple[str, str], LayerDiff]) -> None:
    """Fill ``input_sqnr_db``, ``drop_db`` and ``layer_sqnr_db`` in one topological pass over model A (a body's
    nodes before the If/Loop that holds it, whose inputs are then its own and its bodies' outputs)."""
    up: dict[str, float] = {}  # tensor -> SQNR of the nearest compared tensors at or above it
    pending: list[NodeRef] = []  # If/Loop nodes whose bodies are being walked (ModelIndex lists bodies after them)

    def finish(ref: NodeRef) -> None:
        ins = [*ref.node.input, *(o.name for at in ref.node.attribute for g in subgraphs_of(at) for o in g.output)]
        in_sqnr = min((up.get(t, math.inf) for t in ins if t), default=math.inf)
        for t in ref.node.output:
            d = layers.get((ref.scope, t))
            if d is None:
                up[t] = in_sqnr
                continue
            d.input_sqnr_db = in_sqnr
            if in_sqnr == -math.inf or d.sqnr_db == math.inf:
                d.drop_db = 0.0
            else:
                d.drop_db = in_sqnr - d.sqnr_db  # inf when the inputs were exact
            own = _noise(d.sqnr_db) - _noise(in_sqnr)
            d.layer_sqnr_db = math.inf if own <= 0 else (-math.inf if own == math.inf else -10 * math.log10(own))
            up[t] = d.sqnr_db

    for ref in ia.nodes:
        while pending and not ref.scope.startswith(pending[-1].key + "."):
            finish(pending.pop())
        if any(True for at in ref.node.attribute for _ in subgraphs_of(at)):
            pending.append(ref)
        else:
            finish(ref)
    while pending:
        finish(pending.pop())
