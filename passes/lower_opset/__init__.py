"""Opset lowering and raising engine behind the ``lower_opset`` / ``raise_opset`` passes.

``lower_model(model, target)`` rewrites every node so the model is valid at ``target`` and computes the same
results, or raises a `LoweringError` listing every node that has no exact form there.
"""

from __future__ import annotations

_LOADED = False


def load_adapters() -> None:
    """Import every adapter family so the registry is complete (idempotent)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from . import (  # noqa: F401
        attrs,
        bitwise,
        decompose,
        dtypes,
        misc,
        norm,
        pad_clip_split,
        reduce_dynamic,
        resize,
        restamp,
        softmax,
        widen,
    )


from .engine import MIN_TARGET, LoweringError, LoweringResult, lower_model  # noqa: E402
from .wrapper import LowerOpset, LowerOpsetConfig  # noqa: E402

__all__ = [
    "MIN_TARGET",
    "LowerOpset",
    "LowerOpsetConfig",
    "LoweringError",
    "LoweringResult",
    "load_adapters",
    "lower_model",
]
