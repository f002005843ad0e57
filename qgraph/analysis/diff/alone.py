"""Measuring Q/DQ pairs alone: the reference with only one pair (or one group of pairs) applied, run on the
evaluation samples, and its output noise against the reference's own outputs (`qgraph.analysis.diff.culprits`)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx

from qgraph.analysis.diff.probe import MIN_PROBE_OPSET, only_this_pair
from qgraph.data import Feed
from qgraph.graph import ProtoNames
from qgraph.graph.opsets import model_opset
from qgraph.quant.rescaling import Rescaling
from qgraph.runtime.compare import make_session, session_run
from qgraph.runtime.output_parts import OutputPart, OutputParts

if TYPE_CHECKING:
    from qgraph.analysis.diff.attribution import Attribution, Culprit

#: The other pairs are screened in groups of this many (one run each: A with the whole group applied), and the
#: members of the groups that could hold a pair worse than the worst measured are measured one by one, within
#: ``extend_seconds``: a pair's local noise does not predict what later layers amplify (PicoDet's stem output:
#: rank 78 of 226 by local noise, 4th by measured output error; rank correlation of the two orders -0.06).
GROUP = 8


def outputs(model: onnx.ModelProto, feeds: Sequence[Feed]) -> list[list[np.ndarray]]:
    session = make_session(model, mem_pattern=False)
    names = [o.name for o in session.get_outputs()]
    return [[np.asarray(v) for v in session_run(session, names, f)] for f in feeds]


def noise_ratio(refs: list[list[np.ndarray]], got: list[list[np.ndarray]],
                scored: Sequence[OutputPart | None] = ()) -> float:
    """Mean over outputs of Σ(got - ref)² / Σ ref² (inf when ``got`` has NaN/Inf); ``scored[o]``, when given and
    not None, is the part of output ``o`` measured instead of the whole (`qgraph.runtime.output_parts`)."""
    n_out = len(refs[0]) if refs else 0
    ratios = []
    for o in range(n_out):
        err = sig = 0.0
        part = scored[o] if o < len(scored) else None
        for r, g in zip(refs, got, strict=True):
            rr, gg = r[o].astype(np.float64), g[o].astype(np.float64)
            if rr.dtype.kind != "f" or rr.shape != gg.shape:
                break
            if part is not None:
                rr, gg = part.cut(rr), part.cut(gg)
            if not np.all(np.isfinite(gg)):
                return math.inf
            err += float(((gg - rr) ** 2).sum())
            sig += float((rr**2).sum())
        else:
            ratios.append(err / sig if sig > 0 else (0.0 if err == 0 else math.inf))
    return float(np.mean(ratios)) if ratios else 0.0


def worst_parts(refs: list[list[np.ndarray]], got: list[list[np.ndarray]],
                parts: OutputParts | None) -> list[OutputPart | None]:
    """Per output, the part of a split output where ``got`` has the largest noise ratio (None: the whole output)."""
    if parts is None or not parts.split:
        return []
    out: list[OutputPart | None] = []
    for o, split in enumerate(parts.outputs):
        if not split.split:
            out.append(None)
            continue
        solo = [[r[o]] for r in refs], [[g[o]] for g in got]
        out.append(max(split.parts, key=lambda p: noise_ratio(*solo, [p])))
    return out


def measure_more(a: onnx.ModelProto, b: onnx.ModelProto, culprits: Sequence[Culprit], first: int, feeds: list[Feed],
                  out: Attribution, rescaled: Rescaling | None, refs: list[list[np.ndarray]],
                  seconds: float) -> None:
    """Group screening of the points after the first ``first``: each group of `GROUP` applied at once (one run);
    the members of a group whose joint error exceeds half the worst single pair measured so far are measured one
    by one, worst group first, while ``seconds`` last. The notes say how many were measured."""
    opset = model_opset(a)
    rest = [c for c in culprits[first:] if c.point.in_reference and not (c.point.kind == "activation" and
                                                                         opset < MIN_PROBE_OPSET)]
    if not out.output_noise or not rest or seconds <= 0:
        return
    start = time.perf_counter()
    work = onnx.ModelProto()
    work.CopyFrom(a)
    names = ProtoNames(work)  # every probe is undone on exit: the names stay those of `a` plus the ones handed out
    screened: list[tuple[float, list[Culprit]]] = []
    for i in range(0, len(rest), GROUP):
        if time.perf_counter() - start > seconds:
            break
        group = rest[i:i + GROUP]
        # one probe per tensor (two points on one tensor would insert the same probe twice)
        distinct = list({(c.point.scope, c.point.tensor): c for c in reversed(group)}.values())
        with contextlib.ExitStack() as stack:
            applied = [stack.enter_context(only_this_pair(work, c, c.point.rescaling(rescaled), names))
                       for c in distinct]
            if any(p is not None for p in applied):
                screened.append((noise_ratio(refs, outputs(work, feeds), out.scored), group))
    worst = max((c.output_noise or 0.0 for c in culprits), default=0.0)
    for joint, group in sorted(screened, key=lambda s: -s[0]):
        if joint < worst / 2 or time.perf_counter() - start > seconds:
            break
        measure(a, b, group, feeds, out, rescaled, refs)
        worst = max(worst, *(c.output_noise or 0.0 for c in group))
    out.notes.insert(0, _screening_note(culprits, first, sum(len(g) for _, g in screened), len(rest), seconds))


def _screening_note(culprits: Sequence[Culprit], first: int, screened: int, rest: int, seconds: float) -> str:
    """How many pairs were measured alone and how they were chosen, adding up to the pairs ranked: the ``first``
    by local noise, the members of the screened groups that exceeded the bar, and the pairs not measurable."""
    top = sum(c.output_noise is not None for c in culprits[:first])
    later = sum(c.output_noise is not None for c in culprits[first:])
    absent = sum(not c.point.in_reference for c in culprits)
    text = (f"{top + later} of {len(culprits)} Q/DQ pairs measured alone: the {top} with the most local noise, then "
            f"{later} of the {screened} others screened in groups of {GROUP} (members of groups whose joint error "
            "exceeded half the worst pair's)")
    if screened < rest:
        text += (f"; {rest - screened} not screened (time budget {seconds:.0f} s): ranked by local noise only, which "
                 "may miss pairs that later layers amplify")
    if absent:
        text += (f"; {absent} not measurable alone (their float tensor is not in A as quantized, e.g. a weight "
                 "BatchNorm fusion changed)")
    return text


def measure(a: onnx.ModelProto, b: onnx.ModelProto, culprits: Sequence[Culprit], feeds: list[Feed],
             out: Attribution, rescaled: Rescaling | None = None,
             refs: list[list[np.ndarray]] | None = None) -> list[list[np.ndarray]]:
    """Fill ``output_noise``/``contribution`` of ``culprits`` (A with only that pair), and B's ``η`` (once);
    returns A's outputs for the next call."""
    if refs is None:
        refs, got = outputs(a, feeds), outputs(b, feeds)
        out.scored = worst_parts(refs, got, out.output_parts)
        out.output_noise = noise_ratio(refs, got, out.scored)
    work = onnx.ModelProto()
    work.CopyFrom(a)
    names = ProtoNames(work)
    opset = model_opset(a)
    for c in culprits:
        if not c.point.in_reference:
            continue
        if c.point.kind == "activation" and opset < MIN_PROBE_OPSET:
            out.notes.append(f"{c.point.tensor}: not measured alone (the reference's opset {opset} has no "
                             "broadcasting Max/Min for the probe)")
            continue
        with only_this_pair(work, c, c.point.rescaling(rescaled), names) as probe:
            if probe is None:
                continue
            c.output_noise = noise_ratio(refs, outputs(work, feeds), out.scored)
        if out.output_noise:
            c.contribution = c.output_noise / out.output_noise
    return refs
