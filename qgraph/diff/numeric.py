"""Layer-by-layer numeric diff of two models on the same inputs, in bounded memory.

Every float tensor produced in both models under the same name (QDQ keeps original names) is exposed as an
extra graph output (a tensor a float-preserving pass rescaled per channel, recorded by `qgraph.rescaling`, is
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
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import onnx

from qgraph.compare import DiffAccumulator, make_session, session_run
from qgraph.data import DataSource, Feed
from qgraph.diff.layers import LayerDiff, NumericDiff
from qgraph.diff.protos import ModelIndex
from qgraph.errors import DataError, ModelError
from qgraph.rescaling import Rescaling, relative_rescaling, undo_rescaling

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
_SMALL_CONSTANT = 64  # initializers up to this many elements keep their data for shape inference


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
    if not ins_b <= ins_a:  # B may take fewer inputs (fixed by specialize_inputs): it ignores those feeds
        raise ModelError(
            f"the models take different inputs ({sorted(ins_a)} vs {sorted(ins_b)}): a numeric diff runs both on "
            "the same feeds, so B's graph inputs must be inputs of A with the same names."
        )
    types = tensor_types(a)
    pairs, where, out_pairs, seen = _pair_tensors(ia, ib, types)
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
    rescaled = relative_rescaling(a, b)  # tensors a float-preserving pass rescaled per channel (equalization)
    for ci, values in stream_pairs(a, b, pairs, feeds, chunks=chunks, samples=samples):
        runs = max(runs, ci + 1)
        if ci == 0:
            n_samples += 1
        for i, v in values.items():
            if isinstance(v, str):
                skipped[pairs[i][0]] = v
            else:
                accs[i].add(v[0], _undo(rescaled, pairs[i][1], v[1]))
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
    out = NumericDiff(n_samples, ordered, outputs, skipped, runs, noise_floor_db, jump_db)
    out.rescaled = sorted(t for t in rescaled if t in layers)
    return out


def _undo(rescaled: Rescaling, name: str, value: np.ndarray) -> np.ndarray:
    """B's ``value`` of ``name`` in A's scale when a recorded rescaling applies (see `qgraph.rescaling`)."""
    record = rescaled.get(name)
    if record is None:
        return value
    undone = undo_rescaling(value, *record)
    return value if undone is None else undone


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
