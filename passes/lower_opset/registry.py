"""The adapter table: one entry per (op, version step) and per op that has to be decomposed.

A *step adapter* registered for ``(op, v)`` rewrites a node of ``op``-``v`` into nodes that mean the same at
opset ``v - 1`` (so the op lands on its previous version, or is replaced). The engine applies steps one at a
time and lowers whatever the step emitted recursively, so every adapter only has to know one version step.

A *decomposition* registered for ``op`` replaces a node whose op does not exist at the target at all.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from .context import LowerContext

#: ``adapter(node, ctx, from_version) -> nodes valid at opset from_version - 1``.
StepAdapter = Callable[[onnx.NodeProto, LowerContext, int], list[onnx.NodeProto]]
#: ``decompose(node, ctx, opset) -> nodes`` (each node declares its own level through the context).
Decomposition = Callable[[onnx.NodeProto, LowerContext, int], list[onnx.NodeProto]]

STEPS: dict[tuple[str, int], tuple[str, StepAdapter]] = {}
DECOMPOSITIONS: dict[str, tuple[str, Decomposition]] = {}
#: Adapters for raising (op, v): node of op at version < v rewritten to mean the same at version v.
RAISE_STEPS: dict[tuple[str, int], tuple[str, StepAdapter]] = {}


def step(name: str, *pairs: tuple[str, int]) -> Callable[[StepAdapter], StepAdapter]:
    """Register ``fn`` as the adapter called ``name`` for each ``(op, from_version)`` in ``pairs``."""

    def deco(fn: StepAdapter) -> StepAdapter:
        for op, v in pairs:
            if (op, v) in STEPS:
                raise ValueError(f"duplicate step adapter for {op}-{v}")
            STEPS[(op, v)] = (name, fn)
        return fn

    return deco


def decomposition(name: str, *ops: str) -> Callable[[Decomposition], Decomposition]:
    """Register ``fn`` as the decomposition called ``name`` for each op in ``ops``."""

    def deco(fn: Decomposition) -> Decomposition:
        for op in ops:
            DECOMPOSITIONS[op] = (name, fn)
        return fn

    return deco


def raise_step(name: str, *pairs: tuple[str, int]) -> Callable[[StepAdapter], StepAdapter]:
    """Register a raising adapter for ``(op, to_version)``."""

    def deco(fn: StepAdapter) -> StepAdapter:
        for p in pairs:
            RAISE_STEPS[p] = (name, fn)
        return fn

    return deco
