"""Configuration of ``insert_qdq``: explicit, validated choices plus target presets stored as data.

A preset is a partial config (a plain mapping) merged *under* what the recipe says: every key the recipe sets
wins, every key it leaves out comes from the preset, and the rest from the defaults. The expanded values are
what the pass runs with and what provenance records, so a recipe that says ``preset: ort-x86-avx2`` and one
that spells out the same options are the same recipe.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from qgraph import NodeSelector, PassConfig
from qgraph.quant import QuantDtype

#: Op types whose QDQ form onnxruntime's CPU graph optimizer fuses into an integer kernel (or drops).
ORT_CPU_OPS: tuple[str, ...] = (
    "Conv",
    "ConvTranspose",
    "Gemm",
    "MatMul",
    "Add",
    "Mul",
    "Sum",
    "Concat",
    "AveragePool",
    "GlobalAveragePool",
    "LeakyRelu",
    "Sigmoid",
    "Relu",
    "Clip",
    "MaxPool",
    "Reshape",
    "Transpose",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    "Slice",
    "Gather",
    "Expand",
    "Tile",
    "Resize",
    "Split",
    "Identity",
)

PresetName = Literal["ort-x86-vnni", "ort-x86-avx2", "ort-arm", "tensorrt", "transformer-ort-x86-vnni"]

#: Presets as data: each expands into a full spec; ``why`` is reported in the PassResult.
PRESETS: dict[str, dict[str, Any]] = {
    "ort-x86-vnni": {
        "why": (
            "x86 with AVX512-VNNI/AVX-VNNI: VPDPBUSD multiplies u8 activations by s8 weights and accumulates "
            "in int32 with no int16 intermediate, so full 8-bit weights cannot saturate; u8 asymmetric "
            "activations keep ReLU outputs' full range and are what onnxruntime's x86 QLinear kernels take; "
            "s8 symmetric per-channel weights keep each output channel's precision on the fast kernel path "
            "(weights.symmetric: auto trades some speed for zero points on lopsided layers)."
        ),
        "weights": {"dtype": "int8", "symmetric": True, "per_channel": True, "reduce_range": False},
        "activations": {"dtype": "uint8", "symmetric": False},
        "saturation": "off",
    },
    "ort-x86-avx2": {
        "why": (
            "x86 AVX2 without VNNI: VPMADDUBSW sums two u8 x s8 products into a saturating int16, which "
            "overflows when both products are large (255 x 127 x 2 > 32767); 7-bit weights (reduce_range) "
            "bound every pair sum by 255 x 64 x 2 = 32640. The saturation analysis reports the layers that "
            "would overflow with 8-bit weights."
        ),
        "weights": {"dtype": "int8", "symmetric": True, "per_channel": True, "reduce_range": True},
        "activations": {"dtype": "uint8", "symmetric": False},
        "saturation": "report",
    },
    "ort-arm": {
        "why": (
            "ARM (NEON SDOT/I8MM): signed 8-bit dot products are native, so activations and weights are both "
            "s8 (activations asymmetric, weights symmetric per-channel); no int16 saturation, no reduce_range."
        ),
        "weights": {"dtype": "int8", "symmetric": True, "per_channel": True, "reduce_range": False},
        "activations": {"dtype": "int8", "symmetric": False},
        "saturation": "off",
    },
    "tensorrt": {
        "why": (
            "TensorRT explicit quantization: symmetric s8 everywhere (zero point 0), per-channel weights kept "
            "as float initializers behind Q/DQ so TensorRT folds them itself, float bias (TensorRT fuses it)."
        ),
        "weights": {
            "dtype": "int8",
            "symmetric": True,
            "per_channel": True,
            "narrow_range": True,
            "reduce_range": False,
            "format": "float_qdq",
        },
        "activations": {"dtype": "int8", "symmetric": True},
        "bias": "float",
        "saturation": "off",
    },
    "transformer-ort-x86-vnni": {
        "why": (
            "Encoders on x86 VNNI: only the linear layers (MatMul/Gemm with constant weights) are quantized, "
            "with activations quantized at run time per batch (DynamicQuantizeMatMul in onnxruntime), s8 "
            "per-channel *asymmetric* weights (a zero point per output column uses all 256 codes of each "
            "column's [min, max]; +0.5 dB SQNR over symmetric at the same speed); attention score/context "
            "MatMuls, Softmax, LayerNormalization, GELU and the residual adds stay float because their ranges are "
            "wide or data dependent."
        ),
        "mode": "dynamic",
        "op_types": ["MatMul", "Gemm"],
        "activation_matmuls": False,
        "weights": {"dtype": "int8", "symmetric": False, "per_channel": True, "reduce_range": False},
        "activations": {"dtype": "uint8", "symmetric": False},
    },
}


class WeightOptions(PassConfig):
    """How constant weights are quantized."""

    dtype: QuantDtype = Field(
        default=QuantDtype.INT8, description="int8, uint8; int4/uint4/int16/uint16 need opset 21."
    )
    per_channel: bool = Field(
        default=True, description="One scale per output channel (Conv 0, ConvTranspose 1, Gemm by transB, MatMul -1)."
    )
    symmetric: Literal["auto"] | bool = Field(
        default=True,
        description="Zero point 0 (signed) / midpoint (unsigned); auto: per layer, asymmetric when its channels' "
        "ranges are lopsided enough that a zero point gains >= asymmetric_gain x resolution.",
    )
    asymmetric_gain: float = Field(
        default=1.25,
        ge=1.0,
        le=2.0,
        description="Resolution gain (2 max|w| / (max - min)) that makes auto pick asymmetric.",
    )
    narrow_range: bool = Field(default=False, description="Drop the most negative code, e.g. int8 [-127, 127].")
    reduce_range: Literal["auto"] | bool = Field(
        default="auto",
        description="Use one bit less (int8 [-64, 63]) against u8s8 int16 saturation; auto: only on local x86 "
        "CPUs without VNNI when activations are u8 and weights s8.",
    )
    format: Literal["int", "float_qdq"] = Field(
        default="int",
        description="int: store integer weights + DequantizeLinear; float_qdq: keep float weights behind "
        "QuantizeLinear -> DequantizeLinear (TensorRT).",
    )


class ActivationOptions(PassConfig):
    """How activations are quantized and calibrated."""

    dtype: QuantDtype = Field(default=QuantDtype.UINT8, description="uint8 or int8 (16-bit types need opset 21).")
    symmetric: bool = Field(default=False, description="Symmetric ranges (zero point 0 / 128).")
    method: Literal["minmax", "percentile", "entropy", "mse"] = Field(
        default="minmax", description="Calibration method (qgraph.calibrate observers)."
    )
    method_options: dict[str, Any] = Field(
        default_factory=dict, description="Observer options, e.g. {percentile: 99.99} or {num_bins: 2048}."
    )


class OutlierOptions(PassConfig):
    """Which activations are too dominated by masking constants or outliers to quantize."""

    skip: bool = Field(default=True, description="Leave such tensors (and the ops needing them) float.")
    mask_magnitude: float = Field(
        default=1e4, gt=0, description="A range reaching |x| >= this is a masking constant (e.g. -1e4, -1e9)."
    )
    max_ratio: float = Field(
        default=100.0,
        gt=1,
        description="Skip when max|x| exceeds this many times the 99.99th percentile of |x| (extreme outliers).",
    )


class InsertQDQConfig(PassConfig):
    """Options of ``insert_qdq`` (a ``preset`` fills in whatever the recipe leaves out)."""

    preset: PresetName | None = Field(default=None, description="Target preset expanded into the options below.")
    why: str = Field(default="", description="Why the preset chose these options (filled by the preset).")
    mode: Literal["static", "dynamic"] = Field(
        default="static",
        description="static: calibrated Q/DQ; dynamic: MatMul/Gemm activations quantized at run time.",
    )
    weights: WeightOptions = Field(default_factory=WeightOptions, description="Weight quantization.")
    activations: ActivationOptions = Field(default_factory=ActivationOptions, description="Activations.")
    bias: Literal["int32", "float"] = Field(
        default="int32", description="int32: scale = input_scale x weight_scale (zero point 0); float: untouched."
    )
    op_types: tuple[str, ...] = Field(default=ORT_CPU_OPS, description="Op types that may be quantized.")
    nodes: NodeSelector = Field(default_factory=NodeSelector, description="Nodes that may be quantized.")
    activation_matmuls: bool = Field(
        default=True, description="Also quantize MatMuls whose two inputs are activations (attention)."
    )
    outliers: OutlierOptions = Field(default_factory=OutlierOptions, description="Masking/outlier screening.")
    subgraphs: Literal["dynamic", "skip"] = Field(
        default="dynamic",
        description="If/Loop/Scan bodies cannot be calibrated: quantize their MatMul/Gemm dynamically, or skip.",
    )
    saturation: Literal["auto", "report", "off"] = Field(
        default="auto",
        description="u8s8 int16 saturation analysis: auto (when the target lacks VNNI), report (always), off.",
    )
    unsupported: Literal["float", "error"] = Field(
        default="float", description="What a selected node that cannot be quantized gets: left float or an error."
    )

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        name = data["preset"]
        if name not in PRESETS:
            return data  # the Literal check reports the valid names
        return merge_preset(PRESETS[name], data)


def merge_preset(preset: dict[str, Any], explicit: dict[str, Any]) -> dict[str, Any]:
    """``explicit`` over ``preset``, nested mappings merged key by key."""
    out = dict(preset)
    for key, value in explicit.items():
        base = out.get(key)
        if isinstance(base, dict) and isinstance(value, dict):
            out[key] = merge_preset(base, value)
        elif isinstance(base, dict) and hasattr(value, "model_dump"):
            out[key] = merge_preset(base, value.model_dump(exclude_unset=True))
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------------------------------------- CPU detection
@dataclass(frozen=True)
class CpuInfo:
    """What matters about the local CPU for integer kernels."""

    arch: Literal["x86", "arm", "other"]
    vnni: bool
    avx2: bool

    def describe(self) -> str:
        """``x86 (AVX2, VNNI)``."""
        feats = [f for f, on in (("AVX2", self.avx2), ("VNNI", self.vnni)) if on]
        return f"{self.arch} ({', '.join(feats) or 'no AVX2/VNNI'})"


def parse_cpuinfo(text: str, machine: str) -> CpuInfo:
    """Parse ``/proc/cpuinfo`` text (``flags`` lines) for ``avx2`` and ``avx512_vnni``/``avx_vnni``."""
    m = machine.lower()
    arch: Literal["x86", "arm", "other"] = (
        "x86" if m in ("x86_64", "amd64", "i686", "i386") else "arm" if m.startswith(("arm", "aarch64")) else "other"
    )
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            flags.update(line.split(":", 1)[1].split())
            break
    return CpuInfo(arch, vnni=bool(flags & {"avx512_vnni", "avx_vnni"}), avx2="avx2" in flags)


@lru_cache(maxsize=1)
def local_cpu() -> CpuInfo:
    """The machine qgraph runs on (read once)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    return parse_cpuinfo(text, platform.machine())


