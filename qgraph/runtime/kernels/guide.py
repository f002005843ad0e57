"""Which ready recipe fits which CPU, how to tell which CPU a machine has, and the report of ``inspect --host``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .host import HostKernels, host_kernels


@dataclass(frozen=True)
class RecipeFit:
    """The ready recipes for one CPU family and how to recognise that family."""

    family: str
    recipes: tuple[str, ...]
    hardware: str
    how_to_tell: str
    why: str


GUIDE: tuple[RecipeFit, ...] = (
    RecipeFit("x86-vnni", ("recipes/ort-x86-vnni.yaml", "recipes/transformer-ort-x86-vnni.yaml"),
              "x86 with AVX512-VNNI or AVX-VNNI: Intel Ice Lake, Sapphire Rapids, Alder Lake and later; AMD Zen 4 "
              "and later",
              "/proc/cpuinfo flags list avx512_vnni or avx_vnni",
              "VPDPBUSD multiplies u8 activations by s8 weights and accumulates in int32: exact, full 8-bit weights"),
    RecipeFit("x86-avx2", ("recipes/ort-x86-avx2.yaml", "recipes/transformer-ort-x86-avx2.yaml"),
              "x86 with AVX2 but no VNNI: Intel Haswell to Cascade Lake (client), AMD Zen 1-3 (EPYC Naples, Rome, "
              "Milan)",
              "/proc/cpuinfo flags list avx2 but neither avx512_vnni nor avx_vnni",
              "VPMADDUBSW adds two u8×s8 products into a saturating int16: the recipe keeps 8-bit weights where no "
              "pair can overflow and raises the scale of the channels where one could"),
    RecipeFit("arm", ("recipes/ort-arm.yaml", "recipes/transformer-ort-arm.yaml"),
              "ARM64: AWS Graviton, Ampere Altra, Apple silicon under Linux, recent phones",
              "/proc/cpuinfo Features list asimddp (and i8mm on newer cores)",
              "signed 8-bit dot products (SDOT) accumulate in int32: exact, s8 activations and weights"),
)
#: The recipe that picks its preset from the host it runs on.
HOST_RECIPE = "recipes/ort-cpu.yaml"


def fit_for(family: str) -> RecipeFit | None:
    """The guide entry of ``family`` (None for a CPU no ready recipe targets)."""
    return next((g for g in GUIDE if g.family == family), None)


def host_report(host: HostKernels | None = None) -> dict[str, Any]:
    """What ``qgraph inspect --host`` prints: this host, its kernels' arithmetic, the recipes that fit and why."""
    h = host or host_kernels()
    fit = fit_for(h.family)
    probe = ("returned 65534: adjacent products saturate int16" if h.probed_saturation
             else "returned 129540, the exact sum")
    return {
        **h.to_dict(),
        "description": h.describe(),
        "probe": f"one u8×s8 MatMulInteger of four products 255×127 (exact sum 129540) {probe}",
        "recipes": list(fit.recipes) if fit else [],
        "host_recipe": HOST_RECIPE,
        "hardware": fit.hardware if fit else "",
        "why": fit.why if fit else "no ready recipe targets this CPU family; recipes/ort-cpu.yaml quantizes for it "
                                   "with exact int32 arithmetic assumed",
        "guide": [{"family": g.family, "recipes": list(g.recipes), "hardware": g.hardware,
                   "how_to_tell": g.how_to_tell} for g in GUIDE],
    }


def host_lines(report: dict[str, Any]) -> list[str]:
    """The report as lines for a terminal."""
    recipes = ", ".join(report["recipes"]) or "none"
    lines = [
        f"this host: {report['description']}",
        f"kernels: {report['runtime']} {report['provider']}; probe: {report['probe']}",
        f"recipes for this host: {recipes} (or {report['host_recipe']}, which picks for the machine it runs on)",
        f"why: {report['why']}",
        "which recipe fits which CPU:",
    ]
    lines += [f"  {g['family']}: {', '.join(g['recipes'])} — {g['hardware']} ({g['how_to_tell']})"
              for g in report["guide"]]
    return lines
