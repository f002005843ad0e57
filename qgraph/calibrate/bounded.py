"""Known ranges: outputs of saturating ops (probabilities, gates) are bounded whatever the data.

``Sigmoid``, ``Softmax`` and ``HardSigmoid`` lie in ``[0, 1]``, ``Tanh`` in ``[-1, 1]``.  A calibrated range
can only be narrower, and for these tensors narrower is the wrong bet: their rare large values are the
signal, not outliers (a detector's confident scores, the dominant attention weight, a fully open gate).
A percentile, MSE or entropy range clips exactly those values, and a minmax range clips the first
deployment value above what the calibration data reached.

Rule (:func:`bounded_range`), per side of the range, with ``B`` the analytic bound on that side:

* the observed extreme reaches at least ``REACH = 1/2`` of ``B`` (``max x >= B / 2``): the bound itself is
  used.  On the calibration data this costs less than one bit of resolution (``log2(B / max x) < 1``), and
  values up to the bound stay representable;
* otherwise (a 1000-way softmax whose largest probability is 0.01) the bound would cost ``log2(B / max x)``
  bits on every value, so the side keeps ``max(calibrated, observed)`` extreme: the observed extreme, never
  clipped, and no wider.

A bound of 0 (the low side of ``[0, 1]``) is always used: quantization extends every range to 0 anyway.
"""

from __future__ import annotations

#: Ops whose output range is known: ``op -> (low, high)``.
BOUNDED_OPS: dict[str, tuple[float, float]] = {
    "Sigmoid": (0.0, 1.0),
    "Softmax": (0.0, 1.0),
    "HardSigmoid": (0.0, 1.0),
    "Tanh": (-1.0, 1.0),
}

#: Fraction of the analytic bound the observed values must reach for the bound to be used.
REACH = 0.5

__all__ = ["BOUNDED_OPS", "REACH", "bounded_range"]


def bounded_range(
    op: str, observed: tuple[float, float], calibrated: tuple[float, float]
) -> tuple[float, float] | None:
    """The range of a bounded op's output (module docstring), or ``None`` when ``op`` is not bounded."""
    bounds = BOUNDED_OPS.get(op)
    if bounds is None:
        return None
    b_lo, b_hi = bounds
    o_lo, o_hi = observed
    c_lo, c_hi = calibrated
    lo = b_lo if b_lo == 0.0 or o_lo <= REACH * b_lo else min(c_lo, o_lo)
    hi = b_hi if o_hi >= REACH * b_hi else max(c_hi, o_hi)
    return max(lo, b_lo), min(hi, b_hi)
