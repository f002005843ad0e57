"""Reading recipe and patch YAML safely, and the located issues that recipe errors are made of.

ruamel's round-trip loader keeps line/column marks, so every problem can be reported as ``file:line:col``.
What a hostile or broken file could do to the loader is refused up front or caught: oversized files, NUL bytes,
nesting that exhausts recursion, and alias bombs (a few hundred bytes of anchors that expand to billions of nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError

from qgraph.errors import RecipeError
from qgraph.io.inputs import input_file_problem, read_bounded


@dataclass(frozen=True)
class RecipeIssue:
    """One problem in a recipe, located in its file."""

    file: str
    line: int | None
    column: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}:{self.column or 1}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class RecipeValidationError(RecipeError):
    """A recipe with one or more problems; ``issues`` lists each with its location."""

    def __init__(self, issues: list[RecipeIssue]) -> None:
        self.issues = issues
        count = f"{len(issues)} problem{'s' if len(issues) != 1 else ''}"
        super().__init__(f"invalid recipe ({count}):\n" + "\n".join(f"  {i}" for i in issues))



# ------------------------------------------------------------------------- reading YAML safely
#: Recipes and patches are small: refuse files beyond this before parsing them.
MAX_YAML_BYTES = 1 << 20
#: Nodes a document may expand to once aliases are followed (an alias bomb of nine levels is ~10^9).
MAX_YAML_NODES = 100_000
#: Nesting depth beyond which a document is refused (deep nesting exhausts the parser's recursion).
MAX_YAML_DEPTH = 64


def read_yaml_text(path: str | Path, what: str) -> str:
    """The text of a recipe or patch file, or a `RecipeError` saying why it cannot be read."""
    p = Path(path)
    problem = input_file_problem(p)
    if problem is not None:
        raise RecipeError(f"{what} {p}: {problem}.")
    if not p.exists():
        raise RecipeError(f"{what} file not found: {p}. Check the path (relative paths start at {Path.cwd()}).")
    if p.is_dir():
        raise RecipeError(f"{p}: is a directory; give a {what} .yaml file.")
    if p.suffix.lower() == ".onnx":  # the arguments swapped: the size or NUL-byte refusal would not say so
        raise RecipeError(f"{p}: is an ONNX model, not a {what} (YAML text). Give the {what} .yaml file here; "
                          "commands take the recipe before the model: `qgraph run RECIPE.yaml MODEL.onnx -o OUT`.")
    try:
        data = read_bounded(p, MAX_YAML_BYTES)
        if data is None:
            raise RecipeError(f"{p}: more than {MAX_YAML_BYTES} bytes is too large for a {what}.")
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{p}: is not UTF-8 text (byte {exc.start}: {exc.reason}); save the {what} as UTF-8."
                          ) from None
    except OSError as exc:
        raise RecipeError(f"{p}: cannot read the {what} ({exc.strerror or exc}).") from None


def load_yaml(text: str, filename: str) -> Any:
    """Parse YAML with ruamel (round-trip, for line numbers), refusing what could exhaust memory or recursion:
    NUL and other control characters, nesting deeper than `MAX_YAML_DEPTH`, and alias expansion beyond
    `MAX_YAML_NODES` nodes. Errors are `RecipeValidationError` located in ``filename``."""

    def fail(message: str, line: int | None = 1, col: int | None = 1) -> RecipeValidationError:
        return RecipeValidationError([RecipeIssue(filename, line, col, "", message)])

    if len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise fail(f"the document is larger than {MAX_YAML_BYTES} bytes; recipes are small text files.")
    if "\0" in text:
        line = text.count("\n", 0, text.index("\0")) + 1
        raise fail("the file contains a NUL byte: it is binary, not YAML text.", line)
    depth = _max_depth(text)
    if depth > MAX_YAML_DEPTH:
        raise fail(f"the document nests {depth} levels deep (limit {MAX_YAML_DEPTH}).")
    try:
        data = YAML(typ="rt").load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark
        raise fail(f"YAML syntax error: {exc.problem}", mark.line + 1 if mark else None,
                   mark.column + 1 if mark else None) from None
    except (RecursionError, MemoryError):
        raise fail("the document is too deeply nested or too large to read.") from None
    except Exception as exc:  # ruamel's ReaderError and friends: unreadable characters
        raise fail(f"not readable as YAML ({type(exc).__name__}: {exc}).") from None
    tagged = _first_tag(data, {})
    if tagged is not None:
        raise fail(f"YAML tags such as {tagged} are not used in recipes (nothing is ever constructed from them): "
                   "remove the tag and write the plain value.")
    size = _expanded_size(data, {})
    if size > MAX_YAML_NODES:
        raise fail(f"the document expands to more than {MAX_YAML_NODES} nodes once its aliases (*refs) are "
                   "followed; recipes do not need that many. Remove the repeated anchors/aliases.")
    return data


def _first_tag(value: Any, seen: dict[int, bool]) -> str | None:
    """The first explicit tag (``!foo``, ``!!str``) in the document, visiting each shared node once."""
    if id(value) in seen:
        return None
    seen[id(value)] = True
    tag = getattr(getattr(value, "tag", None), "value", None)
    if tag is not None:
        return str(tag).replace("tag:yaml.org,2002:", "!!")
    children = list(value.keys()) + list(value.values()) if isinstance(value, dict) else \
        value if isinstance(value, list) else []
    for child in children:
        found = _first_tag(child, seen)
        if found is not None:
            return found
    return None


def _max_depth(text: str) -> int:
    """Bracket nesting depth of flow collections (a cheap bound checked before the recursive parser runs)."""
    depth = best = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}" and depth:
            depth -= 1
    return best


def _expanded_size(value: Any, memo: dict[int, int]) -> int:
    """Nodes ``value`` has with aliases expanded, computed once per shared object (linear in the document)."""
    key = id(value)
    if key in memo:
        return memo[key]
    memo[key] = MAX_YAML_NODES + 1  # a self-referencing alias counts as too large
    if isinstance(value, dict):
        total = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in value.items())
    elif isinstance(value, list):
        total = 1 + sum(_expanded_size(v, memo) for v in value)
    else:
        total = 1
    memo[key] = min(total, MAX_YAML_NODES + 1)
    return memo[key]
