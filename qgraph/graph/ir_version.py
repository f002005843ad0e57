"""The IR version qgraph writes: the lowest the model's opsets need, at most what the target runtime loads.

onnx 1.23's ``make_model`` writes IR 14, which onnxruntime 1.31 refuses (it loads <= 13).
"""

from __future__ import annotations

import onnx

#: Highest IR version qgraph writes unless the opsets need more. onnxruntime 1.31 loads up to 13; 10 is what
#: opsets up to 22 need and what older runtimes (TensorRT, ORT 1.16+) also load.
MAX_RUNTIME_IR_VERSION = 10


def required_ir_version(model: onnx.ModelProto) -> int:
    """The lowest IR version valid for the model's opsets, at least 4 (initializers need not be inputs)."""
    opsets = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]
    try:
        needed = int(onnx.helper.find_min_ir_version_for(opsets, ignore_unknown=True))
    except (ValueError, TypeError):
        needed = 7
    return max(needed, 4)


def normalize_ir_version(model: onnx.ModelProto, max_ir: int = MAX_RUNTIME_IR_VERSION) -> None:
    """Set an IR version that the opsets need and the runtime loads (in place)."""
    needed = required_ir_version(model)
    model.ir_version = max(min(max(model.ir_version, needed), max_ir), needed)
