"""``smooth_quant``: SmoothQuant (Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training Quantization
for Large Language Models"), float-preserving.

Transformer activations have a few channels 20-100x larger than the rest (the same channels on every token), so
a per-tensor activation scale wastes most codes on them; weights are easy to quantize. For ``Y = X · W``
(MatMul / Gemm with a constant ``W``) and per input channel ``j``

    s_j = max|X_j|^α / max|W_j|^(1-α),     X ← X · diag(1/s),     W ← diag(s) · W

(``max|X_j|`` over the calibration data, one streamed pass for every tensor; ``max|W_j|`` the largest
``|W[j, :]|`` over every layer reading X, e.g. Q/K/V after one LayerNorm, which share one ``s``; s clipped to
``[min_scale, max_scale]``, 1 where a maximum is 0). ``X / s`` is folded into X's producer (see `groups`:
LayerNormalization γ and β, a Mul/Add constant, a preceding MatMul/Gemm's columns and bias), so the model
computes the same function with a smoother X. Where the producer cannot absorb it (residual Add, graph input,
GELU, other readers of X) the group is skipped with that reason, or, with ``insert_mul``, a float
``Mul(X, 1/s)`` is inserted in front of the group.

``alpha: auto`` scores, per group, every α of ``alpha_grid`` and "no smoothing" by the INT8 error of the group's
product on sampled calibration rows, ``||X·W - Q(X/s)·Q(diag(s)·W)||² / ||X·W||²`` (uint8 per-tensor activations
over the exact smoothed range, int8 symmetric weights per column; the candidates of groups of one shape in one
stacked call: `choose`), and keeps the best: a group is smoothed only where that lowers the error.

A second run measures ``a'_j = a_j / s_j`` and ``w'_j = w_j · s_j``, so ``s'_j = s_j / s_j = 1`` for any α
(unless s was clipped): groups within ``tolerance`` are left alone, which makes the pass idempotent.
Needs calibration data (`requires` refuses without it).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from qgraph import GraphHandle, Pass, PassContext, PassError, PassResult, register, selected_ids
from qgraph.graph import rebuild, redirect
from qgraph.quant.rescaling import record_rescaling
from qgraph.recovery.equalize import log_change, smoothing_scales, smoothing_scales_grid

from .choose import CandidateScorer
from .config import SmoothQuantConfig
from .details import SmoothedGroup, SmoothQuantDetails
from .groups import Group, apply_fold, find_groups, scale_group_weights, weight_dtype
from .measure import ChannelStats, measure


@register
class SmoothQuant(Pass[SmoothQuantConfig]):
    """SmoothQuant: ``s_j = max|X_j|^α / max|W_j|^(1-α)``, ``X ← X / s`` (folded upstream), ``W ← diag(s) · W``."""

    name = "smooth_quant"
    config_class = SmoothQuantConfig
    preserves_float = True

    def requires(self, graph: GraphHandle, ctx: PassContext) -> None:
        """Refuse without calibration data where there is something to smooth: the activation maxima are
        measured (a CNN without MatMul/Gemm candidates runs without data)."""
        if ctx.calibration_data is None and find_groups(graph.graph, selected_ids(graph, self.config.nodes)[0],
                                                        self.config.insert_mul, []):
            raise PassError(
                "smooth_quant: per-channel activation maxima max|X_j| are measured on calibration data, but none "
                "was given. Pass `--calibration-data DATA` to `qgraph run` (an .npz with one array per input, a "
                "folder of .npz, or module:function), or `calibration_data=` to Pipeline.run. A ranges file "
                "(`calibration: {ranges: ...}`) holds per-tensor ranges only: with one, still give the data, or "
                "remove smooth_quant from the recipe."
            )

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Find the groups, measure their inputs once, rescale the groups that move by more than tolerance."""
        cfg = self.config
        res = PassResult()
        selected, unmatched = selected_ids(graph, cfg.nodes)
        res.unmatched.extend(unmatched)
        skips: list[tuple[str, str]] = []
        groups = find_groups(graph.graph, selected, cfg.insert_mul, skips)
        for node, reason in skips:
            res.skip(node, reason)
        res.matched = len(groups)
        smoothed: list[SmoothedGroup] = []
        res.details = SmoothQuantDetails(groups=len(groups), smoothed=smoothed)  # filled in below, in group order
        if not groups:
            return res
        auto = cfg.alpha == "auto"
        stats = measure(graph, ctx, [g.x.name for g in groups], cfg.sample_rows if auto else 0)
        self._order = {id(n): i for i, n in enumerate(graph.graph.nodes)}
        self._inserts: dict[int, list[gs.Node]] = {}
        self._rescaled: dict[str, tuple[int, np.ndarray]] = {}
        inserted = 0
        inputs = [self._ranges(group, stats[group.x.name]) for group in groups]
        chosen = self._choose(groups, stats, inputs)
        for group, (a, w), (alpha, s) in zip(groups, inputs, chosen, strict=True):
            if a.shape != w.shape:
                res.skip(group.layers[0].node.name, f"{group.x.name!r} has {a.size} channels, weights {w.size}")
                continue
            if s is None:
                res.skip(group.layers[0].node.name, f"alpha auto: smoothing {group.x.name!r} would not lower the "
                         "INT8 error on the sampled rows")
                continue
            if log_change(s) <= cfg.tolerance:
                continue
            inserted += self._apply(graph, group, s)
            res.rewritten += 1
            smoothed.append(_describe(group, a, w, s, alpha))
        if self._inserts:  # every inserted Mul goes in front of its group's first layer, in one pass
            rebuild(graph.graph, replacements=self._inserts)
        if self._rescaled:
            record_rescaling(graph.metadata, self._rescaled)
        res.nodes_added = inserted
        if res.rewritten:
            lo = min(d.scale[0] for d in smoothed)
            hi = max(d.scale[1] for d in smoothed)
            alphas = sorted({d.alpha for d in smoothed})
            shown = "/".join(f"{x:g}" for x in alphas) + (" (auto)" if cfg.alpha == "auto" else "")
            res.decisions.append(
                f"smoothed {res.rewritten} input(s) of {len(groups)} (alpha {shown}, scales {lo:.3g}..{hi:.3g}"
                + (f", {inserted} float Mul inserted" if inserted else "") + ")"
            )
        return res

    @staticmethod
    def _ranges(group: Group, st: ChannelStats) -> tuple[np.ndarray, np.ndarray]:
        """``(max|X_j|, max|W_j|)``: the activation maxima and the largest weight range of each input channel."""
        return st.absmax, np.max([layer.in_ranges(layer.value()) for layer in group.layers], axis=0)

    def _choose(self, groups: list[Group], stats: dict[str, ChannelStats],
                inputs: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[float, np.ndarray | None]]:
        """Per group ``(α, s)``: the configured α, or with ``auto`` the grid α with the least sampled INT8 error (s
        None when no smoothing at all scores best). Every group is scored before any is rewritten: a group's
        weights and statistics are its own, no other group's rewrite changes them (a fold reaches only upstream
        of the group's input, into layers of groups earlier in node order)."""
        cfg = self.config
        if cfg.alpha != "auto":
            return [(float(cfg.alpha), smoothing_scales(a, w, float(cfg.alpha), cfg.min_scale, cfg.max_scale))
                    for a, w in inputs]
        scorer = CandidateScorer(cfg.weights_per_channel)
        candidates: dict[int, np.ndarray] = {}
        for i, (group, (a, w)) in enumerate(zip(groups, inputs, strict=True)):
            if a.shape != w.shape:
                continue
            st = stats[group.x.name]
            low, high = st.low, st.high
            assert low is not None and high is not None
            # "no smoothing" first, then the grid in order
            candidates[i] = np.concatenate([np.ones((1, a.size)),
                                            smoothing_scales_grid(a, w, cfg.alpha_grid, cfg.min_scale, cfg.max_scale)])
            mat = np.concatenate([layer.matrix(layer.value()) for layer in group.layers], axis=1)
            scorer.add(i, st.rows_sample(), mat, candidates[i], low, high)
        scorer.flush()
        out: list[tuple[float, np.ndarray | None]] = []
        for i in range(len(groups)):
            if i not in candidates:
                out.append((0.0, None))
                continue
            errors = scorer.errors[i]
            best: tuple[float, float, np.ndarray | None] = (float(errors[0]), 0.0, None)
            for alpha, s, e in zip(cfg.alpha_grid, candidates[i][1:], errors[1:], strict=True):
                if e < best[0]:  # strictly lower: ties keep the earlier candidate, as a loop over the grid would
                    best = (float(e), alpha, s)
            out.append((best[1], best[2]))
        return out

    def _apply(self, graph: GraphHandle, group: Group, s: np.ndarray) -> int:
        """Rescale the group's weights by ``s`` and put ``1 / s`` upstream; returns the nodes added (0 or 1)."""
        if group.fold is None:
            scale_group_weights(group, s)
            return self._insert_mul(graph, group, 1.0 / s)
        self._rescaled.update(apply_fold(graph, group, s))
        return 0

    def _insert_mul(self, graph: GraphHandle, group: Group, inv: np.ndarray) -> int:
        x = group.x
        dtype = weight_dtype(group.layers[0].weight)
        factor = gs.Constant(graph.unique_name(f"{x.name}/smooth_scale", kind="tensor"), inv.astype(dtype))
        smoothed = gs.Variable(graph.unique_name(f"{x.name}/smoothed", kind="tensor"), dtype=x.dtype)
        redirect(x, smoothed, keep=group.others)
        # the layers read x / s from a new tensor: recorded as a rescaled copy of x, so that the culprit ranking
        # compares its Q/DQ with the float model's x in the same scale (`qgraph.quant.rescaling`)
        self._rescaled[smoothed.name] = (-1, np.asarray(inv, np.float64))
        node = gs.Node("Mul", graph.unique_name(f"{x.name}/smooth"), inputs=[x, factor], outputs=[smoothed])
        graph.tag(node, self.name)
        first = min((layer.node for layer in group.layers), key=lambda n: self._order[id(n)])
        self._inserts[id(first)] = [node, first]
        return 1


