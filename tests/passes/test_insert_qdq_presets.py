"""The presets of ``insert_qdq`` are typed data, and everything naming them is derived from it: the ``Literal`` of
the ``preset:`` field, `PRESET_NAMES`, the JSON Schema's enum, the catalogue and the per-CPU table."""

from __future__ import annotations

import typing

from qgraph.passes.insert_qdq import InsertQDQ
from qgraph.passes.insert_qdq.config import PRESETS, ActivationOptions, InsertQDQConfig, WeightOptions
from qgraph.passes.insert_qdq.presets import (
    CPU_PRESETS,
    PRESET_CPUS,
    PRESET_DATA,
    PRESET_NAMES,
    ActivationPreset,
    PresetName,
    PresetOptions,
    WeightPreset,
)

from qgraph.pipeline.recipe import recipe_json_schema


def test_preset_literal_is_the_datas_names() -> None:
    assert typing.get_args(PresetName) == PRESET_NAMES == (*PRESET_DATA, *CPU_PRESETS)
    assert PRESET_NAMES == ("ort-x86-vnni", "ort-x86-avx2", "ort-arm", "tensorrt", "transformer-ort-x86-vnni",
                            "transformer-ort-x86-avx2", "transformer-ort-arm", "ort-cpu")
    assert typing.get_args(InsertQDQConfig.model_fields["preset"].annotation) == (PresetName, type(None))
    assert list(PRESETS) == list(PRESET_NAMES)


def test_schema_enum_and_catalogue_follow_the_data() -> None:
    schema = InsertQDQConfig.model_json_schema()["properties"]["preset"]
    assert schema["anyOf"][0]["enum"] == list(PRESET_NAMES)
    help_text = InsertQDQ.help_text()
    assert [n for n in PRESET_NAMES if f"preset {n}: " in help_text] == list(PRESET_NAMES)
    assert help_text.index("preset ort-x86-vnni: ") < help_text.index("preset ort-cpu: ")


def test_recipe_schema_carries_the_enum() -> None:
    text = str(recipe_json_schema())
    assert str(list(PRESET_NAMES)) in text


def test_preset_options_are_config_fields() -> None:
    # the TypedDicts name only fields the config has, with the config's own types (shared `kinds` aliases)
    for typed, model in ((PresetOptions, InsertQDQConfig), (WeightPreset, WeightOptions),
                         (ActivationPreset, ActivationOptions)):
        hints = typing.get_type_hints(typed)
        assert set(hints) <= set(model.model_fields), typed
        for key in ("mode", "bias", "saturation", "placement", "format"):
            if key in hints:
                assert hints[key] == model.model_fields[key].annotation, key
    for name, data in PRESET_DATA.items():
        assert set(data.options) <= set(typing.get_type_hints(PresetOptions)), name
        assert PRESETS[name].why == data.why and PRESETS[name].options == data.options


def test_cpu_table_is_derived() -> None:
    assert PRESET_CPUS == {"ort-x86-vnni": "x86-vnni", "ort-x86-avx2": "x86-avx2", "ort-arm": "arm",
                           "transformer-ort-x86-vnni": "x86-vnni", "transformer-ort-x86-avx2": "x86-avx2",
                           "transformer-ort-arm": "arm"}
    assert CPU_PRESETS["ort-cpu"].by_family == {"x86-vnni": "ort-x86-vnni", "x86-avx2": "ort-x86-avx2",
                                                "arm": "ort-arm"}
    assert InsertQDQConfig(preset="ort-x86-avx2").saturation == "avoid"
