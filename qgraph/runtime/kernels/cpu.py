"""The CPU a model runs on, as integer kernels see it: architecture, instruction sets, the family they put it in.

Read from /proc/cpuinfo (``flags`` on x86, ``Features`` on ARM64), or from ``$QGRAPH_CPU_FLAGS`` when set; a
recipe's declared ``target.cpu`` maps to the same `CpuInfo`. `qgraph.runtime.kernels.host` confirms what a host's
onnxruntime kernels actually compute.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

#: Integer-kernel families (what `CpuInfo.family` returns).
CpuFamily = Literal["x86-vnni", "x86-avx2", "x86-sse", "arm", "other"]


#: Environment variable that replaces the flags read from /proc/cpuinfo for ``target.cpu: host`` (tests, and
#: users preparing a model on one machine for another).
CPU_FLAGS_ENV = "QGRAPH_CPU_FLAGS"


@dataclass(frozen=True)
class CpuInfo:
    """What matters about a CPU for integer kernels, and where that knowledge came from."""

    arch: Literal["x86", "arm", "other"]
    vnni: bool
    avx2: bool
    #: ``declared`` (the recipe's target), ``/proc/cpuinfo`` or ``$QGRAPH_CPU_FLAGS``.
    source: str = "declared"
    #: The flags a host reading found that matter here (empty when declared).
    flags: tuple[str, ...] = ()

    @property
    def family(self) -> CpuFamily:
        """The integer-kernel family: ``x86-vnni`` (exact int32 u8×s8 dot products), ``x86-avx2`` (u8×s8 pair sums
        saturate int16), ``arm`` (exact), ``x86-sse`` (x86 without AVX2) or ``other``."""
        if self.arch == "x86":
            return "x86-vnni" if self.vnni else "x86-avx2" if self.avx2 else "x86-sse"
        return "arm" if self.arch == "arm" else "other"

    def isa(self) -> str:
        """The integer-kernel instruction sets a host reading found, e.g. ``AVX512-VNNI, AVX2`` or ``NEON dot
        product``; for a declared CPU, what the declaration implies."""
        if self.source == "declared":
            return {"x86-vnni": "VNNI (AVX512-VNNI or AVX-VNNI)", "x86-avx2": "AVX2 without VNNI",
                    "arm": "ARM64 NEON"}.get(self.family, self.family)
        names = [name for flag, name in _ISA_NAMES if flag in self.flags]
        if self.arch == "arm" and not names:
            names.append("NEON (no dot product)")
        return ", ".join(names) or "no AVX2/VNNI"

    def describe(self) -> str:
        """``x86 (AVX2, VNNI)``, plus where it came from for a host reading."""
        feats = [f for f, on in (("AVX2", self.avx2), ("VNNI", self.vnni)) if on]
        text = f"{self.arch} ({', '.join(feats) or 'no AVX2/VNNI'})"
        if self.source != "declared":
            text += f", read from {self.source}: flags [{' '.join(self.flags)}]"
        return text


DECLARED_CPUS: dict[str, CpuInfo] = {
    "x86-vnni": CpuInfo("x86", vnni=True, avx2=True),
    "x86-avx2": CpuInfo("x86", vnni=False, avx2=True),
    "arm": CpuInfo("arm", vnni=False, avx2=False),
}

_RELEVANT_FLAGS = ("avx2", "avx512_vnni", "avx_vnni", "asimddp", "i8mm")
#: Flag -> instruction-set name, in the order reports list them.
_ISA_NAMES = (("avx512_vnni", "AVX512-VNNI"), ("avx_vnni", "AVX-VNNI"), ("avx2", "AVX2"),
              ("asimddp", "NEON dot product"), ("i8mm", "I8MM"))
#: Flags that only an x86 / an ARM CPU reports (an override names the other architecture's CPU by its flags).
_X86_ONLY = ("avx", "sse", "fma")
_ARM_ONLY = ("asimd", "neon", "i8mm")


def parse_cpuinfo(text: str, machine: str, source: str = "/proc/cpuinfo") -> CpuInfo:
    """Parse ``/proc/cpuinfo`` text (the first ``flags`` line) for ``avx2`` and ``avx512_vnni``/``avx_vnni``."""
    m = machine.lower()
    arch: Literal["x86", "arm", "other"] = (
        "x86" if m in ("x86_64", "amd64", "i686", "i386") else "arm" if m.startswith(("arm", "aarch64")) else "other"
    )
    flags: set[str] = set()
    for line in text.splitlines():
        # x86 lists "flags", ARM64 "Features"
        if line.startswith(("flags", "Features")) and ":" in line:
            flags.update(line.split(":", 1)[1].split())
            break
    if source != "/proc/cpuinfo":  # flags given by hand may describe a CPU of the other architecture
        if any(f.startswith(_X86_ONLY) for f in flags):
            arch = "x86"
        elif any(f.startswith(_ARM_ONLY) for f in flags):
            arch = "arm"
    found = tuple(f for f in _RELEVANT_FLAGS if f in flags)
    return CpuInfo(arch, vnni=bool(flags & {"avx512_vnni", "avx_vnni"}), avx2="avx2" in flags, source=source,
                   flags=found)


def host_cpu() -> CpuInfo:
    """This machine's CPU: ``$QGRAPH_CPU_FLAGS`` (space-separated flags) when set, else /proc/cpuinfo."""
    override = os.environ.get(CPU_FLAGS_ENV)
    if override is not None:
        return parse_cpuinfo(f"flags : {override}", platform.machine(), source=f"${CPU_FLAGS_ENV}")
    return _proc_cpuinfo()


@lru_cache(maxsize=1)
def _proc_cpuinfo() -> CpuInfo:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    return parse_cpuinfo(text, platform.machine())