def _describe(group: Group, a: np.ndarray, w: np.ndarray, s: np.ndarray, alpha: float) -> SmoothedGroup:
    """Per group: the layers, where 1/s went, the scale range, the activation outlier ratio before/after, α."""
    ratios = max_over_median(np.stack([a, a / s, w, w * s]))
    return SmoothedGroup(
        input=group.x.name,
        layers=[layer.node.name for layer in group.layers],
        absorbed_by=group.fold.label() if group.fold is not None else "inserted Mul",
        scale=(round(float(s.min()), 6), round(float(s.max()), 6)),
        activation_max_over_median=(ratios[0], ratios[1]),
        weight_max_over_median=(ratios[2], ratios[3]),
        alpha=alpha,
    )


def max_over_median(rows: np.ndarray) -> list[float]:
    """``max / median`` of each row of ``rows`` ``[M, K]`` (finite values), rounded to 3 decimals; inf where the
    median is not positive. One sort for all rows (a report line per smoothed group, 1,000s on a long chain); the
    median is `np.median`'s: the middle value, or the mean ``(lo + hi) / 2`` of the two middle ones."""
    srt = np.sort(rows, axis=1)
    k = srt.shape[1]
    med = srt[:, k // 2] if k % 2 else (srt[:, k // 2 - 1] + srt[:, k // 2]) / 2
    return [round(float(top) / float(m), 3) if m > 0 else float("inf") for top, m in zip(srt[:, -1], med, strict=True)]
