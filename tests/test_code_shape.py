"""The shape of the code: no import cycles among the engine and the built-in passes (imports inside functions
count; `if TYPE_CHECKING:` blocks do not run and do not count), no module over ~400 lines without a reason in its
docstring, no function over 80 lines (issue #15)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx

ROOT = Path(__file__).resolve().parents[1]
#: Package folders and the module name each installs as.
TREES = {ROOT / "qgraph": "qgraph", ROOT / "passes": "qgraph.passes"}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder, prefix in TREES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Internal modules ``name`` imports anywhere (functions included, TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = {f"{base}.{a.name}" for a in node.names} & set(known)  # `from pkg import submodule`
            found.update(submodules)
            if len(submodules) < len(node.names):  # something else is taken from the package itself
                found.add(base)
    return {m for m in found if m in known and m != name}


def import_graph() -> networkx.DiGraph:
    """Module -> module edges for every explicit import inside qgraph/ and passes/."""
    known = _modules()
    g = networkx.DiGraph()
    g.add_nodes_from(known)
    for name, path in known.items():
        g.add_edges_from((name, dep) for dep in _imports(name, path, known))
    return g


def test_no_import_cycles() -> None:
    g = import_graph()
    cycles = [c for c in networkx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_the_engine_never_imports_a_pass() -> None:
    g = import_graph()
    bad = [(a, b) for a, b in g.edges if not a.startswith("qgraph.passes") and b.startswith("qgraph.passes")
           and not a.startswith("qgraph.testing")]
    assert not bad, f"the engine imports built-in passes (plug-ins are reached through the registry): {bad}"


def test_module_and_function_sizes() -> None:
    too_long_modules, too_long_functions = [], []
    for name, path in _modules().items():
        text = path.read_text()
        tree = ast.parse(text)
        doc = ast.get_docstring(tree) or ""
        if len(text.splitlines()) > MAX_MODULE_LINES and "longer than" not in doc:
            too_long_modules.append(f"{name} ({len(text.splitlines())} lines)")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = node.lineno
                body = node.body
                if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                    first = (body[0].end_lineno or first) + 1  # the docstring is documentation, not code
                length = (node.end_lineno or node.lineno) - first + 1
                if length > MAX_FUNCTION_LINES:
                    too_long_functions.append(f"{name}.{node.name} ({length} lines)")
    assert not too_long_modules, f"modules over {MAX_MODULE_LINES} lines without a reason: {too_long_modules}"
    assert not too_long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {too_long_functions}"
