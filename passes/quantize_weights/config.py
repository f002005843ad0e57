"""Options of ``quantize_weights``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from qgraph import NodeSelector, PassConfig

Algorithm = Literal["rtn", "hqq", "gptq", "awq"]
#: Algorithms that need calibration data (layer input statistics).
DATA_ALGORITHMS = ("gptq", "awq")


class QuantizeWeightsConfig(PassConfig):
    """Options of `QuantizeWeights` (block-wise weight-only quantization of MatMul/Gemm weights)."""

    nodes: NodeSelector = Field(
        default_factory=NodeSelector,
        description="MatMul/Gemm layers (constant 2-D weight) to quantize; others keep float weights.",
    )
    bits: Literal[4, 8] = Field(default=4, description="Bits per weight code.")
    block_size: int = Field(
        default=32, description="Input channels sharing one scale (16..256, a power of two)."
    )
    symmetric: bool = Field(
        default=False,
        description="Symmetric codes (zero point 2^(bits-1), none stored) instead of a zero point per block.",
    )
    signed: bool = Field(
        default=True,
        description="qdq format: store int4/int8 codes (else uint4/uint8 with zero points). MatMulNBits always "
        "stores unsigned codes; symmetric signed codes are the same numbers shifted by 2^(bits-1).",
    )
    format: Literal["matmul_nbits", "qdq"] = Field(
        default="matmul_nbits",
        description="`matmul_nbits`: onnxruntime's com.microsoft.MatMulNBits (CPU/GPU kernels); `qdq`: a blocked "
        "DequantizeLinear (opset 21, raised automatically) feeding the float MatMul/Gemm.",
    )
    accuracy_level: Literal[0, 1, 2, 3, 4] = Field(
        default=4,
        description="MatMulNBits accuracy_level: the minimum precision of A in the kernel (0 unset, 1 fp32, "
        "2 fp16, 3 bf16, 4 int8: A quantized per block at run time, fastest on CPU).",
    )
    algorithm: Algorithm = Field(
        default="rtn",
        description="rtn: round to nearest with a per-block clip search; hqq: data-free half-quadratic "
        "scale/zero optimisation; gptq: Hessian-based error compensation (calibration data); awq: "
        "activation-aware per-input-channel scaling folded upstream (calibration data). Formulas: "
        "docs/weight_only.md.",
    )
    clip_ratios: tuple[float, ...] = Field(
        default=tuple(round(1.0 - 0.025 * i, 3) for i in range(17)),
        min_length=1,
        description="Clip ratios of the block range tried per block (the least squared error wins); (1.0,) "
        "turns the search off.",
    )
    keep_8bit: NodeSelector | None = Field(
        default=None,
        description="Selected layers quantized with 8-bit codes instead (sensitive layers: the first/last).",
    )
    keep_8bit_budget: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="Fraction of the selected weights (by count) that may be kept 8-bit, the layers whose 4-bit "
        "weight alone costs the most output error first (measured on calibration samples; without data, by "
        "relative weight error). 0.2 keeps 4-bit block-32 MatMul weights under 0.2x their float bytes.",
    )
    hqq_iterations: int = Field(default=20, ge=1, le=200, description="hqq: proximal iterations per weight.")
    hqq_lp_norm: float = Field(default=0.7, gt=0, le=1, description="hqq: p of the sparsity-promoting l_p error.")
    damping: float = Field(
        default=0.01, gt=0, lt=1, description="gptq: λ = damping · mean(diag H) added to the Hessian diagonal."
    )
    gptq_batch: int = Field(default=128, ge=1, description="gptq: columns per lazy batch update.")
    act_order: bool = Field(
        default=False,
        description="gptq: quantize input channels by decreasing Hessian diagonal (block scales are fixed "
        "beforehand so the stored layout stays sequential).",
    )
    time_budget_s: float | None = Field(
        default=None, gt=0,
        description="gptq: seconds for the GPTQ sweeps (after the calibration pass); layers not reached are "
        "quantized by rtn with the clip search weighted by E[x²] (reported).",
    )
    awq_grid: int = Field(default=20, ge=2, le=100, description="awq: α values tried in [0, 1).")

    @model_validator(mode="after")
    def _check(self) -> QuantizeWeightsConfig:
        bs = self.block_size
        if bs < 16 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two between 16 and 256 (16, 32, 64, 128, 256), got {bs}")
        if any(not 0.2 <= r <= 1.0 for r in self.clip_ratios):
            raise ValueError(f"clip_ratios must lie in [0.2, 1.0], got {list(self.clip_ratios)}")
        # an option given with a non-default value (a written-out example lists every default: not a mistake)
        set_ = {f for f in self.model_fields_set if getattr(self, f) != type(self).model_fields[f].default}
        if self.format == "qdq" and "accuracy_level" in set_:
            raise ValueError("accuracy_level is a MatMulNBits attribute: remove it or use `format: matmul_nbits`")
        own = {"hqq": ("hqq_iterations", "hqq_lp_norm"), "awq": ("awq_grid",),
               "gptq": ("damping", "gptq_batch", "act_order", "time_budget_s")}
        for algo, options in own.items():
            stray = [o for o in options if o in set_ and self.algorithm != algo]
            if stray:
                raise ValueError(f"{', '.join(stray)} only apply to `algorithm: {algo}` (the recipe says "
                                 f"`algorithm: {self.algorithm}`): remove them or set `algorithm: {algo}`")
        return self

    @property
    def needs_data(self) -> bool:
        """Whether the algorithm reads calibration data."""
        return self.algorithm in DATA_ALGORITHMS
