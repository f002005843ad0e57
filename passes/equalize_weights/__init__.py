"""``equalize_weights``: cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization Through Weight
Equalization and Bias Correction", section 4.1).

For ``y = W2 · f(W1 · x + b1)`` with ``f`` positively homogeneous per channel (``f(x / s) = f(x) / s`` for
``s > 0``: ReLU, LeakyReLU, PReLU, pooling, identity; see `chains` for the exact list and why ReLU6, HardSwish
and HardSigmoid are skipped), moving ``s_i`` across channel ``i``

    W1[i] ← W1[i] / s_i,   b1[i] ← b1[i] / s_i,   W2[:, i] ← W2[:, i] · s_i

keeps the float function. With per-channel weight ranges ``r1_i = max|W1[i, ...]|`` and ``r2_i = max|W2[:, i,
...]|``, ``s_i = sqrt(r1_i · r2_i) / r2_i`` makes both ranges ``sqrt(r1_i · r2_i)``: channels whose ranges
differ 100x (depthwise convs after BatchNorm folding) then share one per-tensor scale far better.

Pairs: Conv → Conv (grouped; for a depthwise Conv input channel ``c`` maps to its own output channels, so a
depthwise layer is the second layer of one pair and the first of the next), Gemm / MatMul with constant
weights, Conv → global pool → Flatten → Gemm, and one producer read by several layers (one ``s`` for all of
them, balancing ``r1`` against the largest reader range). Chains of 3+ layers are iterated: each round
equalizes every pair with the current weights (sweeping forward, then backward; a pair none of whose weights
changed since it was equalized is not recomputed), until a round moves no channel by more than
``tolerance / 10`` (or ``iterations`` rounds: long plain chains such as VGG19's 17 pairs do not converge in 50
rounds, which the decision says). Run after ``fuse_batchnorm`` so BN scales are in the weights.

Idempotence: the whole rewrite is kept only when some channel moves by more than ``tolerance`` (|ln s| >
tolerance, cumulated over rounds); on an equalized model a second run leaves the graph untouched.
The per-channel factors ``1/s`` of every tensor between two equalized layers are recorded in the model's metadata
(`qgraph.quant.rescaling`), so `qgraph diff` against the model before equalization compares them without the rescaling.
Dead channels keep ``s_i = 1`` (`qgraph.recovery.equalize.dead_channels`): a range below ``dead_range`` (1e-6) times its
layer's largest, where ``sqrt(r1_i / r2_i)`` degenerates (PP-OCRv4's detector had scales 4e-14..7e+3 from channels
with ``r1`` ~ 1e-34); the notes say how many, per pair in ``details["dead_channels"]``.
Skipped with a reason: a tensor with other readers or that is a graph output, a non-equivariant op, shared or
non-constant weights, mismatched channel axes. Cost per round: O(weights of the pairs).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from qgraph import GraphHandle, Pass, PassContext, PassResult, register, selected_ids
from qgraph.graph import NoMatch, const_value, graph_scopes, renew_const
from qgraph.quant.rescaling import record_rescaling
from qgraph.recovery.equalize import (
    LinearLayer,
    as_linear,
    cle_scales,
    dead_channels,
    log_change,
    scale_const_per_channel,
)

from .chains import NoSecondLayer, Pair, find_pair
from .config import EqualizeWeightsConfig
from .details import EqualizedPair, EqualizeWeightsDetails

_LINEAR = ("Conv", "Gemm", "MatMul")


@register
class EqualizeWeights(Pass[EqualizeWeightsConfig]):
    """Cross-layer equalization: ``W1[i] /= s_i``, ``b1[i] /= s_i``, ``W2[:, i] *= s_i`` with
    ``s_i = sqrt(r1_i · r2_i) / r2_i`` over chains ``W1 → f → W2`` with positively homogeneous ``f``."""

    name = "equalize_weights"
    config_class = EqualizeWeightsConfig
    preserves_float = True

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Find the pairs of every scope, equalize them until converged, write the weights back once."""
        cfg = self.config
        res = PassResult()
        selected, unmatched = selected_ids(graph, cfg.nodes)
        res.unmatched.extend(unmatched)
        pairs = _find_pairs(graph_scopes(graph.graph, cfg.recurse_subgraphs), selected, res)
        res.matched = len(pairs)
        if not pairs:
            res.details = EqualizeWeightsDetails(pairs=0)
            return res
        state = _Equalizer(pairs, cfg)
        rounds, converged = state.iterate()
        moved = [i for i, s in enumerate(state.cumulative) if log_change(s) > cfg.tolerance]
        res.details = EqualizeWeightsDetails(pairs=len(pairs), rounds=rounds, converged=converged,
                                             equalized=[state.describe(i) for i in moved],
                                             dead_channels=_report_dead(state, cfg.dead_range, res))
        if not moved:
            res.notes.append(f"{len(pairs)} pair(s) already equalized within tolerance {cfg.tolerance:g}")
            return res
        state.write_back()
        # The tensors between the layers now hold x / s: record it so a diff against the model before can undo it.
        record_rescaling(graph.metadata, {name: (axis, 1.0 / state.cumulative[i])
                                          for i in moved for name, axis in pairs[i].scaled})
        res.rewritten = len(moved)
        lo = min(float(state.cumulative[i].min()) for i in moved)
        hi = max(float(state.cumulative[i].max()) for i in moved)
        res.decisions.append(
            f"equalized {len(moved)} layer pair(s) in {rounds} round(s) (per-channel scales {lo:.3g}..{hi:.3g})"
            + ("" if converged else _unconverged(rounds, state.last_change))
        )
        return res


