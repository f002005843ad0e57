"""Options of ``fuse_batchnorm``."""

from __future__ import annotations

from pydantic import Field

from qgraph import PassConfig


class FuseBatchNormConfig(PassConfig):
    """Options of `FuseBatchNorm`."""

    into_preceding: bool = Field(
        default=True, description="Fold a BN into the Conv/ConvTranspose/Gemm/MatMul that produces its input."
    )
    include_matmul: bool = Field(
        default=True, description="Also fold into MatMul with a constant 2-D weight (adds a bias Add if needed)."
    )
    into_following: bool = Field(
        default=True, description="Fold a BN into the unpadded Conv / Gemm consuming its output."
    )
    standalone_to_mul_add: bool = Field(
        default=True, description="Rewrite an inference BN that cannot be folded into Mul + Add."
    )
    recurse_subgraphs: bool = Field(default=True, description="Also process If/Loop/Scan bodies.")
