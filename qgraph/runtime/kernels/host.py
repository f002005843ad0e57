"""What this machine's onnxruntime integer kernels compute: read from the CPU flags, confirmed by running them.

The CPU flags (/proc/cpuinfo, or ``$QGRAPH_CPU_FLAGS``) say which instruction sets the host has; a probe says what
onnxruntime's u8 x s8 kernels actually do here: one ``MatMulInteger`` of four products 255 x 127, whose exact sum
129540 comes back as 65534 when adjacent pairs saturate int16 (AVX2 without VNNI). The two can disagree: the
flags of a virtual machine or an emulator may list instructions the kernels do not use, and an onnxruntime build
may lack a VNNI path. The probe decides what this host's deployed arithmetic is.

``$QGRAPH_CPU_FLAGS`` declares another CPU (tests; preparing a model for another machine): when its family's
arithmetic differs from what the probe found, measurements "on this host" emulate the declared CPU
(`qgraph.runtime.kernels.emulate`) and say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from qgraph.runtime.kernels.cpu import CPU_FLAGS_ENV, CpuFamily, CpuInfo, host_cpu, parse_cpuinfo

#: Families whose u8 x s8 kernels add adjacent products into a saturating int16.
PAIR_SATURATING: frozenset[str] = frozenset({"x86-avx2"})


def saturates(family: str) -> bool:
    """Whether ``family``'s u8 x s8 kernels saturate int16 pair sums (AVX2 without VNNI)."""
    return family in PAIR_SATURATING


@lru_cache(maxsize=1)
def probe_pair_saturation() -> bool:
    """Run one u8 x s8 ``MatMulInteger`` in onnxruntime: True when its adjacent pair sums saturate int16."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k = 4
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])],
        [numpy_helper.from_array(np.full((k, 1), 127, np.int8), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    got = int(session.run(None, {"a": np.full((1, k), 255, np.uint8)})[0][0, 0])
    return got != 255 * 127 * k


@lru_cache(maxsize=1)
def runtime_version() -> str:
    """``onnxruntime 1.32.0``."""
    import onnxruntime as ort

    return f"onnxruntime {ort.__version__}"


@dataclass(frozen=True)
class HostKernels:
    """This host as a deployment target: its CPU, the arithmetic its integer kernels have, the runtime."""

    cpu: CpuInfo
    #: The family whose arithmetic deployment on this host has (see `family`).
    declared_family: CpuFamily
    #: What the probe found onnxruntime's u8 x s8 kernels do here.
    probed_saturation: bool
    runtime: str
    provider: str = "CPUExecutionProvider"
    #: The architecture this process actually runs on (the flags may declare another).
    machine_arch: str = ""

    @property
    def family(self) -> CpuFamily:
        """The flags' family, corrected by the probe unless ``$QGRAPH_CPU_FLAGS`` declares the CPU: flags that
        promise VNNI on a host whose kernels saturate make this an ``x86-avx2`` host (and vice versa)."""
        if self.cpu.source == f"${CPU_FLAGS_ENV}" or self.cpu.arch != "x86":
            return self.declared_family
        if self.probed_saturation and not saturates(self.declared_family):
            return "x86-avx2"
        if not self.probed_saturation and saturates(self.declared_family):
            return "x86-vnni"
        return self.declared_family

    @property
    def emulated(self) -> bool:
        """True when the host's declared arithmetic is not what its kernels compute (``$QGRAPH_CPU_FLAGS``
        declares another CPU): deployed numbers are then emulated."""
        other_arch = bool(self.machine_arch) and self.cpu.arch != self.machine_arch
        return other_arch or saturates(self.family) != self.probed_saturation

    def arithmetic(self) -> str:
        """One phrase: what a u8 x s8 dot product gives on this host."""
        return arithmetic(self.family)

    def describe(self) -> str:
        """``x86-vnni (AVX512-VNNI, AVX2): u8×s8 exact in int32`` plus where the flags came from and any
        disagreement with the probe."""
        text = f"{self.family} ({self.cpu.isa()}): {self.arithmetic()}"
        if self.cpu.source != "/proc/cpuinfo":
            text += f", flags from {self.cpu.source}"
        if self.emulated:
            kind = f"{self.machine_arch} kernels that {'' if self.probed_saturation else 'do not '}saturate pair sums"
            text += f"; onnxruntime here runs {kind}, so this host's numbers are emulated"
        elif self.family != self.declared_family:
            text += (f"; the CPU flags say {self.declared_family} but the kernels, run here, "
                     f"{'saturate' if self.probed_saturation else 'do not saturate'} pair sums")
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"arch": self.cpu.arch, "isa": self.cpu.isa(), "flags": list(self.cpu.flags),
                "flags_from": self.cpu.source, "family": self.family, "arithmetic": self.arithmetic(),
                "probed_pair_saturation": self.probed_saturation, "emulated": self.emulated,
                "runtime": self.runtime, "provider": self.provider}


def arithmetic(family: str) -> str:
    """One phrase for what a u8 x s8 dot product gives in ``family``."""
    if saturates(family):
        return "u8×s8 pair sums saturate int16 (VPMADDUBSW)"
    return "u8×s8 exact in int32"


def host_kernels() -> HostKernels:
    """This host (flags read now, the probe run once per process)."""
    cpu = host_cpu()
    return HostKernels(cpu, cpu.family, probe_pair_saturation(), runtime_version(), machine_arch=machine_arch())


@lru_cache(maxsize=1)
def machine_arch() -> str:
    """``x86``, ``arm`` or ``other``: what this process runs on, whatever the flags say."""
    import platform

    return parse_cpuinfo("", platform.machine()).arch