def _unconverged(rounds: int, change: float) -> str:
    """Information, not an instruction: the rewrite is float-equivalent whether or not the rounds converged."""
    return (f"; the `iterations` limit ({rounds} round(s)) ended it with channels still moving by up to "
            f"{math.expm1(change):.2%} per round (long chains converge slowly; the model computes the same float "
            "function either way, more rounds would only even the ranges a little more)")


def _report_dead(state: _Equalizer, dead_range: float, res: PassResult) -> dict[str, int] | None:
    """Say how many channels kept s = 1 because a side's range is (near) zero, and in which pairs (returned for
    the details; None: no such channel)."""
    pairs = {state.pairs[i].label: n for i, n in enumerate(state.dead) if n}
    if not pairs:
        return None
    res.notes.append(
        f"{sum(pairs.values())} channel(s) in {len(pairs)} pair(s) left at scale 1: their weight range in one "
        f"layer is 0 or below {dead_range:g} x that layer's largest (dead or unused channel; sqrt(r1/r2) would be "
        "extreme and balance nothing; option `dead_range`)"
    )
    return pairs


def _find_pairs(scopes: list[gs.Graph], selected: set[int] | None, res: PassResult) -> list[Pair]:
    pairs: list[Pair] = []
    for g in scopes:
        outputs = {id(t) for t in g.outputs}
        linear = {id(n): selected is None or id(n) in selected for n in g.nodes if n.op in _LINEAR}
        for node in g.nodes:
            if id(node) not in linear or not linear[id(node)]:
                continue
            try:
                pairs.append(find_pair(as_linear(node), outputs, linear))
            except NoSecondLayer:
                continue  # a model's last layer: nothing follows it, nothing to report
            except NoMatch as refusal:
                res.skip(node.name, refusal)
    return pairs


