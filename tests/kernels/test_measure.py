"""Which kernels measure a model (`qgraph.runtime.kernels.measure`), and the host they describe
(`qgraph.runtime.kernels.host`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from kernel_models import conv_case

from qgraph import Recipe
from qgraph.runtime.kernels.cpu import CPU_FLAGS_ENV, parse_cpuinfo
from qgraph.runtime.kernels.host import HostKernels, host_kernels, probe_pair_saturation
from qgraph.runtime.kernels.measure import (
    EXACT,
    EmulatedSession,
    choose,
    deployed,
    emulated,
    model_target,
    saturation_of,
    target_family,
)

ROOT = Path(__file__).resolve().parents[2]


def _host(flags: str, saturating: bool, machine: str = "x86_64", source: str = "/proc/cpuinfo") -> HostKernels:
    cpu = parse_cpuinfo(f"flags : {flags}", machine, source=source)
    return HostKernels(cpu, cpu.family, saturating, "onnxruntime 1.32.0", machine_arch=cpu.arch)


VNNI = _host("avx2 avx512_vnni", saturating=False)
AVX2 = _host("avx2", saturating=True)


def test_the_host_that_is_the_target_measures_with_its_deployed_kernels() -> None:
    for host in (VNNI, AVX2):
        choice = choose(host.family, host=host)
        assert choice.kernels.mode == "deployed" and choice.other is None and choice.mismatch is None
    assert choose(None, host=AVX2).kernels.mode == "deployed"  # no target: this host's numbers


def test_a_target_this_host_is_not_is_emulated_and_the_host_shown_beside() -> None:
    choice = choose("x86-vnni", host=AVX2)
    assert (choice.kernels.mode, choice.kernels.family) == ("emulated", "x86-vnni")
    assert choice.other is not None and choice.other.mode == "deployed" and choice.other.family == "x86-avx2"
    assert choice.mismatch is not None and choice.mismatch.startswith("this host is not the target: made for x86-vnni")
    assert "saturate" in choice.mismatch
    arm = choose("arm", host=VNNI)  # the same exact arithmetic, another architecture's kernels
    assert arm.kernels.mode == "emulated" and arm.mismatch is not None


def test_kernels_option_forces_one_way_and_exact_is_host_independent() -> None:
    assert choose("x86-vnni", "deployed", host=AVX2).kernels.mode == "deployed"
    forced = choose(None, "emulated", host=AVX2).kernels
    assert (forced.mode, forced.family) == ("emulated", "x86-avx2")
    exact = choose(EXACT, host=AVX2).kernels
    assert (exact.mode, exact.family) == ("emulated", EXACT)
    assert "ORT_DISABLE_ALL" in exact.describe() and "exact int32" in exact.describe()
    # every CPU family is emulated on the host's fused kernels, rewriting only what differs
    avx2_here = choose("x86-avx2", host=VNNI).kernels
    assert avx2_here.fused and avx2_here.to_dict()["optimization"] == "ORT_ENABLE_ALL"
    assert "rewritten as the exact int32 sum plus its int16 pair saturation" in avx2_here.describe()
    vnni_here = choose("x86-vnni", "emulated", host=VNNI).kernels
    assert vnni_here.describe().endswith("(their integer arithmetic is the target's: no layer rewritten)")
    vnni_on_avx2 = choose("x86-vnni", host=AVX2).kernels
    assert "rewritten as the exact int32 sum and onnxruntime's requantization" in vnni_on_avx2.describe()
    assert deployed(VNNI).describe().startswith("deployed kernels: onnxruntime 1.32.0 CPUExecutionProvider, "
                                                "ORT_ENABLE_ALL, on this host x86-vnni (AVX512-VNNI, AVX2)")


def test_flags_that_promise_vnni_on_saturating_kernels_make_an_avx2_host() -> None:
    """A VM or emulator may report flags its onnxruntime does not use: the probe decides the arithmetic."""
    odd = _host("avx2 avx512_vnni", saturating=True)
    assert odd.family == "x86-avx2" and not odd.emulated and "the CPU flags say x86-vnni" in odd.describe()
    declared = _host("avx2", saturating=False, source=f"${CPU_FLAGS_ENV}")
    assert declared.family == "x86-avx2" and declared.emulated  # declared by hand: emulated, and said so
    assert "emulated" in deployed(declared).describe() or "emulated" in deployed(declared).label()
    elsewhere = _host("asimd asimddp", saturating=False, machine="aarch64", source=f"${CPU_FLAGS_ENV}")
    assert elsewhere.family == "arm"
    moved = HostKernels(elsewhere.cpu, "arm", False, "onnxruntime 1.32.0", machine_arch="x86")
    assert moved.emulated  # ARM declared on an x86 machine


def test_the_probe_agrees_with_the_flags_on_this_host() -> None:
    host = host_kernels()
    assert host.probed_saturation == probe_pair_saturation()
    if host.cpu.arch == "x86" and host.cpu.source == "/proc/cpuinfo" and host.cpu.vnni:
        assert host.family == "x86-vnni" or host.probed_saturation  # an emulator may report VNNI (see above)


def test_target_of_a_model_from_its_provenance(monkeypatch: pytest.MonkeyPatch) -> None:
    digits = ROOT / "examples" / "digits"
    res = Recipe.from_yaml(ROOT / "recipes" / "ort-x86-avx2.yaml").pipeline().run(
        digits / "model.onnx", calibration_data=str(digits / "calibration.npz"))
    assert model_target(res.model) == "x86-avx2"
    assert model_target(onnx.load(str(digits / "model.onnx"))) is None
    older = onnx.ModelProto()
    older.CopyFrom(res.model)
    kept = [p for p in older.metadata_props if p.key != "qgraph.target_cpu"]
    del older.metadata_props[:]
    older.metadata_props.extend(kept)
    assert model_target(older) == "x86-avx2"  # read from the recipe text of an earlier version's provenance
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx2")
    assert target_family("host") == "x86-avx2" and target_family("any") is None


def test_an_emulated_session_hides_and_counts_its_saturation() -> None:
    case = conv_case("conv", 8, 4, 3)
    session = emulated("x86-avx2").session(case.model)
    assert isinstance(session, EmulatedSession)
    assert [o.name for o in session.get_outputs()] == ["y"]
    out = session.run(None, {"x": case.x})
    assert len(out) == 1 and out[0].shape == (1, 4, 9, 9)
    (count,) = saturation_of(session)
    assert count.site.node == "conv" and 0 < count.fraction < 1 and count.saturated > 0
    assert "conv: " in count.describe() and "Q/DQ pair xq × weight w" in count.describe()
    plain = emulated("x86-vnni").session(case.model)
    assert saturation_of(plain) == []
    vnni = plain.run(None, {"x": case.x})[0]
    assert not np.array_equal(out[0], vnni)  # the saturation changes this layer's result
