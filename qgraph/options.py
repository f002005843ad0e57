"""The base of every option model of a recipe: pass configs, node selectors, the options engine services take.

Kept at the bottom of the engine (it imports only pydantic) so that any layer can define options a recipe states.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class PassConfig(BaseModel):
    """Base of every pass config: frozen, unknown keys are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    def recipe_options(self) -> dict[str, Any]:
        """The options as a recipe writes them (JSON values, defaults left out). Configs that expand shorthands
        (presets) override this to give back what the user wrote."""
        return self.model_dump(mode="json", exclude_defaults=True, by_alias=True)
