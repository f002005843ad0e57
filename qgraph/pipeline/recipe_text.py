"""What a recipe and a pipeline both are (`RecipeSpec`: a name, ordered passes, a description, the target and the
calibration settings) and that as text: the canonical mapping (defaults omitted), its YAML, and the hash provenance
records.

`qgraph.pipeline.recipe.Recipe` and `qgraph.pipeline.runner.Pipeline` are both a `RecipeSpec`, so a pipeline built in
Python and the recipe it came from (or becomes) serialize identically without either module importing the other.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Sequence
from typing import Any

from ruamel.yaml import YAML

from qgraph.pipeline.pass_api import Pass
from qgraph.pipeline.target import CalibrationSpec, TargetSpec


def recipe_dict(name: str, passes: Sequence[Pass[Any]], *, description: str = "", target: TargetSpec | None = None,
                calibration: CalibrationSpec | None = None) -> dict[str, Any]:
    """Canonical mapping: defaults omitted, keys in schema order, each pass as its recipe writes it."""
    out: dict[str, Any] = {"name": name}
    if description:
        out["description"] = description
    for key, spec in (("target", target), ("calibration", calibration)):
        dumped = spec.model_dump(mode="json", exclude_defaults=True) if spec is not None else {}
        if dumped:
            out[key] = dumped
    out["passes"] = [{"pass": p.name, **p.config.recipe_options()} for p in passes]
    return out


def recipe_yaml(mapping: dict[str, Any]) -> str:
    """``mapping`` as block-style YAML in key order (loading it gives the same recipe)."""
    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    yaml.sort_base_mapping_type_on_output = False  # type: ignore[assignment]
    buf = io.StringIO()
    yaml.dump(mapping, buf)
    return buf.getvalue()


def canonical_text(mapping: dict[str, Any]) -> str:
    """Deterministic JSON used for provenance and hashing."""
    return json.dumps(mapping, sort_keys=True, separators=(",", ":"))


def text_sha256(mapping: dict[str, Any]) -> str:
    """Hash of `canonical_text`."""
    return hashlib.sha256(canonical_text(mapping).encode()).hexdigest()


class RecipeSpec:
    """A name, ordered pass instances, a description, the target and the calibration settings, serialised one way:
    the data a `qgraph.Recipe` is loaded into and a `qgraph.Pipeline` runs."""

    def __init__(self, name: str, passes: Sequence[Pass[Any]], *, description: str = "",
                 target: TargetSpec | None = None, calibration: CalibrationSpec | None = None) -> None:
        self.name = name
        self.passes: list[Pass[Any]] = list(passes)
        self.description = description
        self.target = target or TargetSpec()
        self.calibration = calibration or CalibrationSpec()

    def to_dict(self) -> dict[str, Any]:
        """Canonical mapping: defaults omitted, keys in schema order, each pass as its recipe writes it."""
        return recipe_dict(self.name, self.passes, description=self.description, target=self.target,
                           calibration=self.calibration)

    def to_yaml(self) -> str:
        """As YAML; ``Recipe.from_text`` loads it back into an equivalent recipe."""
        return recipe_yaml(self.to_dict())

    def canonical_text(self) -> str:
        """Deterministic JSON used for provenance and hashing."""
        return canonical_text(self.to_dict())

    def sha256(self) -> str:
        """Hash of `canonical_text`."""
        return text_sha256(self.to_dict())
