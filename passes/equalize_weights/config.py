"""Options of ``equalize_weights``."""

from __future__ import annotations

from pydantic import Field, model_validator

from qgraph import NodeSelector, PassConfig


class EqualizeWeightsConfig(PassConfig):
    """Options of `EqualizeWeights`."""

    nodes: NodeSelector = Field(
        default_factory=NodeSelector,
        description="Conv/Gemm/MatMul layers that may be rescaled (both layers of a pair must be selected).",
    )
    iterations: int = Field(
        default=50, ge=1, le=10_000,
        description="At most this many rounds over all pairs (chains of 3+ layers need several to converge).",
    )
    tolerance: float = Field(
        default=1e-2, gt=0, lt=1,
        description=(
            "Leave the graph untouched when no channel would move by more than this (|ln s| <= tolerance); rounds "
            "stop once a round moves no channel by more than tolerance / 10."
        ),
    )
    min_scale: float = Field(default=1e-4, gt=0, description="Lower clip of each round's per-channel scale s_i.")
    max_scale: float = Field(default=1e4, gt=0, description="Upper clip of each round's per-channel scale s_i.")
    dead_range: float = Field(
        default=1e-6, ge=0, lt=1,
        description=(
            "A channel whose weight range on either side is below this times that layer's largest channel range "
            "(dead or unused: s = sqrt(r1/r2) would be extreme and equalize nothing) keeps s = 1; 0 only skips "
            "exact zeros."
        ),
    )
    recurse_subgraphs: bool = Field(default=True, description="Also equalize layers inside If/Loop/Scan bodies.")

    @model_validator(mode="after")
    def _ordered(self) -> EqualizeWeightsConfig:
        if self.min_scale > 1 or self.max_scale < 1 or self.min_scale > self.max_scale:
            raise ValueError(
                f"min_scale ({self.min_scale}) must be <= 1 <= max_scale ({self.max_scale}): s = 1 (no change) "
                "must stay reachable"
            )
        return self
