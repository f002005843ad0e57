"""The corpus metrics of ``real_models.py`` as automatic-fallback targets (``auto.target: FILE:function>=GOAL``).

A target metric is called as ``function(outputs, references) -> float`` (``outputs[i]``: output ``i`` over every
evaluation sample, concatenated on axis 0; ``references``: the float model's, same layout), see
`qgraph.analysis.sensitivity.targets`. From the repository root::

    - pass: float_fallback
      auto: {target: "benchmarks/fallback_metrics.py:min_slice_sqnr>=30"}     # PicoDet: every slice >= 30 dB
      auto: {target: "benchmarks/fallback_metrics.py:top1_agreement>=0.98"}   # PP-LCNet: top-1 as float's

``sqnr:GOAL`` (built in) is the smallest SQNR over whole outputs; that is the PicoDet metric exactly, since each
of its slices (class scores or box distributions of one FPN level) is one output. ``min_slice_sqnr`` also cuts
outputs along their last axis (``SLICES``) for models whose outputs join several quantities.
"""

from __future__ import annotations

import numpy as np

#: Slices per output index: ``(start, stop)`` along the last axis; outputs not listed are one slice each.
SLICES: dict[int, list[tuple[int, int]]] = {}


def _sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    a, b = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    noise, signal = float(np.sum((a - b) ** 2)), float(np.sum(a * a))
    if not (np.isfinite(noise) and np.isfinite(signal)):
        return float("nan")  # NaN never reads as "no error"
    return float(10 * np.log10(max(signal, 1e-30) / max(noise, 1e-30)))


def min_slice_sqnr(outputs: list[np.ndarray], references: list[np.ndarray]) -> float:
    """Smallest SQNR (dB) over every output slice (``SLICES``, else whole outputs), as ``real_models.score``."""
    worst = float("inf")
    for i, (got, ref) in enumerate(zip(outputs, references, strict=True)):
        for start, stop in SLICES.get(i, [(0, ref.shape[-1] if ref.ndim else 1)]):
            cut = (..., slice(start, stop)) if ref.ndim else ...
            value = _sqnr_db(ref[cut], got[cut])
            if np.isnan(value):
                return value
            worst = min(worst, value)
    return worst


def top1_agreement(outputs: list[np.ndarray], references: list[np.ndarray]) -> float:
    """Share of samples whose top-1 class (argmax of output 0 per sample) is the float model's."""
    got = outputs[0].reshape(outputs[0].shape[0], -1)
    ref = references[0].reshape(references[0].shape[0], -1)
    if not np.all(np.isfinite(got)):
        return float("nan")
    return float(np.mean(got.argmax(1) == ref.argmax(1)))


def first_output_sqnr(outputs: list[np.ndarray], references: list[np.ndarray]) -> float:
    """SQNR (dB) of the first output only: a recurrent model's prediction without its state (silero-vad's speech
    probability, `bench_vad.py`)."""
    return _sqnr_db(references[0], outputs[0])
