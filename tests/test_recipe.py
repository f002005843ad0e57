"""Recipe validation: located errors with suggestions, schema, YAML round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qgraph import Pipeline, Recipe, RecipeError
from qgraph.cli import main
from qgraph.pipeline.recipe import RecipeValidationError, recipe_json_schema

BAD_RECIPE = """\
name: four-mistakes
passes:
  - pass: toy_drop_identty
  - pass: toy_drop_identity
    keep_graph_outptus: false
  - pass: toy_drop_identity
    keep_graph_outputs: [1, 2]
  - pass: toy_scale_output
"""


def test_validate_reports_four_located_errors(toy_passes, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_RECIPE)
    code = main(["validate", str(path)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 4, lines
    assert lines[0].startswith(f"{path}:3:11: passes[0].pass: unknown pass 'toy_drop_identty'.")
    assert "Did you mean 'toy_drop_identity'?" in lines[0]
    assert lines[1].startswith(f"{path}:5:5: passes[1].keep_graph_outptus (toy_drop_identity): unknown option")
    assert "Did you mean 'keep_graph_outputs'?" in lines[1]
    assert lines[2].startswith(f"{path}:7:25: passes[2].keep_graph_outputs (toy_drop_identity):")
    assert "valid boolean" in lines[2]
    assert lines[3].startswith(f"{path}:8:5: passes[3].factor (toy_scale_output): missing required field 'factor'")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "1:1: the recipe is empty"),
        ("- a\n- b\n", "1:1: the recipe is a list"),
        ("just a string\n", "1:1: the recipe is a str"),
        ("name: x\npasses: [\n", "YAML syntax error"),
        ("name: x\npasses: []\n", "2:9: passes: List should have at least 1 item"),
        ("name: x\nbogus: 1\npasses:\n  - pass: toy_drop_identity\n", "2:1: bogus: unknown key 'bogus'"),
        ("name: x\ntarget: {opset: 99}\npasses:\n  - pass: toy_drop_identity\n", "2:17: target.opset"),
        ("name: x\npasses:\n  - keep_graph_outputs: true\n", "3:5: passes[0]: missing `pass: <name>`"),
    ],
)
def test_recipe_errors_are_located(toy_passes, text: str, expected: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RecipeValidationError) as info:
        Recipe.from_text(text, "r.yaml")
    assert expected in str(info.value)
    assert isinstance(info.value, RecipeError)


def test_yaml_round_trip_keeps_passes_and_options(toy_passes) -> None:  # type: ignore[no-untyped-def]
    drop, scale = toy_passes["toy_drop_identity"], toy_passes["toy_scale_output"]
    pipeline = Pipeline([drop(keep_graph_outputs=False), scale(factor=2.5), drop()], name="rt")
    text = pipeline.to_yaml()
    again = Recipe.from_text(text)
    assert [p.name for p in again.passes] == ["toy_drop_identity", "toy_scale_output", "toy_drop_identity"]
    assert again.passes[0].config.keep_graph_outputs is False  # type: ignore[attr-defined]
    assert again.passes[1].config.factor == 2.5  # type: ignore[attr-defined]
    assert again.to_dict() == pipeline.to_dict()
    assert again.to_yaml() == text


def test_schema_is_a_discriminated_union_of_registered_passes(toy_passes, capsys) -> None:  # type: ignore[no-untyped-def]
    schema = recipe_json_schema()
    items = schema["properties"]["passes"]["items"]
    assert items["discriminator"]["propertyName"] == "pass"
    assert "toy_drop_identity" in items["discriminator"]["mapping"]
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["title"] == "qgraph recipe"
    assert set(printed["required"]) == {"name", "passes"}


def test_python_options_are_validated(toy_passes) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RecipeError, match="factor"):
        toy_passes["toy_scale_output"]()
    with pytest.raises(RecipeError, match="bogus"):
        toy_passes["toy_drop_identity"](bogus=1)
