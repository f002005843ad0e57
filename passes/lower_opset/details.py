"""What ``lower_opset`` and ``raise_opset`` report in ``PassResult.details`` (typed, `qgraph.PassDetails`)."""

from __future__ import annotations

from dataclasses import dataclass

from qgraph import PassDetails


@dataclass(frozen=True)
class LowerOpsetDetails(PassDetails):
    """The opsets before and after, how often each adapter ran (``Op-version: adapter``, sorted) and how many
    nodes of each op type were rewritten (sorted)."""

    source_opset: int
    target_opset: int
    adapters: dict[str, int]
    ops: dict[str, int]


@dataclass(frozen=True)
class RaiseOpsetDetails(PassDetails):
    """The opsets before and after, how often each of qgraph's raising adapters ran, and the attributes the newer
    opset no longer has that were dropped (``node: attribute``)."""

    source_opset: int
    target_opset: int
    adapters: dict[str, int]
    dropped_attributes: list[str]
