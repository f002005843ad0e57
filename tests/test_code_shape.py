"""The shape of the code (issues #15, #29): no import cycle among the engine and the built-in passes (imports
inside functions and in ``if TYPE_CHECKING:`` blocks count: a type-level circle is a circle), the subpackages' layers
point one way, no engine module imports the ``qgraph`` facade, a ``_``-private module is imported only inside its
own subpackage, passes and plug-ins import only the public surface, no module over ~400 lines and no function over
80 without a reason in its docstring."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Package folders and the module name each installs as.
TREES = {ROOT / "qgraph": "qgraph", ROOT / "passes": "qgraph.passes"}
#: The engine's subpackages (and base modules) from the bottom layer up: a module may import its own layer and the
#: layers below it, never one above (docs/architecture.md).
LAYERS = (
    ("qgraph._version", "qgraph.errors", "qgraph.options", "qgraph.text"),
    ("qgraph.graph",),
    ("qgraph.io",),
    ("qgraph.data",),
    ("qgraph.metrics",),
    ("qgraph.quant",),
    ("qgraph.runtime",),
    ("qgraph.calibrate",),
    ("qgraph.pipeline",),
    ("qgraph.recovery", "qgraph.remedy"),
    ("qgraph.analysis", "qgraph"),  # `qgraph`: the facade alone, what passes and plug-ins import
    ("qgraph.testing", "qgraph.passes"),
    ("qgraph.cli", "qgraph.__main__"),
)
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
    """Internal modules ``name`` imports anywhere (functions and TYPE_CHECKING blocks included)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
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


def _layer(module: str) -> int:
    """The index in `LAYERS` of the subpackage (or base module) ``module`` belongs to."""
    best, found = -1, -1
    for i, members in enumerate(LAYERS):
        for m in members:
            inside = module == m or (m != "qgraph" and module.startswith(m + "."))
            if inside and len(m) > best:
                best, found = len(m), i
    assert found >= 0, f"{module} belongs to no layer of LAYERS: add its subpackage there"
    return found


def test_the_layers_point_one_way() -> None:
    g = import_graph()
    up = [(a, b) for a, b in g.edges if _layer(b) > _layer(a)]
    assert not up, f"imports from a lower layer to a higher one: {up}"


def test_no_engine_module_imports_the_facade() -> None:
    g = import_graph()
    bad = [a for a, b in g.edges if b == "qgraph" and not a.startswith(("qgraph.passes", "qgraph.testing"))]
    assert not bad, f"engine modules importing `qgraph` (import from the module that defines the name): {bad}"


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[1:2] == ["passes"] else ".".join(parts[:2])


def _private(module: str) -> bool:
    """Whether ``module`` is private to a subpackage (a ``_`` name inside ``qgraph.<subpackage>``; the base
    modules at the top, like ``qgraph._version``, belong to every layer above them)."""
    return any(p.startswith("_") and not p.startswith("__") for p in module.split(".")[2:])


def test_private_modules_are_imported_only_inside_their_subpackage() -> None:
    g = import_graph()
    bad = [(a, b) for a, b in g.edges if _private(b) and _subpackage(a) != _subpackage(b)]
    assert not bad, f"`_`-private modules imported from another subpackage: {bad}"


@pytest.mark.parametrize("tree", ["passes", "examples/plugin"])
def test_passes_and_plug_ins_import_only_the_public_surface(tree: str) -> None:
    """A built-in pass is written as a plug-in would be: it imports public modules of the engine (no `_`-private
    module, no command-line or test-support code)."""
    bad = []
    for path in (ROOT / tree).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for n in names:
                if n.startswith("qgraph") and not n.startswith("qgraph.passes") and (
                        _private(n) or n.startswith(("qgraph.cli", "qgraph.testing"))):
                    bad.append(f"{path.relative_to(ROOT)}: {n}")
    assert not bad, f"imports outside the public surface: {bad}"


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
