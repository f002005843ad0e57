"""Check a built qgraph wheel the way a user gets it: run with the Python of a fresh environment where only the
wheel (and its dependencies) is installed, from a folder outside the checkout.

    python tools/check_wheel.py dist/qgraph-*.whl [plug-in pass names that must register too ...]

Every module the wheel holds imports; `py.typed` and the package data are in it; every built-in pass its entry
points declare registers under its name; nothing of the checkout (tests, tools, benchmarks) is packaged; and
``import qgraph`` resolves to the installed wheel, not to a source tree. Exits 1 with the list of problems.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import zipfile
from configparser import ConfigParser
from pathlib import Path


def _modules(names: list[str]) -> list[str]:
    out = []
    for name in names:
        if name.endswith(".py") and name.startswith("qgraph/"):
            parts = name[:-3].split("/")
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(out)


def check(wheel: Path, plugins: list[str]) -> list[str]:
    """The problems found in ``wheel`` (empty when it is sound); ``plugins`` are pass names installed beside it."""
    problems: list[str] = []
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_text = next((zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")
    for required in ("qgraph/py.typed", "qgraph/runtime/latency_table.json", "qgraph/__main__.py"):
        if required not in names:
            problems.append(f"{required} is not in the wheel")
    stray = sorted({n.split("/")[0] for n in names if ".dist-info/" not in n} - {"qgraph"})
    if stray:
        problems.append(f"the wheel packages more than qgraph: {stray}")
    import qgraph

    where = Path(qgraph.__file__).resolve()
    if "site-packages" not in where.parts:
        problems.append(f"`import qgraph` resolved to {where}, not to the installed wheel")
    modules = _modules(names)
    for module in modules:
        if module == "qgraph.__main__":  # `python -m qgraph` runs the CLI; checked below as a command
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # every failure is a finding, whatever its type
            problems.append(f"import {module}: {type(exc).__name__}: {exc}")
    entry_points = ConfigParser()
    entry_points.read_string(entry_text)
    declared = set(entry_points["qgraph.passes"]) if entry_points.has_section("qgraph.passes") else set()
    if not declared:
        problems.append("the wheel declares no `qgraph.passes` entry points")
    from qgraph.pipeline.pass_api import discover

    registered = discover()
    missing = sorted((declared | set(plugins)) - set(registered))
    if missing:
        problems.append(f"passes declared but not registered: {missing}")
    help_run = subprocess.run([sys.executable, "-m", "qgraph", "--help"], capture_output=True, text=True, check=False)
    if help_run.returncode != 0 or "Usage" not in help_run.stdout:
        problems.append(f"`python -m qgraph --help` exited {help_run.returncode}: {help_run.stderr.strip()[:300]}")
    print(f"{wheel.name}: {len(modules)} modules import, {len(declared)} built-in passes register "
          f"({len(registered)} with plug-ins), from {where.parent}")
    return problems


def main() -> int:
    """Check the wheel named on the command line."""
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    problems = check(Path(sys.argv[1]), sys.argv[2:])
    for problem in problems:
        print(f"wheel: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
