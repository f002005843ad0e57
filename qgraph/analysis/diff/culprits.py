"""Where accuracy was lost: every Q/DQ pair of a quantized model, ranked by the output error it causes.

For each quantization point of the candidate B (see `qgraph.analysis.diff.quant_points`), one streamed run of the
reference A gives the values it quantizes, and from them its scale/zero point against the observed range, the
fraction of values it clips and the rounding noise it injects (SQNR of Q/DQ(x) against x): O(1) model runs
plus O(values) numpy work per point. The points with the most local noise (``exact_top`` of them) are then
measured exactly: A with *only that pair* applied (a fake-quantized weight, or ``x → DQ(Q(x))`` inserted on the
activation with B's scale and zero point) runs on the same samples, and its output noise power ratio
``η_p = mean over outputs of Σ(y_p - y)² / Σ y²`` is compared with B's own ``η``: ``contribution = η_p / η``
(1.0: this pair alone explains all of B's output error). Culprits are ranked by ``η_p`` (measured first, then
the rest by local noise), never by graph order, and each carries one sentence saying why it hurts. An output that
a final Concat of A joins from different tensors (a detector's boxes and class scores, `qgraph.runtime.output_parts`) is
measured on its worst part in B (the largest noise ratio), for B and for every pair alone: the headline says so.

Pairs inside If/Loop bodies are found in each body of B made standalone, their values read from A's body run on
its executions (`qgraph.analysis.diff.bodies`), and ranked with the top-level ones under their scoped names; the exact
measure applies the pair inside that body of A (`qgraph.analysis.diff.probe`). The pairs of a body that did not run on
the data are not ranked, and `Attribution.not_run` says so.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from qgraph.analysis.diff.alone import measure, measure_more
from qgraph.analysis.diff.attribution import Attribution, Culprit, _db, _fmt_db
from qgraph.analysis.diff.bodies import BodyLevel, body_levels
from qgraph.analysis.diff.numeric import estimate_bytes, plan_chunks, reiterable, stream_tensors, tensor_types
from qgraph.analysis.diff.protos import ModelIndex
from qgraph.analysis.diff.quant_points import PointStats, QuantPoint, find_points
from qgraph.data import Feed
from qgraph.quant.math import matches_codes
from qgraph.quant.rescaling import Rescaling, relative_rescaling, undo_rescaling
from qgraph.runtime.output_parts import output_parts_of

#: Points measured exactly (A with only that pair) by default; the rest are ranked by their local noise.
EXACT_TOP = 16
#: Time for screening the other pairs in groups (`qgraph.analysis.diff.alone.measure_more`).
EXTEND_SECONDS = 30.0
_CLIP_SHARE = 0.5  # clipping explains the noise when it carries at least this share of it
_COARSE = 4.0  # a step this many times wider than needed is called out


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.01 else f"{x:.2%}"


# --------------------------------------------------------------------------------------------- reasons
def explain(point: QuantPoint, stats: PointStats) -> tuple[str, int | None]:
    """One sentence on why ``point`` injects its noise, and the worst channel of a per-channel point."""
    channel: int | None = None
    if point.channels > 1:
        channel = int(np.argmax(stats.channel_noise_ratio()))
    c = channel if channel is not None else 0
    prefix = f"channel {channel}: " if channel is not None else ""
    lo, hi = stats.calibrated_range(point)
    coarse = float(stats.coarseness(point)[c])
    clip = stats.clip_fraction(channel) if channel is not None else stats.clip_fraction()
    if point.kind == "bias":  # int32: the range is wide by design, only rounding matters
        return f"{prefix}bias rounding, SQNR {_fmt_db(_db(_ratio(stats, channel)))} dB", channel
    if stats.codes_only:
        qmin, qmax = point.qrange
        if clip >= 0.01:
            return f"{prefix}{_pct(clip)} of its weight codes sit at the limit [{qmin}, {qmax}] (clipped)", channel
        if coarse >= _COARSE:
            used = int(stats.max_code[c]) if stats.max_code is not None else 0
            return (f"{prefix}codes reach only ±{used}: step {float(point.scale.reshape(-1)[c]):.3g} is "
                    f"{coarse:.0f}× wider than its values need"), channel
        return f"{prefix}rounding noise, SQNR {_fmt_db(_db(_ratio(stats, channel)))} dB (read from the codes)", channel
    noise = float(stats.noise[c] if channel is not None else stats.noise.sum())
    clip_noise = float(stats.clipping[c] if channel is not None else stats.clipping.sum())
    observed = f"observed [{stats.lo[c]:.3g}, {stats.hi[c]:.3g}]"
    if clip > 0 and noise > 0 and clip_noise >= _CLIP_SHARE * noise:
        return f"{prefix}clips {_pct(clip)} of values: range [{lo[c]:.3g}, {hi[c]:.3g}] vs {observed}", channel
    if coarse >= _COARSE:
        step = float(point.scale.reshape(-1)[c])
        return (f"{prefix}step {step:.3g} is {coarse:.0f}× wider than the {observed} range needs "
                f"(range [{lo[c]:.3g}, {hi[c]:.3g}])"), channel
    return f"{prefix}rounding noise, SQNR {_fmt_db(_db(_ratio(stats, channel)))} dB ({observed})", channel


def _ratio(stats: PointStats, channel: int | None) -> float:
    return float(stats.channel_noise_ratio()[channel]) if channel is not None else stats.noise_ratio()


# --------------------------------------------------------------------------------------------- entry point
def attribute(
    a: onnx.ModelProto,
    b: onnx.ModelProto,
    feeds: Iterable[Feed],
    *,
    samples: int | None = None,
    exact_top: int = EXACT_TOP,
    max_bytes: int = 256 << 20,
    extend_seconds: float = EXTEND_SECONDS,
    whole_outputs: bool = False,
) -> Attribution:
    """Rank B's quantization points by the output error each causes (see module docs). The first ``exact_top``
    by local noise are measured alone; the others are screened in groups within ``extend_seconds`` (`_measure_more`)
    and the notes say how many were measured. ``whole_outputs`` measures an output a final Concat joins whole."""
    start = time.perf_counter()
    ia, ib = ModelIndex.build(a), ModelIndex.build(b)
    points, notes = find_points(ia, ib)
    feeds = list(feeds if samples is None else list(reiterable(feeds))[:samples])
    out = Attribution(samples=len(feeds), notes=notes)
    out.output_parts = None if whole_outputs else output_parts_of(a)
    in_bodies = any(r.scope for r in ib.nodes)
    if not (points or in_bodies) or not feeds:
        out.seconds = time.perf_counter() - start
        return out
    stats = [PointStats(p.channels) for p in points]
    _weight_stats(ia, ib, points, stats, out.notes)
    rescaled = relative_rescaling(a, b)  # equalized tensors: B quantizes f·x where A holds x (`qgraph.quant.rescaling`)
    _activation_stats(a, ia, points, stats, feeds, max_bytes, rescaled)
    if in_bodies:
        for level in body_levels(a, b, feeds, index_a=ia, index_b=ib):
            found, found_stats = _body_points(level, max_bytes, rescaled, out)
            points, stats = [*points, *found], [*stats, *found_stats]
    culprits = []
    for p, s in zip(points, stats, strict=True):
        if not s.count.sum():
            out.notes.append(f"{p.dq_node}: {p.tensor} has no value in the reference (not analysed)")
            continue
        reason, channel = explain(p, s)
        culprits.append(Culprit(p, s, channel, reason))
    culprits.sort(key=lambda c: -c.stats.noise_ratio())
    refs = measure(a, b, culprits[:exact_top], feeds, out, rescaled)
    measure_more(a, b, culprits, exact_top, feeds, out, rescaled, refs, extend_seconds)
    measured = sorted((c for c in culprits if c.output_noise is not None), key=lambda c: -(c.output_noise or 0.0))
    out.culprits = measured + [c for c in culprits if c.output_noise is None]
    out.seconds = time.perf_counter() - start
    return out


def _weight_stats(ia: ModelIndex, ib: ModelIndex, points: Sequence[QuantPoint], stats: Sequence[PointStats],
                  notes: list[str]) -> None:
    """Weights: the float values B quantized (B's float initializer, or A's weight when it matches the codes),
    else the codes alone."""
    for p, s in zip(points, stats, strict=True):
        if p.kind == "activation":
            continue
        if p.q_node is not None:
            init = ib.initializers.get(ib.by_key[p.q_node].node.input[0])
            if init is not None:
                s.add(p, numpy_helper.to_array(init))
            continue
        assert p.codes is not None
        ref = ia.initializers.get(p.tensor) if p.in_reference else None
        w = numpy_helper.to_array(ref) if ref is not None else None
        if w is not None and w.shape == p.codes.shape and _same_weight(p, w):
            s.add(p, w)
            continue
        if w is not None:
            notes.append(f"{p.tensor}: the reference {p.kind} does not round to the stored codes (a pass changed "
                         "them after quantizing, e.g. correct_bias or optimize_rounding, or the reference is from "
                         "before a fusion); analysed from the codes")
            p.in_reference = False
        s.add_codes(p, p.codes)


def _same_weight(p: QuantPoint, w: np.ndarray) -> bool:
    """Whether most channels of ``w`` round to B's codes (then a corrupted channel still counts as the same)."""
    assert p.codes is not None
    return matches_codes(w, p.codes, p.scale, p.zero_point, p.axis, steps=0.51)


