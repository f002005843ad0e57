"""The CLI starts at once: declaring the commands (``--help``, usage errors) imports none of the heavy
libraries; each command imports what it needs when it runs. Timing is measured in
benchmarks/bench_startup.py, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
import typing

import pytest

import qgraph
from qgraph.cli import _app

#: What `qgraph --help` must not pay for (each 40-250 ms to import on a 2-core machine). pydantic is not here:
#: typer (>= 0.2x) imports it itself to parse parameters, ~20 ms.
HEAVY = ("onnx", "onnxruntime", "onnx_graphsurgeon", "numpy", "networkx")


def _loaded_after(code: str) -> dict[str, object]:
    probe = (
        "import json, sys\n" + code + "\n"
        f"print(json.dumps({{'heavy': [m for m in {HEAVY!r} if m in sys.modules],"
        " 'qgraph': sorted(m for m in sys.modules if m.startswith('qgraph'))}))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_importing_the_cli_loads_no_heavy_library() -> None:
    loaded = _loaded_after("import qgraph.cli")
    assert loaded["heavy"] == []
    # the command modules are declared, their implementations are not imported
    assert "qgraph.cli.run" in loaded["qgraph"]  # type: ignore[operator]
    assert not any(m.startswith(("qgraph.pipeline", "qgraph.graph", "qgraph.runtime"))
                   for m in loaded["qgraph"])  # type: ignore[union-attr]


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["diff", "--help"], ["no-such-command"], ["run"]])
def test_help_and_usage_errors_load_no_heavy_library(argv: list[str]) -> None:
    loaded = _loaded_after(
        "import contextlib, io\nfrom qgraph.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        f"    code = main({argv!r})\n"
        "assert code in (0, 2), code\n"
    )
    assert loaded["heavy"] == []


def test_the_facade_imports_its_names_on_first_use() -> None:
    loaded = _loaded_after("import qgraph")
    assert loaded["heavy"] == []
    assert loaded["qgraph"] == ["qgraph", "qgraph._version", "qgraph.errors"]
    loaded = _loaded_after("from qgraph import Pipeline, NodeSelector")
    assert {"onnx", "networkx"} <= set(loaded["heavy"])  # type: ignore[arg-type]


def test_every_public_name_resolves_and_unknown_names_raise() -> None:
    for name in qgraph.__all__:
        assert getattr(qgraph, name) is not None, name
    assert set(qgraph.__all__) <= set(dir(qgraph))
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = qgraph.no_such_name  # type: ignore[attr-defined]


def test_the_cli_data_layout_is_the_data_layer_s() -> None:
    from qgraph.data import DataLayout

    assert typing.get_args(_app.DataLayout) == typing.get_args(DataLayout)


def test_python_dash_m_qgraph_exits_with_the_command_s_code() -> None:
    done = subprocess.run([sys.executable, "-m", "qgraph", "nosuch"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "No such command" in done.stderr + done.stdout
    done = subprocess.run([sys.executable, "-m", "qgraph", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("qgraph ")
