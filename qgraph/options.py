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


def validation_problems(exc: Exception) -> str:
    """A pydantic ``ValidationError`` as one readable sentence: ``field: what is wrong (got VALUE)`` per problem,
    without pydantic's ``Value error,`` prefix, error codes or documentation URLs (recipes get the same wording
    with file positions from `qgraph.pipeline.recipe`)."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    parts = []
    for err in errors(include_url=False):
        where = ".".join(str(p) for p in err.get("loc", ()))
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown option {where!r}")
            continue
        msg = str(err.get("msg", "")).removeprefix("Value error, ").rstrip(".")
        got = err.get("input")
        shown = "" if isinstance(got, (dict, list)) or err.get("type") == "missing" or not where else f" (got {got!r})"
        parts.append(f"{where}: {msg}{shown}" if where else msg)
    return "; ".join(parts) + "."
