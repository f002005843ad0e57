"""Options of ``smooth_quant``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from qgraph import NodeSelector, PassConfig


class SmoothQuantConfig(PassConfig):
    """Options of `SmoothQuant`."""

    nodes: NodeSelector = Field(
        default_factory=NodeSelector,
        description="MatMul/Gemm layers (constant weight) whose input may be smoothed; every reader of one input "
        "tensor must be selected for it to be smoothed.",
    )
    alpha: float | Literal["auto"] = Field(
        default=0.5,
        description="Migration strength α in s_j = max|X_j|^α / max|W_j|^(1-α) (0..1: how much of the activations' "
        "range moves into the weights), or `auto`: per group, the α of `alpha_grid` (or no smoothing) whose INT8 "
        "error ||XW - Q(X/s)Q(sW)||² is smallest on sampled calibration rows.",
    )
    alpha_grid: tuple[float, ...] = Field(
        default=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8), min_length=1, description="Candidates of `alpha: auto`."
    )
    sample_rows: int = Field(
        default=512, ge=16, le=1_000_000, description="Rows of each input X kept (seeded) to score `alpha: auto`."
    )
    weights_per_channel: bool = Field(
        default=True,
        description="How the later insert_qdq quantizes weights (per output column or per tensor), for `auto`.",
    )
    min_scale: float = Field(default=1e-5, gt=0, description="Lower clip of s_j.")
    max_scale: float = Field(default=1e5, gt=0, description="Upper clip of s_j.")
    tolerance: float = Field(
        default=1e-3, gt=0, lt=1,
        description="Leave a group alone when every |ln s_j| <= tolerance (a second run finds s = 1 and does nothing).",
    )
    insert_mul: bool = Field(
        default=False,
        description="Where the producer of X cannot absorb 1/s (a residual Add, a graph input, GELU, a tensor "
        "with other readers), insert a float Mul(X, 1/s) in front of the layers instead of skipping. The Mul "
        "stays float unless insert_qdq's op_types include Mul.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> SmoothQuantConfig:
        if isinstance(self.alpha, float) and not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1] or 'auto', got {self.alpha}")
        if any(not 0.0 <= a <= 1.0 for a in self.alpha_grid):
            raise ValueError(f"alpha_grid values must be in [0, 1], got {list(self.alpha_grid)}")
        if self.min_scale > self.max_scale:
            raise ValueError(f"min_scale ({self.min_scale}) must not exceed max_scale ({self.max_scale})")
        return self
