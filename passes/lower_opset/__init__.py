"""Opset lowering and raising engine behind the ``lower_opset`` / ``raise_opset`` passes.

``lower_model(model, target)`` rewrites every node so the model is valid at ``target`` and computes the same
results, or raises a `LoweringError` listing every node that has no exact form there.
"""

from __future__ import annotations

from .adapters import load_adapters
from .engine import MIN_TARGET, LoweringError, LoweringResult, lower_model
from .wrapper import LowerOpset, LowerOpsetConfig

__all__ = [
    "MIN_TARGET",
    "LowerOpset",
    "LowerOpsetConfig",
    "LoweringError",
    "LoweringResult",
    "load_adapters",
    "lower_model",
]
