"""The Typer application and the two consoles every command prints to (results on stdout, progress on stderr)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.console import Console

from qgraph.errors import UsageError

if TYPE_CHECKING:
    from qgraph.executor import ExecutorSpec

app = typer.Typer(
    name="qgraph",
    help="Declarative ONNX graph transformations: float model → deployable INT8 model, checked at every step.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
#: Progress, notes and errors. Emoji and markup codes are never interpreted in text that may hold user data.
console = Console(stderr=True, emoji=False)
#: Results (tables, JSON).
out = Console(emoji=False)
STATE: dict[str, bool] = {"debug": False}


def say(text: str) -> None:
    """Print plain text (a path, a name, a message) on the progress console, never interpreting markup."""
    console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)


def need_positive(value: float | None, option: str) -> None:
    """`UsageError` unless ``value`` is None or a finite number > 0 (NaN and inf are not tolerances)."""
    if value is None:
        return
    if not (value == value and abs(value) != float("inf") and value > 0):  # NaN != NaN
        raise UsageError(f"{option} {value}: give a finite number greater than 0.")


def data_path(spec: str | None) -> Path | None:
    """The file behind a data option (for the output guard), None for module:function or nothing."""
    if spec is None:
        return None
    if not spec.strip():
        raise UsageError("--calibration-data/--inputs/--data is empty: give an .npz, a folder or module:function.")
    p = Path(spec)
    return p if p.exists() else None


ExecutorKind = Literal["local", "ray"]
ExecutorOption = Annotated[
    ExecutorKind,
    typer.Option("--executor", help="Where independent tasks run: local (processes of this machine) or ray "
                 "(Ray tasks; pip install 'qgraph[ray]')."),
]
AddressOption = Annotated[
    str | None,
    typer.Option("--address", help="With --executor ray: the Ray cluster to join ('auto', HOST:6379, "
                 "ray://HOST:10001); default: start a local Ray."),
]


def executor_spec(kind: ExecutorKind, address: str | None, jobs: int | None) -> ExecutorSpec:
    """The executor the options ask for, checked before any work (Ray not installed: one sentence, exit 2)."""
    from qgraph.executor import ExecutorSpec, require_ray

    if address is not None and kind != "ray":
        raise UsageError(f"--address {address}: a Ray cluster address needs --executor ray.")
    if address is not None and not address.strip():
        raise UsageError("--address is empty: give 'auto', HOST:PORT or ray://HOST:PORT, or leave it out.")
    if kind == "ray":
        require_ray()
    return ExecutorSpec(kind=kind, address=address, workers=jobs)