def _activation_stats(a: onnx.ModelProto, ia: ModelIndex, points: Sequence[QuantPoint],
                      stats: Sequence[PointStats], feeds: list[Feed], max_bytes: int,
                      rescaled: Rescaling | None = None) -> None:
    """Activations: stream A's values of every quantized tensor (graph inputs straight from the feeds), in B's
    scale where a float-preserving pass rescaled the tensor per channel."""
    wanted: dict[str, list[int]] = {}
    for i, p in enumerate(points):
        if p.kind == "activation" and p.in_reference:
            wanted.setdefault(p.tensor, []).append(i)
    inputs = [t for t in wanted if t in ia.graph_inputs and t not in ia.initializers]
    for feed in feeds:
        for t in inputs:
            if t in feed:
                for i in wanted[t]:
                    stats[i].add(points[i], np.asarray(feed[t]))
    inner = [t for t in wanted if t in ia.producer and not ia.producer[t].scope]
    if not inner:
        return
    types = tensor_types(a)
    batch = max((int(v.shape[0]) for v in feeds[0].values() if getattr(v, "ndim", 0)), default=1)
    chunks = [[inner[i] for i in c] for c in plan_chunks([estimate_bytes(types.get(t), batch) for t in inner],
                                                          max_bytes)]
    for _, values in stream_tensors(a, chunks, feeds):
        for t, v in values.items():
            if isinstance(v, np.ndarray) and v.dtype.kind == "f":
                for i in wanted[t]:
                    record = points[i].rescaling(rescaled)
                    in_b = undo_rescaling(v, *record, inverse=True) if record else v
                    if in_b is not None:
                        stats[i].add(points[i], in_b)
        del values


