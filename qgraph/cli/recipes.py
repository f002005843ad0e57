"""Recipe commands: ``validate``, ``schema`` and ``passes`` (the pass catalogue, readable at 80 columns)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

import qgraph.cli._app as _app
from qgraph.cli._app import QGraphCommand, app, say
from qgraph.errors import RecipeError
from qgraph.io.outputs import check_output, write_atomic


@app.command(cls=QGraphCommand)
def validate(recipes: Annotated[list[Path], typer.Argument(help="Recipe files to check.", metavar="RECIPE")]) -> None:
    """Validate recipes; print every problem with file:line:column and a suggestion (every file is checked)."""
    from qgraph.pipeline.recipe import Recipe
    from qgraph.pipeline.recipe_yaml import RecipeValidationError

    failed = 0
    for path in recipes:
        try:
            rec = Recipe.from_yaml(path)
        except RecipeValidationError as exc:
            failed += 1
            for issue in exc.issues:
                _app.out.print(str(issue), markup=False, highlight=False, soft_wrap=True)
            continue
        except RecipeError as exc:  # unreadable file: report it and go on with the others
            failed += 1
            _app.out.print(exc.message, markup=False, highlight=False, soft_wrap=True)
            continue
        _app.out.print(f"{path}: ok ({len(rec.passes)} passes: {', '.join(p.name for p in rec.passes)})",
                       markup=False, highlight=False, soft_wrap=True)
    if failed:
        raise typer.Exit(2)


@app.command(cls=QGraphCommand)
def schema(
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write to a file.")] = None,
) -> None:
    """Print the JSON Schema of recipes (for yaml-language-server / editor completion)."""
    from qgraph.pipeline.recipe import recipe_json_schema

    text = json.dumps(recipe_json_schema(), indent=2) + "\n"
    if output is None:
        sys.stdout.write(text)
        return
    write_atomic(check_output(output), text)
    say(f"wrote {output}")


@app.command("passes", cls=QGraphCommand)
def list_passes(
    name: Annotated[str | None, typer.Argument(help="Show one pass in full (options, types, example).")] = None,
) -> None:
    """List the available passes with their options; `qgraph passes NAME` shows one in full."""
    from qgraph.cli.pass_catalogue import describe_pass, option_rows, wrap_text
    from qgraph.pipeline.pass_api import discover, get_pass

    if name is not None:
        width = max(60, min(_app.out.width, 120))
        _app.out.print(describe_pass(get_pass(name), width), markup=False, highlight=False, soft_wrap=True)
        return
    width = max(60, min(_app.out.width, 120))
    blocks = []
    for pass_name, cls in discover().items():
        kind = "keeps float results" if cls.preserves_float else "changes float results"
        lines = [f"{pass_name}  ({kind})", *wrap_text(cls.summary(), width, "  ")]
        for row in option_rows(cls.config_class, nested=False):
            lines += wrap_text(f"{row.name} = {row.default}", width, "    ", "        ")
        blocks.append("\n".join(lines))
    _app.out.print("\n\n".join(blocks), markup=False, highlight=False, soft_wrap=True)
    _app.out.print(f"\n{len(blocks)} passes. `qgraph passes NAME` shows one with types, descriptions and an example.",
                   markup=False, highlight=False)
