"""What opsets exist: the range the installed onnx knows, checked once for every option that names an opset."""

from __future__ import annotations

import onnx

from qgraph.errors import UsageError
from qgraph.graph.ops import is_default_domain

#: Oldest default-domain opset qgraph reads or writes (QuantizeLinear needs 10; lowering goes down to 7).
MIN_OPSET = 7


def max_opset() -> int:
    """The newest default-domain opset the installed onnx package defines."""
    return int(onnx.defs.onnx_opset_version())


def check_opset(opset: int, option: str) -> int:
    """``opset`` if the installed onnx knows it, else a `UsageError` naming the supported range."""
    top = max_opset()
    if not MIN_OPSET <= opset <= top:
        raise UsageError(
            f"{option} {opset}: the installed onnx {onnx.__version__} supports opsets {MIN_OPSET} to {top}. "
            "Choose one in that range."
        )
    return opset


def model_opset(model: onnx.ModelProto, default: int = 0) -> int:
    """The model's default-domain opset (``default`` when it imports none)."""
    return next((int(o.version) for o in model.opset_import if is_default_domain(o.domain)), default)
