"""What a recipe declares besides its passes: the target it tunes for and where calibration data comes from.

Kept apart from `qgraph.pipeline.recipe` so the pass context can carry a typed target without importing recipes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from qgraph.data import DEFAULT_MAX_SAMPLES
from qgraph.graph.opsets import MIN_OPSET, max_opset
from qgraph.runtime.kernels.cpu import DECLARED_CPUS, CpuInfo, host_cpu


class TargetSpec(BaseModel):
    """Where the model will run: used by presets, ``reduce_range: auto`` and opset checks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    runtime: Literal["onnxruntime", "tensorrt", "generic"] = Field(
        default="onnxruntime", description="Runtime the output model is tuned for."
    )
    opset: int | None = Field(
        default=None, ge=MIN_OPSET, le=max_opset(),
        description="Opset the output model must use: the pipeline lowers or raises the model to it after the last "
        "pass (within what the installed onnx knows).",
    )
    cpu: Literal["any", "x86-vnni", "x86-avx2", "arm", "host"] = Field(
        default="any",
        description="CPU the model will run on, for choices that depend on it (reduce_range: auto, saturation: auto). "
        "Recipes decide from this declaration, never from the machine that runs qgraph; `host` asks for the local "
        "CPU explicitly (QGRAPH_CPU_FLAGS overrides what is read), and the output records what was found.",
    )

    def cpu_info(self) -> CpuInfo | None:
        """The CPU the recipe declares (None for ``any``); ``host`` reads this machine (see `host_cpu`)."""
        if self.cpu == "any":
            return None
        if self.cpu == "host":
            return host_cpu()
        return DECLARED_CPUS[self.cpu]


class CalibrationSpec(BaseModel):
    """Where calibration data comes from (``qgraph run --calibration-data`` overrides ``data``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data: str | None = Field(default=None, description=".npz file, folder of .npz/.npy, or module:function.")
    samples: int = Field(
        default=DEFAULT_MAX_SAMPLES, ge=1,
        description="Use at most this many samples (also bounds a module:function generator that never ends).",
    )
    batch_size: int = Field(default=1, ge=1, description="Samples per onnxruntime call during calibration.")
    ranges: str | None = Field(default=None, description="Reuse a ranges JSON file written by qgraph calibrate.")