class _Equalizer:
    """Layer weights stay the graph's arrays: each carries float64 factors per output and input channel (a middle
    layer belongs to two pairs), applied block by block when ranges are read and once at `write_back`, so memory
    is O(channels) plus one block, not a float64 copy of every weight. Biases and shifts (small) are float64."""

    def __init__(self, pairs: list[Pair], cfg: EqualizeWeightsConfig) -> None:
        self.pairs = pairs
        self.cfg = cfg
        self.last_change = 0.0  # the largest |ln s| of the last round (`iterate`)
        self.values: dict[int, np.ndarray] = {}  # biases and shifts
        self.tensors: dict[int, gs.Tensor] = {}
        self.layers: dict[int, LinearLayer] = {}  # weight tensor id -> its layer
        self.factors: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # weight id -> (out factor, in factor)
        # weight id -> [out ranges, in ranges, out valid, in valid]: a factor change on one side scales that side's
        # ranges exactly (the factor is uniform along it) and only stales the other side, so a layer that is only
        # ever first (or only second) in its pairs is read once; only middle layers of chains are re-read
        self._cache: dict[int, list[Any]] = {}
        self._arrays: dict[int, np.ndarray] = {}  # weight id -> the graph's array (read-only until write_back)
        # bias/shift id -> (channel axis, rank) and the 1/s factors of the steps so far, applied at the end
        self._layouts: dict[int, tuple[int, int]] = {}
        self._divisors: dict[int, list[np.ndarray]] = {}
        self.initial: list[tuple[float, float]] = []
        self.dead: list[int] = []  # per pair: channels left at s = 1 because a side's range is (near) zero
        for p in pairs:
            for layer in [p.first, *p.second]:
                key = id(layer.weight)
                if key not in self.layers:
                    w = self._weight(key, layer.weight)
                    self.layers[key] = layer
                    self.factors[key] = (np.ones(layer.out_channels(w)), np.ones(layer.in_channels(w)))
            layouts = [(p.first.bias, -1, None), *p.shifts]
            for t, axis, rank in layouts:
                if t is not None and id(t) not in self.values:
                    value = const_value(t)
                    assert value is not None
                    self.values[id(t)] = value.astype(np.float64)
                    self.tensors[id(t)] = t
                    self._layouts[id(t)] = (axis, max(value.ndim, 1) if rank is None else rank)
                    self._divisors[id(t)] = []
            self.initial.append(self._spread(p))
            self.dead.append(int(np.count_nonzero(dead_channels(*self._ranges(p), cfg.dead_range))))
        self.cumulative = [np.ones(len(self.factors[id(p.first.weight)][0])) for p in pairs]

    def _weight(self, key: int, tensor: gs.Tensor | None = None) -> np.ndarray:
        if tensor is not None:
            self.tensors[key] = tensor
            value = const_value(tensor)
            assert value is not None
            self._arrays[key] = value
        return self._arrays[key]

    def _layer_ranges(self, key: int, side: int) -> np.ndarray:
        """Output (``side`` 0) or input (1) channel ranges of a weight with its factors applied."""
        c = self._cache.get(key)
        if c is None or not c[2 + side]:
            out_r, in_r = self.layers[key].scaled_ranges(self._weight(key), *self.factors[key])
            c = self._cache[key] = [out_r, in_r, True, True]
        return np.asarray(c[side])

    def _rescaled(self, key: int, side: int, factor: np.ndarray) -> None:
        """The factors of ``side`` were multiplied by ``factor``: that side's ranges scale by it exactly
        (max_j |f_i w_ij g_j| = f_i max_j |w_ij g_j|), the other side's must be read again."""
        c = self._cache.get(key)
        if c is not None:
            if c[2 + side]:
                c[side] = c[side] * factor
            c[3 - side] = False

    def _ranges(self, p: Pair) -> tuple[np.ndarray, np.ndarray]:
        r1 = self._layer_ranges(id(p.first.weight), 0)
        r2 = np.max([self._layer_ranges(id(s.weight), 1) for s in p.second], axis=0)
        return r1, r2

    def _spread(self, p: Pair) -> tuple[float, float]:
        """Ratio of the largest to the smallest nonzero channel range, for layer 1 and layer 2."""
        out = []
        for r in self._ranges(p):
            nz = r[r > 0]
            out.append(float(nz.max() / nz.min()) if nz.size else 1.0)
        return out[0], out[1]

    def iterate(self) -> tuple[int, bool]:
        """Rounds over the pairs until no channel moves by more than tolerance / 10; (rounds, converged).

        Rounds sweep forward and backward in turn (a chain then converges in far fewer rounds), and a pair whose
        weights no other pair touched since it was equalized is not recomputed (its scales would be 1). Each step
        is a few numpy calls on per-channel vectors: the biases and shifts, which no range depends on, are scaled
        once at the end (`_scale_values`).
        """
        cfg = self.cfg
        version: dict[int, int] = dict.fromkeys(self.layers, 0)
        seen: list[tuple[int, ...] | None] = [None] * len(self.pairs)
        plan = [(i, [self._divisors[id(t)] for t in (p.first.bias, *(c for c, _, _ in p.shifts)) if t is not None],
                 (id(p.first.weight), *(id(x.weight) for x in p.second))) for i, p in enumerate(self.pairs)]
        # a scale at a clip bound has |ln s| >= |ln bound|: below half of that no scale can be clipped
        near = 0.5 * min(-math.log(cfg.min_scale), math.log(cfg.max_scale))
        for k in range(cfg.iterations):
            worst = 0.0
            for i, divisors, keys in plan if k % 2 == 0 else reversed(plan):
                if seen[i] == tuple(version[key] for key in keys):
                    continue
                r1 = self._layer_ranges(keys[0], 0)
                ins = [self._layer_ranges(key, 1) for key in keys[1:]]
                r2 = ins[0] if len(ins) == 1 else np.max(ins, axis=0)
                s = cle_scales(r1, r2, cfg.min_scale, cfg.max_scale, cfg.dead_range)
                change = log_change(s)
                worst = max(worst, change)
                if change > 0:
                    self._apply(keys, divisors, s)
                    self.cumulative[i] *= s
                    for key in keys:
                        version[key] += 1
                clipped = change >= near and bool(np.any(s <= cfg.min_scale) or np.any(s >= cfg.max_scale))
                seen[i] = None if clipped else tuple(version[key] for key in keys)
            self.last_change = worst
            if worst <= cfg.tolerance / 10:
                self._scale_values()
                return k + 1, True
        self._scale_values()
        return cfg.iterations, False

    def _apply(self, keys: tuple[int, ...], divisors: list[list[np.ndarray]], s: np.ndarray) -> None:
        """Move ``s`` across the pair with weights ``keys`` (first, seconds); ``divisors``: its bias' and shifts'."""
        inv = 1.0 / s
        self.factors[keys[0]][0][:] *= inv  # W1[i] /= s_i
        self._rescaled(keys[0], 0, inv)
        for pending in divisors:  # b1[i] /= s_i and the shifts on the way: at the end (`_scale_values`)
            pending.append(inv)
        for key in keys[1:]:
            self.factors[key][1][:] *= s  # W2[:, i] *= s_i
            self._rescaled(key, 1, s)

    def _scale_values(self) -> None:
        """Divide every bias and shift by its pairs' scales, in the order the rounds applied them: one product
        over the stacked factors per constant, ``((b · f1) · f2) · ...`` as a step-by-step update computes it."""
        for key, factors in self._divisors.items():
            if not factors:
                continue
            axis, rank = self._layouts[key]
            first = scale_const_per_channel(self.values[key], factors[0], axis, rank)
            if first is None:
                raise NoMatch(f"constant {self.tensors[key].name!r} of shape {self.values[key].shape} is not per "
                              "channel")
            if len(factors) > 1:
                pos, c = axis % rank, factors[0].size
                view = (1,) * (first.ndim - (rank - pos)) + (c,) + (1,) * (rank - 1 - pos)
                rest = np.stack(factors[1:]).reshape((len(factors) - 1, *view))
                stacked = np.concatenate([first[None], np.broadcast_to(rest, (len(factors) - 1, *first.shape))])
                first = np.multiply.reduce(stacked, axis=0)  # left to right, one factor at a time
            self.values[key] = first
            factors.clear()

    def describe(self, i: int) -> EqualizedPair:
        """Report of pair ``i``: scale range and the channel-range spread of both layers before/after."""
        p, s = self.pairs[i], self.cumulative[i]
        before, after = self.initial[i], self._spread(p)
        return EqualizedPair(pair=p.label, scale=(round(float(s.min()), 6), round(float(s.max()), 6)),
                             spread_before=(round(before[0], 3), round(before[1], 3)),
                             spread_after=(round(after[0], 3), round(after[1], 3)))

    def write_back(self) -> None:
        """Cast every touched constant back to its dtype and store it (names kept). Weights are computed block by
        block into a new array; the replaced constant is pointed at it so the old array is freed now (the detached
        constant itself waits for the cyclic collector), keeping one weight in flight."""
        for key, tensor in self.tensors.items():
            old = const_value(tensor)
            assert old is not None
            if key in self.layers:
                out_f, in_f = self.factors[key]
                if np.all(out_f == 1.0) and np.all(in_f == 1.0):
                    continue
                new = self.layers[key].scaled(old, out_f, in_f)
            else:
                new = self.values[key].astype(old.dtype)
            del old
            renew_const(tensor, new)
            if isinstance(tensor, gs.Constant):
                tensor.values = new
