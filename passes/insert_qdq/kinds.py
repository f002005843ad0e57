"""The enumerated choices of ``insert_qdq``'s options, named once: its config's fields and its presets' typed
partial options (`presets`) both use these, so a preset can only hold a value the config accepts (mypy checks it)."""

from __future__ import annotations

from typing import Literal

#: ``mode``: calibrated Q/DQ, or MatMul/Gemm activations quantized at run time.
Mode = Literal["static", "dynamic"]
#: ``bias``: int32 codes on the input x weight scale, or left float.
Bias = Literal["int32", "float"]
#: ``placement``: where Q/DQ pairs go (onnxruntime's integer kernels, or TensorRT's inputs-only rule).
Placement = Literal["onnxruntime", "tensorrt"]
#: ``saturation``: what to do about u8 x s8 int16 pair saturation (x86 AVX2 without VNNI).
Saturation = Literal["auto", "avoid", "report", "off"]
#: ``weights.format``: integer weights + DequantizeLinear, or float weights behind Q/DQ (TensorRT).
WeightFormat = Literal["int", "float_qdq"]