def _body_points(level: BodyLevel, max_bytes: int, rescaled: Rescaling, out: Attribution
                 ) -> tuple[list[QuantPoint], list[PointStats]]:
    """The Q/DQ pairs in one body of B's own scope with their statistics from A's body on its executions, named by
    their scoped keys; a body that did not run is said so in ``out.not_run`` and its pairs left out."""
    if level.a is None or level.b is None or level.index_a is None or level.index_b is None:
        return [], []
    notes: list[str] = []
    points, found_notes = find_points(level.index_a, level.index_b)
    out.notes += [f"{level.scope}/{n}" for n in found_notes]
    if not level.ran:
        if points:
            out.not_run.append(f"{level.scope} {level.status}: its {len(points)} Q/DQ pair(s) are not ranked "
                               "(give samples that take it)")
        return [], []
    stats = [PointStats(p.channels) for p in points]
    _weight_stats(level.index_a, level.index_b, points, stats, notes)  # by the standalone body's keys, then renamed
    _activation_stats(level.a.model, level.index_a, points, stats, level.runs_a, max_bytes, rescaled)
    out.notes += [f"{level.scope}: {n}" for n in notes]
    rename = level.keys_b
    for p in points:
        p.scope, p.path = level.scope, level.path
        p.node, p.dq_node = rename.get(p.node, p.node), rename.get(p.dq_node, p.dq_node)
        p.q_node = None if p.q_node is None else rename.get(p.q_node, p.q_node)
        p.consumers = [(rename.get(k, k), i) for k, i in p.consumers]
    return points, stats
