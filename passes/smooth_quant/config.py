"""Options of ``smooth_quant``."""

from __future__ import annotations

from pydantic import Field, model_validator

from qgraph import NodeSelector, PassConfig


class SmoothQuantConfig(PassConfig):
    """Options of `SmoothQuant`."""

    nodes: NodeSelector = Field(
        default_factory=NodeSelector,
        description="MatMul/Gemm layers (constant weight) whose input may be smoothed; every reader of one input "
        "tensor must be selected for it to be smoothed.",
    )
    alpha: float = Field(
        default=0.5, ge=0.0, le=1.0,
        description="Migration strength α in s_j = max|X_j|^α / max|W_j|^(1-α): 0 leaves activations alone, 1 moves "
        "all of their range into the weights.",
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
        if self.min_scale > self.max_scale:
            raise ValueError(f"min_scale ({self.min_scale}) must not exceed max_scale ({self.max_scale})")
        return self
