"""What ``fuse_batchnorm`` reports in ``PassResult.details`` (typed, `qgraph.PassDetails`)."""

from __future__ import annotations

from dataclasses import dataclass

from qgraph import PassDetails


@dataclass(frozen=True)
class FuseBatchNormDetails(PassDetails):
    """The BatchNorms seen, how many were folded into the preceding / following op (by its op type), rewritten as
    Mul + Add or kept, over how many scopes."""

    batchnorm_seen: int
    folded_into_preceding: dict[str, int]
    folded_into_following: dict[str, int]
    rewritten_to_mul_add: int
    kept: int
    scopes: int
