"""The target presets of ``insert_qdq`` as typed data: name -> ``why`` (shown by ``qgraph passes insert_qdq``),
the partial options it fills in and the CPU family it is made for.

The data is the one place a preset is declared: `PRESET_NAMES` and `PresetName` (the ``Literal`` type of the
config's ``preset:`` field, hence the enum of ``qgraph schema``) and the catalogue are derived from it. The options
are a `PresetOptions` TypedDict whose value types are the config's own (`kinds`), so mypy rejects a value the
config would not take; `config` also validates every preset when it loads (each must expand into a valid config,
unknown keys are errors). Each preset has a ready recipe of the same name in ``recipes/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict

from qgraph.quant.math import QuantDtype

from .kinds import Bias, Mode, Placement, Saturation, WeightFormat
from .ops import MOVEMENT

I8, U8 = QuantDtype.INT8, QuantDtype.UINT8

#: The CPU families a preset can be made for (`qgraph.runtime.kernels`' integer-kernel families).
CpuFamily = Literal["x86-vnni", "x86-avx2", "arm"]


class WeightPreset(TypedDict, total=False):
    """The ``weights:`` options a preset may set (`config.WeightOptions`)."""

    dtype: QuantDtype
    symmetric: bool
    per_channel: bool
    narrow_range: bool
    reduce_range: bool
    format: WeightFormat


class ActivationPreset(TypedDict, total=False):
    """The ``activations:`` options a preset may set (`config.ActivationOptions`)."""

    dtype: QuantDtype
    symmetric: bool


class PresetOptions(TypedDict, total=False):
    """The options a preset may fill in (`config.InsertQDQConfig`): a partial config, merged under the recipe's."""

    mode: Mode
    op_types: list[str]
    activation_matmuls: bool
    weights: WeightPreset
    activations: ActivationPreset
    bias: Bias
    saturation: Saturation
    placement: Placement


@dataclass(frozen=True)
class PresetData:
    """One preset: why it chooses what it does, the options it fills in, the CPU family it is made for."""

    why: str
    options: PresetOptions
    cpu: CpuFamily | None = None


@dataclass(frozen=True)
class CpuPreset:
    """A preset that stands for the preset of the target CPU's family, resolved when the pass runs."""

    why: str
    by_family: dict[str, str]  # CPU family -> preset (a family a target may name that is not here: an error)

#: Op types whose QDQ form onnxruntime's CPU graph optimizer fuses into an integer kernel (or drops).
ORT_CPU_OPS: tuple[str, ...] = (
    "Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Mul", "Sum", "Concat", "AveragePool",
    "GlobalAveragePool", "LeakyRelu", "Sigmoid", "Relu", "Clip", "MaxPool", "Reshape", "Transpose", "Flatten",
    "Squeeze", "Unsqueeze", "Slice", "Gather", "Expand", "Tile", "Resize", "Split", "Identity",
)

#: Op types the tensorrt preset quantizes: the inputs of the weighted ops (and of MatMuls of two activations),
#: with the data-movement ops Q/DQ commute through. Residual Adds, Mul, Concat, pools, Softmax and LayerNorm stay in
#: TensorRT's higher precision: their int8 forms only add a requantization (TensorRT's Q/DQ placement guidance).
TENSORRT_OPS: tuple[str, ...] = ("Conv", "ConvTranspose", "Gemm", "MatMul",
                                 *(op for op in ORT_CPU_OPS if op in MOVEMENT))

#: The weights of the static CNN presets for onnxruntime: s8, symmetric, per channel, full 8 bits.
_S8_SYMMETRIC_PER_CHANNEL: WeightPreset = {"dtype": I8, "symmetric": True, "per_channel": True, "reduce_range": False}
#: The options of the dynamic encoder presets whose kernels accumulate in int32 (x86 VNNI, ARM): one value, as the
#: ARM preset's `why` says.
_ENCODER_DYNAMIC: PresetOptions = {
    "mode": "dynamic",
    "op_types": ["MatMul", "Gemm"],
    "activation_matmuls": False,
    "weights": {"dtype": I8, "symmetric": False, "per_channel": True, "reduce_range": False},
    "activations": {"dtype": U8, "symmetric": False},
}

