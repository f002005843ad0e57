"""The Typer application and the two consoles every command prints to (results on stdout, progress on stderr)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TextIO

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from qgraph.errors import UsageError

if TYPE_CHECKING:
    from qgraph.runtime.executor import ExecutorSpec



def _plain_params(params: list[Any]) -> list[Any]:
    """Help that reads as the command line does: a flag shows no value (typer >= 0.29 would print ``<bool>``),
    an argument its upper-case name (``RECIPE``, as in the usage line and the README)."""
    for p in params:
        if getattr(p, "is_flag", False) and getattr(p, "metavar", None) is None:
            p.metavar = ""
        elif getattr(p, "param_type_name", "") == "argument" and p.metavar is None and p.name:
            p.metavar = p.name.upper()
    return params


class QGraphCommand(TyperCommand):
    """Every ``qgraph`` command (``@app.command(cls=QGraphCommand)``): see `_plain_params`."""

    def get_params(self, ctx: Any) -> list[Any]:
        """The command's parameters, help option included, with the metavars of `_plain_params`."""
        return _plain_params(super().get_params(ctx))


class QGraphGroup(TyperGroup):
    """The ``qgraph`` group (its own ``--debug``, ``--version``, ``--help``): see `_plain_params`."""

    def get_params(self, ctx: Any) -> list[Any]:
        """The group's parameters with the metavars of `_plain_params`."""
        return _plain_params(super().get_params(ctx))


app = typer.Typer(
    cls=QGraphGroup,
    # help is rich markup whatever typer's default: a literal '[' goes through `literal`
    rich_markup_mode="rich",
    name="qgraph",
    help="Declarative ONNX graph transformations: float model → deployable INT8 model, checked at every step.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
#: Columns when the stream is not a terminal (a CI log, a pipe, a file) and ``COLUMNS`` is unset: rich's 80 cut
#: table cells (``examp…utputs.npz``, a ``step drop`` of ``0.22``) and folded summary lines mid-phrase.
PIPED_WIDTH = 200


def console_width(stream: TextIO, environ: Mapping[str, str] = os.environ) -> int | None:
    """The width to give a console on ``stream``: None (rich's own: the terminal's, or ``COLUMNS``) on a terminal
    or when ``COLUMNS`` is set, else `PIPED_WIDTH`."""
    isatty = getattr(stream, "isatty", None)
    return None if environ.get("COLUMNS") or (isatty is not None and isatty()) else PIPED_WIDTH


#: Progress, notes and errors. Emoji and markup codes are never interpreted in text that may hold user data.
console = Console(stderr=True, emoji=False, width=console_width(sys.stderr))
#: Results (tables, JSON).
out = Console(emoji=False, width=console_width(sys.stdout))
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
    """The file behind a data option (for the output guard): the path itself, or the file of ``file.py:function``
    and ``file.npz:KEY``; None for ``package.module:function`` or nothing."""
    if spec is None:
        return None
    if not spec.strip():
        raise UsageError("--calibration-data/--inputs/--data is empty: give an .npz, a folder or module:function.")
    return spec_file(spec)


def spec_file(spec: str | None) -> Path | None:
    """The file a ``--labels``/``--metric``/data spec reads (``FILE``, ``FILE:KEY``, ``FILE.py:function``), None
    when it names no existing file (an importable module, or nothing)."""
    if not spec:
        return None
    for candidate in (spec, spec.rpartition(":")[0]):
        try:
            if candidate and Path(candidate).exists():
                return Path(candidate)
        except OSError:  # a name too long for the file system: no such file
            continue
    return None


def literal(text: str) -> str:
    """``text`` shown as written in help: typer parses help as rich markup when rich renders it (where
    ``[ray]`` would read as a style tag and vanish), as plain text when it does not (``TYPER_USE_RICH=0``)."""
    from rich.markup import escape

    return escape(text) if getattr(typer.core, "HAS_RICH", True) else text


KernelsOption = Annotated[str, typer.Option(
    "--kernels", help="How models run: auto (this host's deployed kernels, or the target CPU's arithmetic emulated "
    "when the model was made for another CPU), deployed (onnxruntime's default optimizations on this host), "
    "emulated (the target's integer arithmetic reproduced in float).", metavar="auto|deployed|emulated")]
TargetCpuOption = Annotated[str | None, typer.Option(
    "--target-cpu", help="Judge the candidates for this CPU whatever they were made for: x86-vnni, x86-avx2, arm or "
    "host (default: the CPU in each model's provenance).", metavar="x86-vnni|x86-avx2|arm|host")]


def check_kernel_options(kernels: str, target_cpu: str | None = None) -> None:
    """`UsageError` for a ``--kernels`` or ``--target-cpu`` value qgraph does not know (before any work)."""
    from qgraph.runtime.kernels.measure import KERNEL_OPTIONS, TARGET_FAMILIES

    if kernels not in KERNEL_OPTIONS:
        raise UsageError(f"--kernels {kernels!r}: give one of {', '.join(KERNEL_OPTIONS)}.")
    if target_cpu is not None and target_cpu not in (*TARGET_FAMILIES, "host"):
        raise UsageError(f"--target-cpu {target_cpu!r}: give one of {', '.join((*TARGET_FAMILIES, 'host'))}.")


ExecutorKind = Literal["local", "ray"]
ExecutorOption = Annotated[
    ExecutorKind,
    typer.Option("--executor", help="Where independent tasks run: local (processes of this machine) or ray "
                 "(Ray tasks; pip install " + literal("'qgraph[ray]'") + ")."),
]
AddressOption = Annotated[
    str | None,
    typer.Option("--address", help="With --executor ray: the Ray cluster to join ('auto', HOST:6379, "
                 "ray://HOST:10001); default: start a local Ray."),
]


def executor_spec(kind: ExecutorKind, address: str | None, jobs: int | None) -> ExecutorSpec:
    """The executor the options ask for, checked before any work (Ray not installed: one sentence, exit 2)."""
    from qgraph.runtime.executor import ExecutorSpec, require_ray

    if address is not None and kind != "ray":
        raise UsageError(f"--address {address}: a Ray cluster address needs --executor ray.")
    if address is not None and not address.strip():
        raise UsageError("--address is empty: give 'auto', HOST:PORT or ray://HOST:PORT, or leave it out.")
    if kind == "ray":
        from qgraph.runtime.executor.ray_tasks import check_address

        require_ray()
        check_address(address)  # before any work: a cluster that does not answer is said in seconds, not minutes
    return ExecutorSpec(kind=kind, address=address, workers=jobs)