def resolve_reduce_range(config: InsertQDQConfig, cpu: CpuInfo | None = None) -> tuple[bool, str]:
    """The effective ``reduce_range`` and the reason (``auto`` looks at the local CPU)."""
    setting = config.weights.reduce_range
    if setting != "auto":
        return bool(setting), f"reduce_range: {str(setting).lower()} (explicit)"
    cpu = cpu or local_cpu()
    u8s8 = config.activations.dtype == QuantDtype.UINT8 and config.weights.dtype == QuantDtype.INT8
    if cpu.arch == "x86" and not cpu.vnni and u8s8:
        return True, f"reduce_range: auto -> true: local CPU is {cpu.describe()}, u8s8 pair sums can saturate int16"
    why = "activations/weights are not u8/s8" if not u8s8 else f"local CPU is {cpu.describe()}"
    return False, f"reduce_range: auto -> false: {why}"


def saturation_wanted(config: InsertQDQConfig, cpu: CpuInfo | None = None) -> bool:
    """Whether to run the u8s8 saturation analysis: ``report``, or ``auto`` for static u8s8 on a local x86
    CPU without VNNI (the presets for VNNI, ARM and TensorRT targets turn it off: no int16 intermediate)."""
    if config.saturation != "auto":
        return config.saturation == "report"
    u8s8 = config.activations.dtype == QuantDtype.UINT8 and config.weights.dtype == QuantDtype.INT8
    cpu = cpu or local_cpu()
    return config.mode == "static" and u8s8 and cpu.arch == "x86" and not cpu.vnni