#: Presets as data, in the order the catalogue shows them; validated when `config` loads, into `PRESETS`.
PRESET_DATA: dict[str, PresetData] = {
    "ort-x86-vnni": PresetData(
        why=(
            "x86 with AVX512-VNNI/AVX-VNNI: VPDPBUSD multiplies u8 activations by s8 weights and accumulates "
            "in int32 with no int16 intermediate, so full 8-bit weights cannot saturate; u8 asymmetric "
            "activations keep ReLU outputs' full range and are what onnxruntime's x86 QLinear kernels take; "
            "s8 symmetric per-channel weights keep each output channel's precision on the fast kernel path "
            "(weights.symmetric: auto trades some speed for zero points on lopsided layers)."
        ),
        options={
            "weights": _S8_SYMMETRIC_PER_CHANNEL,
            "activations": {"dtype": U8, "symmetric": False},
            "saturation": "off",
        },
        cpu="x86-vnni",
    ),
    "ort-x86-avx2": PresetData(
        why=(
            "x86 AVX2 without VNNI: VPMADDUBSW sums two u8 x s8 products into a saturating int16, which "
            "overflows when both products are large (255 x 127 x 2 > 32767). Decided per layer, not per model: "
            "full 8-bit s8 weights wherever no pair of codes can overflow, and on the output channels where one "
            "can, a weight scale raised just enough that every same-sign pair sums to at most 128 codes "
            "(saturation: avoid; at most the 6 dB that 7-bit reduce_range would cost every channel of every "
            "layer), each pair bounded by the codes its input channels took on the calibration data "
            "(saturation_codes). Each raised layer is reported with its weight SQNR before and after."
        ),
        options={
            "weights": _S8_SYMMETRIC_PER_CHANNEL,
            "activations": {"dtype": U8, "symmetric": False},
            "saturation": "avoid",
        },
        cpu="x86-avx2",
    ),
    "ort-arm": PresetData(
        why=(
            "ARM (NEON SDOT/I8MM): signed 8-bit dot products are native, so activations and weights are both "
            "s8 (activations asymmetric, weights symmetric per-channel); no int16 saturation, no reduce_range."
        ),
        options={
            "weights": _S8_SYMMETRIC_PER_CHANNEL,
            "activations": {"dtype": I8, "symmetric": False},
            "saturation": "off",
        },
        cpu="arm",
    ),
    "tensorrt": PresetData(
        why=(
            "TensorRT explicit quantization: symmetric s8 everywhere (zero point 0), per-channel weights kept "
            "as float initializers behind Q/DQ so TensorRT folds them itself, float bias (TensorRT fuses it)."
        ),
        options={
            "weights": {"dtype": I8, "symmetric": True, "per_channel": True, "narrow_range": True,
                        "reduce_range": False, "format": "float_qdq"},
            "activations": {"dtype": I8, "symmetric": True},
            "bias": "float",
            "saturation": "off",
            "placement": "tensorrt",
            "op_types": list(TENSORRT_OPS),
        },
    ),
    "transformer-ort-x86-vnni": PresetData(
        why=(
            "Encoders on x86 VNNI: only the linear layers (MatMul/Gemm with constant weights) are quantized, "
            "with activations quantized at run time per batch (DynamicQuantizeMatMul in onnxruntime), s8 "
            "per-channel *asymmetric* weights (a zero point per output column uses all 256 codes of each "
            "column's [min, max]; +0.5 dB SQNR over symmetric at the same speed); attention score/context "
            "MatMuls, Softmax, LayerNormalization, GELU and the residual adds stay float because their ranges are "
            "wide or data dependent."
        ),
        options=_ENCODER_DYNAMIC,
        cpu="x86-vnni",
    ),
    "transformer-ort-x86-avx2": PresetData(
        why=(
            "Encoders on x86 AVX2 without VNNI: as transformer-ort-x86-vnni, but VPMADDUBSW adds two u8 x s8 "
            "products of the *raw* codes (zero point included) into a saturating int16, so 8-bit weights clip "
            "(asymmetric codes with zero points up to +-74: MiniLM cosine 0.02-0.92 deployed). 7-bit weights "
            "(reduce_range: every raw code in [-64, 63]) bound every pair by 255 x 128 = 32640 < 32767, keeping "
            "onnxruntime's fast u8s8 kernel with exact int32 results; a zero point per column recovers part of the "
            "lost bit (MiniLM after smooth_quant: 0.9976 asymmetric vs 0.9969 symmetric, 0.9990 unreduced on VNNI). "
            "weights.dtype: uint8 (u8 x u8, exact on AVX2 but a slower kernel) is the full-precision alternative."
        ),
        options={
            "mode": "dynamic",
            "op_types": ["MatMul", "Gemm"],
            "activation_matmuls": False,
            "weights": {"dtype": I8, "symmetric": False, "per_channel": True, "reduce_range": True},
            "activations": {"dtype": U8, "symmetric": False},
        },
        cpu="x86-avx2",
    ),
    "transformer-ort-arm": PresetData(
        why=(
            "Encoders on ARM (NEON SDOT/UDOT, I8MM): dot products accumulate in int32, so full 8-bit s8 weights "
            "with a zero point per column are exact, as on VNNI. Activations are u8 because onnxruntime quantizes "
            "them at run time with DynamicQuantizeLinear (u8 only); its ARM kernels take u8 x s8 on the same "
            "dot-product path (the signed side is re-biased). Same options as transformer-ort-x86-vnni, declared "
            "for ARM so no x86-only choice (reduce_range: auto) ever applies."
        ),
        options=_ENCODER_DYNAMIC,
        cpu="arm",
    ),
}
#: Presets that stand for the preset of the target CPU's family, resolved when the pass runs (the target's
#: ``cpu: host`` is read then); shown after `PRESET_DATA` in the catalogue.
CPU_PRESETS: dict[str, CpuPreset] = {
    "ort-cpu": CpuPreset(
        why="onnxruntime on the recipe's target CPU: ort-x86-vnni, ort-x86-avx2 or ort-arm by the family of "
            "target.cpu (with `cpu: host`, this machine's, probed), resolved when the pass runs and reported.",
        by_family={"x86-vnni": "ort-x86-vnni", "x86-avx2": "ort-x86-avx2", "arm": "ort-arm"},
    ),
}
#: The CPU family each CPU-specific preset is made for (derived from `PRESET_DATA`).
PRESET_CPUS: dict[str, str] = {name: data.cpu for name, data in PRESET_DATA.items() if data.cpu is not None}
#: Every preset name, in the order the catalogue and the schema's enum show them (derived from the data).
PRESET_NAMES: tuple[str, ...] = (*PRESET_DATA, *CPU_PRESETS)

if TYPE_CHECKING:
    # mypy cannot see a Literal built from data; a preset name is then any str (the config validates it).
    PresetName = str
else:
    #: The type of the config's ``preset:`` field: a ``Literal`` of `PRESET_NAMES`, so the JSON Schema's enum and
    #: the catalogue follow the data.
    PresetName = Literal[PRESET_NAMES]
