"""u8 x s8 int16 saturation on x86 without VNNI: the pass's analysis of its own quantized weights.

The arithmetic (``VPMADDUBSW``'s saturating int16 pair sums, measured against onnxruntime's AVX2 kernels) and the
pair bounds are the engine's (`qgraph.runtime.kernels.pairs`). With 7-bit weights (``reduce_range``, w in [-64, 63]) the
worst pair is 255 x 64 x 2 = 32640, which always fits.

`analyze` bounds every pair of every output channel of every quantized layer over the activation codes the
calibrated range can produce, ``a in [q(rmin), q(rmax)]``: ``max = sum_j max(lo*w_j, hi*w_j)`` and likewise the
min; a pair can overflow when its bound leaves [-32768, 32767]. Pairs follow the kernel's reduction order: the
K axis of MatMul/Gemm, (kh, kw, c) for Conv (onnxruntime runs u8 convolutions channels-last).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_graphsurgeon as gs

from qgraph import PassResult
from qgraph.quant.math import QuantDtype, dtype_range
from qgraph.runtime.kernels.pairs import INT16_MAX, INT16_MIN, kernel_rows, pair_bounds

from .emit import ActParams
from .pairsafe import ChannelCodes, KernelCodes, PairSafeLayer, kernel_codes
from .units import Plan, label
from .weights import QuantizedWeight


@dataclass(frozen=True)
class LayerSaturation:
    """Saturation risk of one layer."""

    node: str
    op: str
    weight: str
    activation_codes: tuple[int, int]
    channels: int
    channels_at_risk: int
    pairs: int
    pairs_at_risk: int
    worst_pair_sum: int
    #: What bounded the codes: ``tensor`` (the input's range) or ``calibrated`` (each input channel's codes).
    bound: str = "tensor"

    @property
    def at_risk(self) -> bool:
        """Whether any pair can leave the int16 range."""
        return self.pairs_at_risk > 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "node": self.node,
            "op": self.op,
            "weight": self.weight,
            "activation_codes": list(self.activation_codes),
            "channels_at_risk": self.channels_at_risk,
            "channels": self.channels,
            "pairs_at_risk": self.pairs_at_risk,
            "pairs": self.pairs,
            "worst_pair_sum": self.worst_pair_sum,
            "codes": self.bound,
        }


def _rows(w: QuantizedWeight) -> npt.NDArray[np.int32] | None:
    """The weight as (output channels, K) in the kernel's reduction order
    (`qgraph.runtime.kernels.pairs.kernel_rows`)."""
    return kernel_rows(w.values, w.op, w.transposed)


def analyze_layer(w: QuantizedWeight, codes: tuple[int, int],
                  per_channel: KernelCodes | None = None) -> LayerSaturation | None:
    """Saturation risk of one quantized layer whose activation codes span ``codes`` (``per_channel``: each K
    position's codes instead, `pairsafe.kernel_codes`)."""
    rows = _rows(w)
    if rows is None or np.asarray(w.values).dtype != np.int8:
        return None
    lo, hi = codes
    top, bottom = pair_bounds(rows, *(per_channel if per_channel is not None else (lo, hi)))
    risky = (top > INT16_MAX) | (bottom < INT16_MIN)
    tmax = int(top.max()) if top.size else 0
    bmin = int(bottom.min()) if bottom.size else 0
    return LayerSaturation(
        node=w.node,
        op=w.op,
        weight=w.name,
        activation_codes=(int(lo), int(hi)),
        channels=int(rows.shape[0]),
        channels_at_risk=int(risky.any(axis=1).sum()),
        pairs=int(risky.size),
        pairs_at_risk=int(risky.sum()),
        worst_pair_sum=tmax if tmax >= -bmin else bmin,
        bound="tensor" if per_channel is None else "calibrated",
    )


def channel_codes(plan: Plan, params: dict[str, ActParams],
                  channels: Mapping[str, tuple[npt.NDArray[Any], npt.NDArray[Any]]]) -> dict[str, ChannelCodes]:
    """Per layer input (``channels``: its observed per-channel float min and max): the raw codes each channel
    takes on the calibration data once quantized with its ``params``, the zero point (what padding reads)
    included; s8 codes shifted to u8 as the kernels shift them (`qgraph.runtime.kernels.pairs`)."""
    out: dict[str, ChannelCodes] = {}
    for tensor, (lo, hi) in channels.items():
        act = params.get(plan.tensors.get(tensor, ""))
        if act is None or act.dtype not in (QuantDtype.UINT8, QuantDtype.INT8):
            continue
        shift = 128 if act.dtype == QuantDtype.INT8 else 0
        zp = act.zero_point + shift
        out[tensor] = (np.minimum(act_codes(lo, act, low=True) + shift, zp), np.maximum(act_codes(hi, act) + shift, zp))
    return out


def act_codes(x: npt.ArrayLike, act: ActParams, low: bool = False) -> npt.NDArray[np.int64]:
    """The codes of ``x`` quantized with ``act`` (NaN: the grid's end on that side)."""
    qmin, qmax = dtype_range(act.dtype)
    q = np.rint(np.asarray(x, np.float64) / act.scale) + act.zero_point
    codes: npt.NDArray[np.int64] = np.clip(np.nan_to_num(q, nan=qmin if low else qmax), qmin, qmax).astype(np.int64)
    return codes


def analyze(weights: list[QuantizedWeight], codes: dict[str, tuple[int, int]],
            per_channel: dict[str, tuple[gs.Node, ChannelCodes]] | None = None) -> list[LayerSaturation]:
    """Analyze every layer whose node has activation codes; returns all results (``at_risk`` tells).
    ``per_channel``: by node, the node and its input channels' codes (`pairsafe.kernel_codes` lays them out)."""
    out = []
    for w in weights:
        c = codes.get(w.node)
        if c is None:
            continue
        node_codes = (per_channel or {}).get(w.node)
        laid = kernel_codes(node_codes[0], np.shape(w.values), node_codes[1]) if node_codes is not None else None
        res = analyze_layer(w, c, laid)
        if res is not None:
            out.append(res)
    return out


def saturation_details(plan: Plan, params: dict[str, ActParams], weights: list[QuantizedWeight],
                       channel_codes: dict[str, ChannelCodes] | None = None) -> dict[str, Any]:
    """The report of the u8 x s8 saturation analysis: per weighted unit with u8 activations, its input codes against
    its weights (``WeightQuantizer.weights``); ``channel_codes``: the calibrated codes of each input channel,
    which ``saturation_codes: calibrated`` bounded the pairs with (`pairsafe`): the same bound here."""
    codes: dict[str, tuple[int, int]] = {}
    per_channel: dict[str, tuple[gs.Node, ChannelCodes]] = {}
    for u in plan.units:
        if u.kind != "weighted" or not u.act_inputs:
            continue
        root = plan.tensors.get(u.act_inputs[0])
        p = params.get(root or "")
        if p is None or p.dtype != QuantDtype.UINT8:
            continue
        codes[label(u.node)] = (int(act_codes(p.rmin, p, low=True)), int(act_codes(p.rmax, p)))
        got = (channel_codes or {}).get(u.act_inputs[0])
        if got is not None:
            per_channel[label(u.node)] = (u.node, got)
    results = analyze(weights, codes, per_channel)
    risky = [r.to_dict() for r in results if r.at_risk]
    return {
        "kernel": "u8 x s8 VPMADDUBSW (AVX2 without VNNI)",
        "layers_analyzed": len(results),
        "layers_at_risk": risky,
        "advice": ("set saturation: avoid (raises the scale of just the channels at risk), weights.reduce_range: true "
                   "(7-bit weights everywhere) or run on a VNNI CPU") if risky else "",
    }


def pair_safe_decisions(layers: list[PairSafeLayer], res: PassResult, active: bool, at: int,
                        calibrated: bool = False) -> list[dict[str, Any]] | None:
    """One decision (inserted at ``at``) for the layers `saturation: avoid` rescaled (worst first); returns every
    layer for the details (None when `saturation: avoid` is not active). ``calibrated``: the pairs were bounded
    by each input channel's calibrated codes (`pairsafe`), which the line says."""
    if not active:
        return None
    pair_safe = [layer.to_dict() for layer in layers]
    bound = (" for the codes each input channel took on the calibration data (saturation_codes: calibrated; codes "
             "beyond those on other inputs can still saturate a pair: `qgraph check` counts them)" if calibrated
             else " for any activation code")
    if not layers:
        res.decisions.insert(at, "saturation: avoid: no u8×s8 layer has a pair of weight codes that could exceed "
                                 f"int16{bound}: every layer keeps full 8-bit weights")
        return pair_safe
    worst = sorted(layers, key=lambda la: la.sqnr_after - la.sqnr_before)
    channels = sum(la.channels for la in layers)
    of = sum(la.of for la in layers)
    loss = [la.sqnr_before - la.sqnr_after for la in layers]
    shown = "; ".join(f"{la.node}: {la.channels} of {la.of} channels x{la.max_factor:.2f} max, weight SQNR "
                      f"{la.sqnr_before:.1f} -> {la.sqnr_after:.1f} dB" for la in worst[:3])
    more = f" (+{len(layers) - 3} more layers in the report)" if len(layers) > 3 else ""
    res.decisions.insert(at,
        f"saturation: avoid: {len(layers)} layer(s) had u8×s8 weight pairs that could exceed int16{bound}: the "
        f"scales of their {channels} channel(s) at risk (of {of}) raised (weight SQNR -{max(loss):.2f} dB at worst, "
        f"-{float(np.median(loss)):.2f} dB median; every other channel and layer keeps full 8-bit weights): "
        f"{shown}{more}")
    return pair_safe
