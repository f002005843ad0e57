"""CPU-dependent choices come from the recipe's declared target, never from the machine running qgraph; asking
for the host explicitly records what was read (issue #12 item 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qgraph import Recipe
from qgraph.pipeline.target import TargetSpec
from qgraph.runtime.kernels.cpu import CPU_FLAGS_ENV

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
VNNI, AVX2 = "fpu sse4_2 avx2 avx512f avx512_vnni", "fpu sse4_2 avx2 fma"


def _run(recipe: Recipe, example: tuple[Path, Path]) -> bytes:
    model, data = example
    return recipe.pipeline().run(model, calibration_data=data).model.SerializeToString(deterministic=True)


@pytest.fixture(scope="module")
def example() -> tuple[Path, Path]:
    root = Path(__file__).resolve().parents[1] / "examples" / "digits"
    return root / "model.onnx", root / "calibration.npz"


DECLARED = sorted(p.name for p in RECIPES.glob("*.yaml") if Recipe.from_yaml(p).target.cpu != "host")


@pytest.mark.parametrize("recipe", DECLARED)
def test_ready_recipes_are_byte_identical_on_any_host(recipe: str, example: tuple[Path, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ready recipe that names its CPU; `ort-cpu.yaml` (`cpu: host`) is made for the host by design."""
    rec = Recipe.from_yaml(RECIPES / recipe)
    monkeypatch.setenv(CPU_FLAGS_ENV, VNNI)
    on_vnni = _run(rec, example)
    monkeypatch.setenv(CPU_FLAGS_ENV, AVX2)
    assert _run(rec, example) == on_vnni


def test_reduce_range_auto_decides_from_the_declared_cpu(example: tuple[Path, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    base = "name: r\ntarget: {cpu: %s}\npasses:\n  - pass: insert_qdq\n    weights: {reduce_range: auto}\n"
    monkeypatch.setenv(CPU_FLAGS_ENV, VNNI)  # the host must not matter for declared CPUs
    avx2 = Recipe.from_text(base % "x86-avx2").pipeline().run(example[0], calibration_data=example[1])
    vnni = Recipe.from_text(base % "x86-vnni").pipeline().run(example[0], calibration_data=example[1])
    anycpu = Recipe.from_text(base % "any").pipeline().run(example[0], calibration_data=example[1])
    avx2_decisions = avx2.records[0].result.decisions
    # AVX2: pair saturation is avoided per layer (the channels at risk get a raised scale), not by 7-bit weights
    assert avx2_decisions[0].startswith("reduce_range: auto -> false: target CPU x86 (AVX2): u8s8 pair sums can "
                                        "saturate int16, avoided per layer")
    assert avx2_decisions[1].startswith("saturation: auto -> avoid: target CPU x86 (AVX2)")
    assert avx2_decisions[2].startswith("saturation: avoid: ")
    assert vnni.records[0].result.decisions[0].startswith("reduce_range: auto -> false: target CPU x86 (AVX2, VNNI)")
    assert not any(d.startswith("saturation") for d in vnni.records[0].result.decisions)
    assert "declares no target.cpu" in anycpu.records[0].result.decisions[0]
    assert avx2.model.SerializeToString() != vnni.model.SerializeToString()
    # with the per-layer handling off, auto falls back to 7-bit weights everywhere
    off = Recipe.from_text(base % "x86-avx2" + "    saturation: off\n").pipeline().run(
        example[0], calibration_data=example[1])
    assert off.records[0].result.decisions[0].startswith("reduce_range: auto -> true: target CPU x86 (AVX2)")


def test_host_detection_is_explicit_and_recorded(example: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    text = "name: r\ntarget: {cpu: host}\npasses:\n  - pass: insert_qdq\n    weights: {reduce_range: auto}\n"
    outputs = {}
    for flags in (VNNI, AVX2):
        monkeypatch.setenv(CPU_FLAGS_ENV, flags)
        res = Recipe.from_text(text).pipeline().run(example[0], calibration_data=example[1])
        provenance = {p.key: p.value for p in res.model.metadata_props}["qgraph.passes"]
        assert f"read from ${CPU_FLAGS_ENV}" in provenance
        outputs[flags] = (res.model.SerializeToString(), provenance)
    assert "avx512_vnni" in outputs[VNNI][1] and "reduce_range: auto -> false" in outputs[VNNI][1]
    assert "flags [avx2]" in outputs[AVX2][1] and "saturation: auto -> avoid" in outputs[AVX2][1]
    assert outputs[VNNI][0] != outputs[AVX2][0]


def test_declared_cpus() -> None:
    assert TargetSpec().cpu_info() is None
    info = TargetSpec(cpu="x86-avx2").cpu_info()
    assert info is not None and info.avx2 and not info.vnni and info.source == "declared"


def test_the_host_recipe_picks_the_preset_of_the_host_and_records_it(example: tuple[Path, Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recipe.from_yaml(RECIPES / "ort-cpu.yaml")
    made = {}
    for flags, family in ((VNNI, "x86-vnni"), (AVX2, "x86-avx2"), ("asimd asimddp", "arm")):
        monkeypatch.setenv(CPU_FLAGS_ENV, flags)
        res = rec.pipeline().run(example[0], calibration_data=example[1])
        meta = {p.key: p.value for p in res.model.metadata_props}
        assert meta["qgraph.target_cpu"] == family
        quantize = next(r for r in res.records if r.name == "insert_qdq")
        assert quantize.result.decisions[0].startswith(f"preset ort-cpu -> ort-{family}: the target CPU is {family}")
        made[family] = res.model.SerializeToString()
        same = Recipe.from_yaml(RECIPES / f"ort-{family}.yaml").pipeline().run(example[0], calibration_data=example[1])
        # the same weights as the recipe that names the family (the files differ in their recipe text only)
        assert {t.name: t.raw_data for t in res.model.graph.initializer} == \
            {t.name: t.raw_data for t in same.model.graph.initializer} or family == "arm"
    assert len(set(made.values())) == 3
