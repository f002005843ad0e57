"""Configuration of ``insert_qdq``: explicit, validated choices plus target presets stored as data.

A preset is a named partial config merged *under* what the recipe says: every key the recipe sets wins, every
key it leaves out comes from the preset, and the rest from the defaults. Presets are validated when this module
loads (each must expand into a valid config). A config remembers which options the user set, so a recipe is
written back (``Recipe.to_yaml``, provenance, reports) as ``preset:`` plus exactly those options: editing the
preset name in that text changes everything the preset decides.

Choices that depend on the CPU (``reduce_range: auto``, ``saturation: auto``) are made from the recipe's declared
``target.cpu``, never from the machine that runs qgraph (`qgraph.pipeline.target`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, ModelWrapValidatorHandler, PrivateAttr, field_validator, model_validator

from qgraph import NodeSelector, PassConfig
from qgraph.calibrate import make_observer
from qgraph.quant.math import QuantDtype

from .kinds import Bias, Mode, Placement, Saturation, WeightFormat
from .latency import LatencyOptions
from .presets import CPU_PRESETS, ORT_CPU_OPS, PRESET_DATA, PRESET_NAMES, PresetName, PresetOptions


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
        description="Use one bit less (int8 [-64, 63]) against u8s8 int16 saturation; auto: when the recipe's "
        "target.cpu is x86 without VNNI (x86-avx2, or host on such a CPU) and activations are u8, weights s8.",
    )
    format: WeightFormat = Field(
        default="int",
        description="int: store integer weights + DequantizeLinear; float_qdq: keep float weights behind "
        "QuantizeLinear -> DequantizeLinear (TensorRT).",
    )


class ActivationOptions(PassConfig):
    """How activations are quantized and calibrated."""

    dtype: QuantDtype = Field(default=QuantDtype.UINT8, description="uint8 or int8 (16-bit types need opset 21).")
    symmetric: bool = Field(default=False, description="Symmetric ranges (zero point 0 / 128).")
    method: Literal["minmax", "percentile", "entropy", "mse", "auto"] = Field(
        default="minmax",
        description="Calibration method (qgraph.calibrate observers); auto: per tensor, the minmax/percentile/mse/"
        "entropy range with the smallest expected quantization error on this dtype's grid (one pass).",
    )
    method_options: dict[str, Any] = Field(
        default_factory=dict, description="Observer options, e.g. {percentile: 99.99} or {num_bins: 2048}."
    )
    unclipped: NodeSelector | None = Field(
        default=None,
        description="Nodes whose quantized inputs keep their whole observed range whatever `method` chooses, e.g. "
        "{op_types: [MatMul]} in a transformer: clipping its outlier features (the same channels on every token) "
        "is a systematic error that mean pooling keeps; `auto` counts it like rounding noise.",
    )
    fixed_ranges: bool = Field(
        default=True,
        description="Outputs of Sigmoid/Softmax/HardSigmoid ([0, 1]) and Tanh ([-1, 1]) use the analytic bound "
        "where the data reach half of it, and are never clipped below their observed extremes.",
    )
    through_activation: bool = Field(
        default=True,
        description="A tensor read only by an activation (a Conv output before SiLU x*Sigmoid(x), HardSwish, "
        "Sigmoid, Tanh, HardSigmoid, Relu, Clip) whose output is quantized too is clipped where the activation is "
        "within a quarter code of its limit on that output's grid (SiLU with a u8 gate below -6.93, HardSwish below "
        "-3): no code changes, and the step on the side that matters gets finer.",
    )

    @model_validator(mode="after")
    def _check_method_options(self) -> ActivationOptions:
        # A typo in method_options fails when the recipe loads, not after the calibration data were read.
        make_observer(self.method, **self.method_options)
        return self


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


class DepthwiseAutoOptions(PassConfig):
    """When ``depthwise: auto`` keeps a depthwise Conv float (module docs of ``passes/insert_qdq/depthwise.py``)."""

    min_loss_db: float = Field(
        default=6.0, ge=0.0,
        description="Smallest predicted output-SQNR loss of the per-tensor input scale against per-channel scales, "
        "10·log10(Σ_c e_c R² / Σ_c e_c R_c²) with e_c the channel's squared kernel weights, that makes a depthwise "
        "Conv a candidate to stay float (6 dB = one bit).",
    )
    max_latency_growth: float = Field(
        default=0.02, ge=0.0, le=1.0,
        description="How much the modelled latency (latency table, Q/DQ boundaries included) may grow over the "
        "int8 decision's, as a fraction of it, from depthwise convs kept float; a unit the table cannot price "
        "stays int8.",
    )


class JoinOptions(PassConfig):
    """Joins (Concat, Add, Mul) whose inputs have very different ranges: quantized, all inputs share the output's
    scale, so the narrow inputs lose ``log2(ratio)`` of their bits (scores 0..1 concatenated with boxes 0..320 all
    round to zero: the "INT8 detector finds nothing" failure)."""

    keep_float: bool = Field(
        default=True,
        description="Leave a join float (its inputs keep their own Q/DQ and scales) when its input ranges differ "
        "by more than max_range_ratio; each such decision is reported with the ranges.",
    )
    max_range_ratio: float = Field(
        default=16.0, gt=1,
        description="Largest ratio between the widest and the narrowest input range (max|x|) a quantized join may "
        "have: 16 costs the narrowest input 4 of its 8 bits.",
    )


class InsertQDQConfig(PassConfig):
    """Options of ``insert_qdq`` (a ``preset`` fills in whatever the recipe leaves out)."""

    preset: PresetName | None = Field(  # a Literal of the names in `presets`: the schema's enum follows the data
        default=None,
        description="Target preset filling in every option the recipe leaves out (`qgraph passes insert_qdq` "
        "explains each).",
    )
    opset: Literal["raise", "keep"] = Field(
        default="raise",
        description="When the options need a newer opset than the model's (per-channel weights: 13; 4/16-bit "
        "types: 21): raise the model's opset first (reported as a decision), falling back to per-tensor weights "
        "where raising is impossible; keep: refuse instead.",
    )
    mode: Mode = Field(
        default="static",
        description="static: calibrated Q/DQ; dynamic: MatMul/Gemm activations quantized at run time.",
    )
    weights: WeightOptions = Field(default_factory=WeightOptions, description="Weight quantization.")
    activations: ActivationOptions = Field(default_factory=ActivationOptions, description="Activations.")
    bias: Bias = Field(
        default="int32", description="int32: scale = input_scale x weight_scale (zero point 0); float: untouched."
    )
    op_types: tuple[str, ...] = Field(default=ORT_CPU_OPS, description="Op types that may be quantized.")
    nodes: NodeSelector = Field(default_factory=NodeSelector, description="Nodes that may be quantized.")
    activation_matmuls: bool = Field(default=True, description="Also quantize MatMuls of two activations (attention).")
    outliers: OutlierOptions = Field(default_factory=OutlierOptions, description="Masking/outlier screening.")
    joins: JoinOptions = Field(default_factory=JoinOptions, description="Joins of inputs with very different ranges.")
    elementwise: Literal["integer_fed", "on_grid", "always"] = Field(
        default="integer_fed",
        description="Elementwise units (Add, Mul, Concat, pools, Sigmoid, ...): integer_fed: quantized only where "
        "their output is read by another quantized op (their integer kernel saves little and its output "
        "requantization adds error: residual sums before LayerNorm, sigmoid scores to graph outputs stay float); "
        "on_grid: and only where every input already is integer, so none adds a rounding (GELU/Softmax after a "
        "MatMul stay float); always: every one.",
    )
    placement: Placement = Field(
        default="onnxruntime",
        description="onnxruntime: Q/DQ also on the outputs of ops whose integer kernel needs one (QLinearConv, "
        "QLinearAdd...); tensorrt: only on the inputs of quantized ops (TensorRT fuses the next layer's Q into the "
        "producer itself: a Conv output going to HardSwish or a residual Add stays float, rounded once).",
    )
    depthwise: Literal["int8", "float", "auto"] = Field(
        default="int8",
        description="Depthwise Conv (one input channel per group): its input scale is per tensor while each output "
        "reads one channel, so channels 10-30x apart keep a few codes. int8; float (every one); auto: float where "
        "calibration measures the per-tensor scale losing >= depthwise_auto.min_loss_db of output SQNR against "
        "per-channel scales and the latency table says float (with its Q/DQ) is not slower (depthwise.py).",
    )
    depthwise_auto: DepthwiseAutoOptions = Field(default_factory=DepthwiseAutoOptions,
                                                 description="Thresholds of depthwise: auto.")
    subgraphs: Literal["static", "dynamic", "skip"] = Field(
        default="static",
        description="If/Loop bodies: static: each body is calibrated on the data that reaches it (its inputs at "
        "every execution) and quantized like the top graph; dynamic: only their MatMul/Gemm with constant weights, "
        "quantized at run time; skip. Bodies the data never reaches get the dynamic treatment.",
    )
    saturation: Saturation = Field(
        default="auto",
        description="u8 x s8 int16 pair saturation (x86 AVX2 without VNNI): avoid: raise the weight scales of just "
        "the output channels where a pair of codes could overflow (full 8-bit elsewhere; reported per layer); "
        "auto: avoid when the target CPU saturates (x86-avx2, or host on such a CPU), else nothing; report: only "
        "analyse; off.",
    )
    saturation_codes: Literal["calibrated", "any"] = Field(
        default="calibrated",
        description="saturation: avoid: the activation codes a pair of weight codes is checked against. calibrated: "
        "each input channel's codes on the calibration data (and the zero point padding reads): a channel whose "
        "data never reaches the top codes keeps its 8-bit weights; codes beyond those on other data can still "
        "saturate (qgraph check counts it); any: every code 0-255, so that no input can saturate (YOLOv8n: 4,238 of "
        "5,447 channels raised, against 484).",
    )
    latency: LatencyOptions = Field(
        default_factory=LatencyOptions,
        description="Keep units float where int8 would be slower on the target runtime (off | table | measure).",
    )
    unsupported: Literal["float", "error"] = Field(
        default="float", description="What a selected node that cannot be quantized gets: left float or an error."
    )

    _explicit: dict[str, Any] | None = PrivateAttr(default=None)

    @field_validator("preset", mode="before")  # before the Literal check: this message names the closest preset
    @classmethod
    def _known_preset(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in PRESET_NAMES:  # a non-string: the Literal check says so
            close = difflib.get_close_matches(value, PRESET_NAMES, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown preset {value!r}.{hint} Presets: {', '.join(PRESET_NAMES)}")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _expand_preset(cls, data: Any, handler: ModelWrapValidatorHandler[InsertQDQConfig]) -> InsertQDQConfig:
        if not isinstance(data, dict) or data.get("preset") not in PRESET_NAMES:
            return handler(data)
        # a CPU preset is expanded when the pass runs (`for_cpu`); until then the options are the user's own
        preset: Mapping[str, Any] = {} if data["preset"] in CPU_PRESETS else _preset_options(data["preset"])
        config = handler(merge_preset(preset, data))
        # What the user wrote, so the recipe is written back as `preset:` + these (see module docs).
        config._explicit = {k: (v.model_dump(exclude_unset=True) if isinstance(v, BaseModel) else v)
                            for k, v in data.items()}
        return config

    def explicit_options(self) -> dict[str, Any] | None:
        """The options the user wrote beside ``preset`` (None without a preset)."""
        return self._explicit

    def recipe_options(self) -> dict[str, Any]:
        """The options as the recipe states them: ``preset`` plus what the user set, or every non-default."""
        full = super().recipe_options()
        if self._explicit is None:
            return full
        return {"preset": self.preset, **{k: _pick(full.get(k), v) for k, v in self._explicit.items()
                                          if k != "preset" and k in full}}


def _pick(full: Any, explicit: Any) -> Any:
    """The part of ``full`` (JSON-normalized) whose keys ``explicit`` names, recursively."""
    if isinstance(full, dict) and isinstance(explicit, dict):
        return {k: _pick(full[k], v) for k, v in explicit.items() if k in full}
    return full


@dataclass(frozen=True)
class Preset:
    """A named target preset: why it chooses what it does, and the options it fills in."""

    name: str
    why: str
    options: PresetOptions


def merge_preset(preset: Mapping[str, Any], explicit: Mapping[str, Any]) -> dict[str, Any]:
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


def _preset_options(name: str) -> PresetOptions:
    return PRESET_DATA[name].options


def _validated_presets() -> dict[str, Preset]:
    presets = {}
    for name, data in PRESET_DATA.items():
        InsertQDQConfig(preset=name)  # a preset that does not expand into a valid config fails at import
        presets[name] = Preset(name, data.why, data.options)
    for name, cpu in CPU_PRESETS.items():
        assert set(cpu.by_family.values()) <= set(PRESET_DATA), name  # a CPU preset names real presets
        presets[name] = Preset(name, cpu.why, {})
    return presets


PRESETS: dict[str, Preset] = _validated_presets()
