"""Layer-by-layer numeric diff of two models on the same inputs, in bounded memory.

Every float tensor produced in both models under the same name (QDQ keeps original names) is exposed as an
extra graph output; both models run in onnxruntime with graph optimizations disabled. Tensors are processed in
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
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from qgraph.compare import DiffAccumulator, make_session, session_run
from qgraph.data import DataSource, Feed
from qgraph.diff.protos import ModelIndex
from qgraph.errors import DataError, ModelError

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
_SMALL_CONSTANT = 64  # initializers up to this many elements keep their data for shape inference


@dataclass
class LayerDiff:
    """Metrics of one tensor compared between the two models, with where it sits in model A."""

    tensor: str
    node: str  # producer in model A
    op: str
    order: int  # producer position in model A (topological)
    max_abs: float
    scale: float
    cosine: float
    sqnr_db: float
    rel_l2: float  # ||c - r|| / ||r||
    input_sqnr_db: float = math.inf
    drop_db: float = 0.0
    layer_sqnr_db: float = math.inf  # SQNR this layer alone would give (see module docs)
    candidate: str | None = None  # name in model B when it differs (outputs matched by position)
    node_b: str | None = None  # producer in model B when it is another node (e.g. a fused one)
    op_b: str | None = None  # its op, when it differs from ``op``
    pass_name: str | None = None  # the qgraph pass that created the producer in B (from its tag)
    nonfinite_a: int = 0  # NaN/Inf elements in model A's tensor (never counted as "no error")
    nonfinite_b: int = 0

    @property
    def op_label(self) -> str:
        """``op`` or ``op → op_b`` when model B computes the tensor with another op."""
        return self.op if self.op_b is None else f"{self.op} → {self.op_b}"

    @property
    def label(self) -> str:
        """``node`` or ``node → node_b [pass]`` when model B produces the tensor with another node."""
        if self.node_b is None:
            return self.node
        return f"{self.node} → {self.node_b}" + (f" [{self.pass_name}]" if self.pass_name else "")

    @property
    def relative(self) -> float:
        """``max_abs / max|reference|`` (inf when either model gave NaN/Inf)."""
        if self.nonfinite_a or self.nonfinite_b:
            return math.inf
        return self.max_abs / self.scale if self.scale > 0 else self.max_abs

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (infinite dB values as the strings ``"inf"``/``"-inf"``)."""
        keys = ("tensor", "node", "op", "order", "max_abs", "scale", "cosine", "sqnr_db", "rel_l2")
        out = {k: json_number(getattr(self, k)) for k in keys}
        out.update(relative=json_number(self.relative), input_sqnr_db=json_number(self.input_sqnr_db),
                   drop_db=json_number(self.drop_db), layer_sqnr_db=json_number(self.layer_sqnr_db),
                   nonfinite_a=self.nonfinite_a, nonfinite_b=self.nonfinite_b)
        for key in ("candidate", "node_b", "op_b", "pass_name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def json_number(x: Any) -> Any:
    """``x`` with non-finite floats as strings (JSON has no inf/NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


@dataclass
class NumericDiff:
    """Per-tensor metrics in topological order, plus the graph outputs."""

    samples: int
    layers: list[LayerDiff]
    outputs: list[LayerDiff]
    skipped: dict[str, str] = field(default_factory=dict)
    runs: int = 0
    noise_floor_db: float = 80.0
    jump_db: float = 6.0

    def nonfinite(self) -> list[LayerDiff]:
        """Tensors holding NaN/Inf in either model, in graph order (outputs first)."""
        seen: set[str] = set()
        out = []
        for d in [*self.outputs, *self.layers]:
            if (d.nonfinite_a or d.nonfinite_b) and d.tensor not in seen:
                seen.add(d.tensor)
                out.append(d)
        return out

    def problem(self) -> str | None:
        """A sentence naming non-finite outputs (an error: NaN is never "no difference"), or None."""
        bad = [d for d in self.outputs if d.nonfinite_a or d.nonfinite_b]
        if not bad:
            return None
        first_layer = next((d for d in self.layers if d.nonfinite_a or d.nonfinite_b), None)
        where = f"; first non-finite tensor: {first_layer.tensor} ({first_layer.label})" if first_layer else ""
        names = ", ".join(f"{d.tensor} ({d.nonfinite_a} in A, {d.nonfinite_b} in B)" for d in bad)
        return f"non-finite values (NaN/Inf) in the outputs: {names}{where}."

    def worst(self, n: int = 10) -> list[LayerDiff]:
        """The ``n`` tensors with the lowest SQNR (ties: earliest first)."""
        return sorted(self.layers, key=lambda d: (d.sqnr_db, d.order))[:n]

    def introduced(self, n: int | None = None) -> list[LayerDiff]:
        """Layers that added error themselves (see module docs), most error (lowest layer SQNR) first."""
        hits = [d for d in self.layers if d.layer_sqnr_db < self.noise_floor_db and d.drop_db >= self.jump_db]
        return sorted(hits, key=lambda d: (d.layer_sqnr_db, d.order))[:n]

    @property
    def first_jump(self) -> LayerDiff | None:
        """The topologically first layer that introduced error."""
        hits = self.introduced()
        return min(hits, key=lambda d: d.order) if hits else None

    def to_dict(self, top: int = 10) -> dict[str, Any]:
        """JSON-ready form."""
        first = self.first_jump
        return {
            "samples": self.samples,
            "runs": self.runs,
            "noise_floor_db": self.noise_floor_db,
            "jump_db": self.jump_db,
            "outputs": [d.to_dict() for d in self.outputs],
            "first_jump": first.to_dict() if first else None,
            "introduced": [d.to_dict() for d in self.introduced(top)],
            "worst": [d.to_dict() for d in self.worst(top)],
            "layers": [d.to_dict() for d in self.layers],
            "skipped": self.skipped,
            "nonfinite": [d.to_dict() for d in self.nonfinite()],
            "problem": self.problem(),
        }


# --------------------------------------------------------------------------------------------- streaming
def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without large weight payloads (declared as inputs instead): cheap to shape-infer."""
    sk = onnx.ModelProto(ir_version=model.ir_version)
    sk.opset_import.extend(model.opset_import)
    sk.functions.extend(model.functions)
    g = sk.graph
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    declared = {v.name for v in model.graph.input}
    for t in model.graph.initializer:
        numel = int(np.prod(t.dims)) if t.dims else 1
        if numel <= _SMALL_CONSTANT and t.data_location != onnx.TensorProto.EXTERNAL:
            g.initializer.append(t)
        elif t.name not in declared:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return sk


def tensor_types(model: onnx.ModelProto) -> dict[str, tuple[int, list[int | str]]]:
    """Element type and shape of every typed tensor (shape inference on a weightless copy; best effort)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(_skeleton(model))
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
) -> Iterator[tuple[int, dict[int, tuple[np.ndarray, np.ndarray] | str]]]:
    """Yield ``(chunk_index, {pair_position: (ref, cand) | skip_reason})`` per chunk and sample."""
    feeds = reiterable(feeds)
    names_a = [list(dict.fromkeys(pairs[i][0] for i in c)) for c in chunks]
    names_b = [list(dict.fromkeys(pairs[i][1] for i in c)) for c in chunks]
    for (ci, ra), (_, rb) in zip(
        stream_tensors(a, names_a, feeds, samples), stream_tensors(b, names_b, feeds, samples), strict=True
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
def numeric_diff(
    a: onnx.ModelProto,
    b: onnx.ModelProto,
    feeds: Iterable[Feed],
    *,
    samples: int | None = None,
    max_bytes: int = 256 << 20,
    noise_floor_db: float = 80.0,
    jump_db: float = 6.0,
) -> NumericDiff:
    """Compare every float tensor present in both models (by name) and the graph outputs on ``feeds``."""
    ia, ib = ModelIndex.build(a), ModelIndex.build(b)
    ins_a = {n for n in ia.graph_inputs if n not in ia.initializers}
    ins_b = {n for n in ib.graph_inputs if n not in ib.initializers}
    if ins_a != ins_b:
        raise ModelError(
            f"the models take different inputs ({sorted(ins_a)} vs {sorted(ins_b)}): a numeric diff runs both on "
            "the same feeds, so their graph inputs must have the same names."
        )
    top_b = {t for r in ib.nodes if not r.scope for t in r.node.output if t}
    types = tensor_types(a)
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
    extra = [p for p in out_pairs if p[0] not in seen or p[0] != p[1]]
    for p in extra:
        prod = ia.producer.get(p[0])
        pairs.append(p)
        where.append((prod.key, prod.op, prod.index) if prod else ("", "input", -1))
    feeds = reiterable(feeds)
    first = next(iter(_limited(feeds, 1)), None)
    batch = max((int(v.shape[0]) for v in (first or {}).values() if getattr(v, "ndim", 0)), default=1)
    sizes = [estimate_bytes(types.get(p[0]), batch) for p in pairs]
    accs = [DiffAccumulator(p[0]) for p in pairs]
    skipped: dict[str, str] = {}
    n_samples = 0
    runs = 0
    chunks = plan_chunks(sizes, max_bytes)
    for ci, values in stream_pairs(a, b, pairs, feeds, chunks=chunks, samples=samples):
        runs = max(runs, ci + 1)
        if ci == 0:
            n_samples += 1
        for i, v in values.items():
            if isinstance(v, str):
                skipped[pairs[i][0]] = v
            else:
                accs[i].add(v[0], v[1])
        del values  # do not keep this sample's activations alive while the next one is computed
    if n_samples == 0:
        raise DataError("the numeric diff got no samples: the data is empty. Give at least one sample.")
    layers: dict[str, LayerDiff] = {}
    results: list[LayerDiff] = []
    for (na, nb), (node, op, order), acc in zip(pairs, where, accs, strict=True):
        if na in skipped:
            continue
        r = acc.result()
        rel = math.sqrt(acc.err_sq / acc.ref_sq) if acc.ref_sq > 0 else (0.0 if acc.err_sq == 0 else math.inf)
        d = LayerDiff(na, node, op, order, r.max_abs, r.scale, r.cosine, r.sqnr_db, rel,
                      candidate=nb if nb != na else None, nonfinite_a=r.nonfinite_reference,
                      nonfinite_b=r.nonfinite_candidate)
        prod_b = ib.producer.get(nb)
        if prod_b is not None and prod_b.key != node:
            d.node_b, d.pass_name = prod_b.key, prod_b.pass_name
            d.op_b = prod_b.op if prod_b.op != op else None
        results.append(d)
        if nb == na:
            layers[na] = d
    _attribute_drops(ia, layers)
    wanted = set(out_pairs)
    outputs = [d for d in results if (d.tensor, d.candidate or d.tensor) in wanted]
    ordered = sorted(layers.values(), key=lambda d: d.order)
    return NumericDiff(n_samples, ordered, outputs, skipped, runs, noise_floor_db, jump_db)


def _noise(sqnr_db: float) -> float:
    return 10.0 ** (-sqnr_db / 10.0) if sqnr_db > -math.inf else math.inf


def _attribute_drops(ia: ModelIndex, layers: dict[str, LayerDiff]) -> None:
    """Fill ``input_sqnr_db``, ``drop_db`` and ``layer_sqnr_db`` in one topological pass over model A."""
    up: dict[str, float] = {}  # tensor -> SQNR of the nearest compared tensors at or above it
    for ref in ia.nodes:
        if ref.scope:
            continue
        in_sqnr = min((up.get(t, math.inf) for t in ref.node.input if t), default=math.inf)
        for t in ref.node.output:
            d = layers.get(t)
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
