"""Loading every adapter family, so the registry is complete before lowering or raising."""

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
