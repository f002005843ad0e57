"""Opset-aware node builders: helpers adapters use to emit nodes already valid at the target opset.

Each builder appends nodes to a list and returns the name of the value it produced; the nodes are marked final
(the engine only validates them).
"""

from __future__ import annotations

from typing import Any

import onnx

from .context import LowerContext

_REDUCE_AXES_INPUT = {"ReduceSum": 13}
_REDUCE_DEFAULT_INPUT = 18


class Builder:
    """Collects nodes for one rewrite; every method returns the name of its (first) output."""

    def __init__(self, ctx: LowerContext, hint: str = "") -> None:
        self.ctx = ctx
        self.hint = hint
        self.nodes: list[onnx.NodeProto] = []

    def op(
        self,
        op: str,
        inputs: list[str],
        n_out: int = 1,
        *,
        outputs: list[str] | None = None,
        dtype: int | None = None,
        shape: list[int | None] | None = None,
        **attrs: Any,
    ) -> str:
        """Emit ``op(inputs; attrs)`` and return its first output."""
        node = self.ctx.make(op, inputs, n_out, hint=f"{self.hint}_{op}" if self.hint else op, outputs=outputs, **attrs)
        self.nodes.append(node)
        if dtype is not None:
            self.ctx.set_type(node.output[0], dtype, shape)
        return str(node.output[0])

    def op_multi(self, op: str, inputs: list[str], outputs: list[str], **attrs: Any) -> list[str]:
        """Emit ``op`` with explicit output names."""
        node = self.ctx.make(op, inputs, outputs=outputs, hint=op, **attrs)
        self.nodes.append(node)
        return list(node.output)

    def const(self, value: Any, dtype: Any = None, hint: str = "c") -> str:
        """A constant (initializer)."""
        return self.ctx.add_const(value, f"{self.hint}_{hint}" if self.hint else hint, dtype)

    def reduce(
        self, op: str, x: str, axes: list[int] | None, keepdims: int, out: str | None = None, dtype: int | None = None
    ) -> str:
        """``op`` over constant ``axes`` (None = all) in the form the target opset expects."""
        since = _REDUCE_AXES_INPUT.get(op, _REDUCE_DEFAULT_INPUT)
        outputs = [out] if out else None
        if axes is None:
            return self.op(op, [x], outputs=outputs, keepdims=keepdims, dtype=dtype)
        if self.ctx.target >= since:
            return self.op(op, [x, self.const(axes, "int64", "axes")], outputs=outputs, keepdims=keepdims, dtype=dtype)
        return self.op(op, [x], outputs=outputs, axes=axes, keepdims=keepdims, dtype=dtype)

    def reduce_dyn(self, op: str, x: str, axes: str, keepdims: int, dtype: int | None = None) -> str:
        """``op`` over a runtime axes tensor (only where the target takes axes as an input)."""
        return self.op(op, [x, axes], keepdims=keepdims, dtype=dtype)

    def unsqueeze(self, x: str, axes: list[int], out: str | None = None, dtype: int | None = None) -> str:
        """Unsqueeze with constant axes."""
        outputs = [out] if out else None
        if self.ctx.target >= 13:
            return self.op("Unsqueeze", [x, self.const(axes, "int64", "axes")], outputs=outputs, dtype=dtype)
        return self.op("Unsqueeze", [x], outputs=outputs, axes=axes, dtype=dtype)

    def squeeze(self, x: str, axes: list[int] | None, out: str | None = None, dtype: int | None = None) -> str:
        """Squeeze with constant axes (None = every 1-dim)."""
        outputs = [out] if out else None
        if axes is None:
            return self.op("Squeeze", [x], outputs=outputs, dtype=dtype)
        if self.ctx.target >= 13:
            return self.op("Squeeze", [x, self.const(axes, "int64", "axes")], outputs=outputs, dtype=dtype)
        return self.op("Squeeze", [x], outputs=outputs, axes=axes, dtype=dtype)

    def split(self, x: str, sizes: list[int], axis: int, outputs: list[str]) -> list[str]:
        """Split with constant sizes."""
        if self.ctx.target >= 13:
            return self.op_multi("Split", [x, self.const(sizes, "int64", "split")], outputs, axis=axis)
        return self.op_multi("Split", [x], outputs, axis=axis, split=sizes)

    def cast(self, x: str, to: int, out: str | None = None) -> str:
        """Cast ``x`` to element type ``to``."""
        return self.op("Cast", [x], outputs=[out] if out else None, to=to, dtype=to, shape=self.ctx.shape(x))

    def shape(self, x: str, rank: int | None = None) -> str:
        """``Shape(x)`` as int64 [rank]."""
        return self.op("Shape", [x], dtype=onnx.TensorProto.INT64, shape=[rank])
