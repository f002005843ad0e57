"""What ``smooth_quant`` reports in ``PassResult.details`` (typed, `qgraph.PassDetails`)."""

from __future__ import annotations

from dataclasses import dataclass

from qgraph import PassDetails


@dataclass(frozen=True)
class SmoothedGroup(PassDetails):
    """One smoothed input: the tensor, the layers reading it, where 1/s went (the producer's label or "inserted
    Mul"), the range of s, the activation and weight outlier ratios (max/median over channels) before and after,
    and the α chosen."""

    input: str
    layers: list[str]
    absorbed_by: str
    scale: tuple[float, float]
    activation_max_over_median: tuple[float, float]
    weight_max_over_median: tuple[float, float]
    alpha: float


@dataclass(frozen=True)
class SmoothQuantDetails(PassDetails):
    """The groups found and the ones smoothed, in graph order."""

    groups: int
    smoothed: list[SmoothedGroup]
