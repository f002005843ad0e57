"""``insert_qdq``'s choices that depend on the target CPU: a CPU preset resolved, ``reduce_range: auto`` and
``saturation: auto``. They follow the recipe's declared ``target.cpu`` (``host``: this machine's, probed), never the
machine that merely runs qgraph (`qgraph.pipeline.target`, `qgraph.runtime.kernels`).
"""

from __future__ import annotations

from qgraph import PassError
from qgraph.quant.math import QuantDtype
from qgraph.runtime.kernels.cpu import CpuInfo

from .config import InsertQDQConfig
from .presets import CPU_PRESETS


def for_cpu(config: InsertQDQConfig, family: str) -> tuple[InsertQDQConfig, str]:
    """``config`` with a CPU preset (`CPU_PRESETS`) replaced by the preset of ``family``, and the decision line;
    ``config`` itself and an empty line for any other preset."""
    if config.preset not in CPU_PRESETS:
        return config, ""
    table = CPU_PRESETS[config.preset].by_family
    concrete = table.get(family)
    if concrete is None:
        raise PassError(f"insert_qdq: preset {config.preset!r} has no preset for CPU family {family!r} (it knows "
                        f"{', '.join(table)}); set target.cpu to one of them or name a preset.")
    explicit = {k: v for k, v in (config.explicit_options() or {}).items() if k != "preset"}
    resolved = InsertQDQConfig.model_validate({**explicit, "preset": concrete})
    return resolved, f"preset {config.preset} -> {concrete}: the target CPU is {family}"


def _u8s8(config: InsertQDQConfig) -> bool:
    """Whether the layers multiply 8-bit activations (u8, or s8 that x86 kernels shift to u8) by s8 weights."""
    return (config.activations.dtype in (QuantDtype.UINT8, QuantDtype.INT8) and config.weights.dtype == QuantDtype.INT8
            and config.weights.format == "int")


def resolve_saturation(config: InsertQDQConfig, cpu: CpuInfo | None, family: str | None) -> tuple[str, str | None]:
    """``saturation: auto`` made concrete for the target (``family``: its integer-kernel family, host resolved):
    ``avoid`` where u8 x s8 pairs saturate (AVX2 without VNNI), ``off`` elsewhere; and the decision line."""
    if config.saturation != "auto":
        return config.saturation, None
    if family == "x86-avx2" and _u8s8(config) and config.weights.reduce_range is not True:
        where = f"target CPU {cpu.describe()}" if cpu is not None else "target CPU x86-avx2"
        return "avoid", (f"saturation: auto -> avoid: {where}: u8×s8 pair sums saturate int16, so the weight "
                         "channels where a pair of codes could overflow get a raised scale (full 8-bit elsewhere)")
    return "off", None


def resolve_reduce_range(config: InsertQDQConfig, cpu: CpuInfo | None) -> tuple[bool, str]:
    """The effective ``reduce_range`` and the reason (``auto``: 7-bit weights only where int16 pair saturation
    is possible and not avoided per layer, ``saturation: off/report`` on an AVX2 target)."""
    setting = config.weights.reduce_range
    if setting != "auto":
        return bool(setting), f"reduce_range: {str(setting).lower()} (explicit)"
    u8s8 = _u8s8(config)
    if cpu is None:
        return False, ("reduce_range: auto -> false: the recipe declares no target.cpu (declare x86-avx2 for "
                       "weights safe from int16 saturation on CPUs without VNNI)")
    if cpu.arch == "x86" and not cpu.vnni and u8s8:
        if config.saturation in ("auto", "avoid"):
            return False, (f"reduce_range: auto -> false: target CPU {cpu.describe()}: u8s8 pair sums can saturate "
                           "int16, avoided per layer instead (saturation: avoid raises the scale of only the "
                           "channels that could overflow)")
        return True, f"reduce_range: auto -> true: target CPU {cpu.describe()}: u8s8 pair sums can saturate int16"
    why = "activations/weights are not u8/s8" if not u8s8 else f"target CPU {cpu.describe()}"
    return False, f"reduce_range: auto -> false: {why}"


def saturation_wanted(config: InsertQDQConfig, cpu: CpuInfo | None) -> bool:
    """Whether to report the u8s8 saturation analysis: ``report`` and ``avoid`` (after `resolve_saturation`)."""
    return config.saturation in ("report", "avoid") and config.mode == "static" and _u8s8(config)


