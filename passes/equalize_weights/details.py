"""What ``equalize_weights`` reports in ``PassResult.details`` (typed, `qgraph.PassDetails`)."""

from __future__ import annotations

from dataclasses import dataclass

from qgraph import PassDetails


@dataclass(frozen=True)
class EqualizedPair(PassDetails):
    """One equalized layer pair: its label, the range of its per-channel scales and the channel-range spread
    (max/min over channels) of both layers before and after."""

    pair: str
    scale: tuple[float, float]
    spread_before: tuple[float, float]
    spread_after: tuple[float, float]


@dataclass(frozen=True)
class EqualizeWeightsDetails(PassDetails):
    """The pairs found, the rounds run and whether they converged, the pairs that moved, and the channels left at
    scale 1 per pair (None: none). Without any pair, only ``pairs`` (0) is reported."""

    pairs: int
    rounds: int | None = None
    converged: bool | None = None
    equalized: list[EqualizedPair] | None = None
    dead_channels: dict[str, int] | None = None
