"""How far a built-in metric's score could move on another set of as many samples: a bootstrap interval.

A task metric measured on a few hundred images is one draw. A detector's F1 moves by a detection at a time, and
the detections whose score sits just above the threshold flip under any small change, so two INT8 models 0.02
apart may not differ at all (YOLOv8n on 160 held-out images: F1 0.956 and 0.982 for two models whose F1 on 640
images is 0.974 and 0.979). The interval says how much of a difference the data can show.

Percentile bootstrap over samples (Efron): ``rounds`` draws of S samples with replacement (seeded, so the same
scores give the same interval); each draw sums the family's per-sample counts (`Family.counts`: true positives,
predictions and truths per image; exact strings and edits per line; agreeing rows) and computes the field from the
sums (`Family.pooled`, the formulas ``compare`` uses), and the interval is the central ``level`` share of those
values. A draw is one matrix product, not one ``compare``, so an interval costs about one scoring. Fields that pool
no per-sample counts (mAP, cosine and SQNR over whole arrays) have none.

When no sample differs (every draw gives the same score, say F1 1.0), the bootstrap says nothing: 73 detections
that all agree do not show a flip rate below 1 in 73. The bound is then the rule of three: ``-ln(tail)`` failures
(3.7 for the 2.5 % tail of a 95 % interval) could go unseen with that probability, so the worse end is the score
with that many failures of the worst kind added to the summed counts (`Family.failures`: a lost or an extra
detection, a misread line, a disagreeing row). PicoDet's 73 agreeing detections: F1 0.974-1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qgraph.metrics.family import Pooled

#: Draws per interval; the 2.5 % and 97.5 % quantiles of 1,000 draws move by about 0.1 of the interval's width.
ROUNDS = 1000
#: Weights entries per block of draws (rounds x samples), bounding the memory at ~64 MB whatever the sample count.
_BLOCK = 8_000_000


@dataclass(frozen=True)
class Interval:
    """The central ``level`` share of a score's bootstrap distribution over ``samples`` samples."""

    low: float
    high: float
    level: float
    samples: int
    #: No sample differed: the worse end is the rule-of-three bound, not a bootstrap quantile.
    unseen: float = 0.0

    def describe(self) -> str:
        """E.g. ``95% interval 0.9620-0.9930 over 160 samples``."""
        text = f"{self.level:.0%} interval {self.low:.4f}-{self.high:.4f} over {self.samples} samples"
        if self.unseen:
            text += f" (no sample differed: the bound is what {self.unseen:.1f} unseen failures would give)"
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"low": self.low, "high": self.high, "level": self.level, "samples": self.samples,
                "unseen_failures": self.unseen}


def bootstrap(counts: np.ndarray, pooled: Pooled, field: str, level: float = 0.95, rounds: int = ROUNDS,
              seed: int = 0, failures: Sequence[Sequence[float]] = (), higher_is_better: bool = True
              ) -> Interval | None:
    """The percentile bootstrap interval of ``field`` from per-sample ``counts`` ``[S, k]`` (None: no sample);
    when every draw agrees, the rule-of-three bound from ``failures`` (count deltas of one failure of each kind)."""
    rows = np.asarray(counts, np.float64)
    samples = len(rows)
    if not samples:
        return None
    rng = np.random.default_rng(seed)
    per_block = max(1, _BLOCK // samples)
    values = []
    for start in range(0, rounds, per_block):
        weights = rng.multinomial(samples, np.full(samples, 1.0 / samples), size=min(per_block, rounds - start))
        values.append(np.asarray(pooled(weights @ rows)[field], np.float64))
    drawn = np.concatenate(values)
    tail = (1.0 - level) / 2.0
    low, high = (float(v) for v in np.quantile(drawn, [tail, 1.0 - tail]))
    if low != high or not failures:
        return Interval(low, high, level, samples)
    unseen = -math.log(tail)
    sums = rows.sum(axis=0)
    worst = [float(pooled(np.maximum(sums + unseen * np.asarray(d, np.float64), 0.0))[field]) for d in failures]
    if higher_is_better:
        return Interval(min(min(worst), low), high, level, samples, unseen)
    return Interval(low, max(max(worst), high), level, samples, unseen)


def samples_to_show(counts: np.ndarray, pooled: Pooled, field: str, threshold: float,
                    failures: Sequence[Sequence[float]], higher_is_better: bool = True, level: float = 0.95
                    ) -> tuple[float, int | None]:
    """For a model that agrees with the truth on every one of these samples (``counts`` of the truth against
    itself): the worse end of its interval (the rule-of-three bound), and how many samples of this kind would put
    that end at ``threshold`` (None: these already do; 0: none would, e.g. a threshold at the field's maximum).

    More samples of the same kind scale the summed counts; the bound is monotone in that scale, so doubling then
    bisecting finds the smallest count."""
    rows = np.asarray(counts, np.float64)
    samples, sums = len(rows), rows.sum(axis=0)
    unseen = -math.log((1.0 - level) / 2.0)

    def bound(scale: float) -> float:
        worst = [float(pooled(np.maximum(scale * sums + unseen * np.asarray(d, np.float64), 0.0))[field])
                 for d in failures]
        return min(worst) if higher_is_better else max(worst)

    def shown(scale: float) -> bool:
        value = bound(scale)
        return value >= threshold if higher_is_better else value <= threshold

    here = bound(1.0)
    if not samples or not failures or shown(1.0):
        return here, None
    high = 2.0
    while not shown(high):
        if high > 1e6:
            return here, 0
        high *= 2.0
    low = high / 2.0
    while (high - low) * samples > 0.5:
        mid = (low + high) / 2.0
        low, high = (low, mid) if shown(mid) else (mid, high)
    return here, math.ceil(high * samples)


def sqnr_change(before: np.ndarray, after: np.ndarray, level: float = 0.95, rounds: int = ROUNDS, seed: int = 0
                ) -> tuple[float, float]:
    """The ``level`` interval of a change in the lowest SQNR over output parts, from per-sample sums ``[S, parts,
    2]`` of ``(Σ r², Σ (c - r)²)`` before and after it on the same samples: paired draws (one resampling of the
    samples for both), each giving ``min_p SQNR_after - min_p SQNR_before`` in dB. A change from exact (no error)
    to some error is -inf; two exact models differ by 0."""
    b, a = np.asarray(before, np.float64), np.asarray(after, np.float64)
    samples = len(b)
    if not samples:
        return 0.0, 0.0
    weights = np.random.default_rng(seed).multinomial(samples, np.full(samples, 1.0 / samples), size=rounds)

    def lowest_db(sums: np.ndarray) -> np.ndarray:
        signal, noise = weights @ sums[:, :, 0], weights @ sums[:, :, 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            db = np.where(noise > 0, 10.0 * np.log10(np.maximum(signal, 1e-300) / np.where(noise > 0, noise, 1.0)),
                          np.inf)
        return np.asarray(db.min(axis=1))

    lo, hi = lowest_db(b), lowest_db(a)
    with np.errstate(invalid="ignore"):
        change = np.where(np.isinf(lo) & np.isinf(hi) & (lo == hi), 0.0, hi - lo)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(change, [tail, 1.0 - tail], method="inverted_cdf")  # drawn values: -inf stays -inf
    return float(low), float(high)
