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



def _plain_params(params: list[Any], ctx: Any) -> list[Any]:
    """Help that reads as the command line does: a flag shows no value (typer >= 0.29 would print ``<bool>``),
    an argument its upper-case name (``RECIPE``, as in the usage line and the README)."""
    for p in params:
        if getattr(p, "is_flag", False) and getattr(p, "metavar", None) is None:
            p.metavar = ""
        elif getattr(p, "param_type_name", "") == "argument" and p.metavar is None and p.name:
            p.metavar = p.name.upper()
        elif getattr(p, "param_type_name", "") == "option" and p.metavar is None:
            p.metavar = _option_metavar(p, ctx)
    return params


#: The value placeholder an option shows, by the type typer infers (``<int range>`` reads as jargon).
_METAVARS = {"path": "PATH", "list[Path]": "PATH", "str": "TEXT", "int": "N", "int range": "N", "float": "NUMBER"}


def _option_metavar(param: Any, ctx: Any) -> str | None:
    # never `import click`: typer >= 0.29 vendors it (typer._click) and a fresh install has no click at all
    try:
        shown = str(param.display_type(ctx))
    except Exception:  # an older typer: keep its own placeholder
        return None
    inner = shown.strip("<>")
    return _METAVARS.get(inner, inner if "|" in inner else None)


#: Below this many columns help is laid out by click (each option's text wrapped beside a 30-column name
#: column) instead of rich's four-column boxes, which leave ~18 columns for the text at 80.
RICH_HELP_MIN_WIDTH = 100


def _narrow_help() -> bool:
    import shutil

    return shutil.get_terminal_size().columns < RICH_HELP_MIN_WIDTH


class QGraphCommand(TyperCommand):
    """Every ``qgraph`` command (``@app.command(cls=QGraphCommand)``): see `_plain_params`; help readable at any
    width (`RICH_HELP_MIN_WIDTH`)."""

    def get_params(self, ctx: Any) -> list[Any]:
        """The command's parameters, help option included, with the metavars of `_plain_params`."""
        return _plain_params(super().get_params(ctx), ctx)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """Rich's boxed help on a wide terminal, click's plain layout on a narrow one or a pipe."""
        if not _narrow_help():
            super().format_help(ctx, formatter)
            return
        mode, self.rich_markup_mode = self.rich_markup_mode, None
        helps: list[tuple[Any, str]] = [(p, str(getattr(p, "help", ""))) for p in self.params
                                        if getattr(p, "help", None)]
        for p, text in helps:  # `literal`'s rich escapes read as written in plain help
            setattr(p, "help", text.replace("\\[", "["))  # noqa: B010  (typer's params have help; click's type not)
        try:
            super().format_help(ctx, formatter)
        finally:
            self.rich_markup_mode = mode
            for p, text in helps:
                setattr(p, "help", text)  # noqa: B010


#: The order ``qgraph --help`` lists commands in: the main job first, then checking, then the tools around it.
COMMAND_ORDER = ("run", "check", "diff", "inspect", "sensitivity", "calibrate", "lower", "validate", "passes",
                 "schema")


class QGraphGroup(TyperGroup):
    """The ``qgraph`` group (its own ``--debug``, ``--version``, ``--help``): see `_plain_params`; commands in
    `COMMAND_ORDER`, each summarised in one sentence."""

    def get_params(self, ctx: Any) -> list[Any]:
        """The group's parameters with the metavars of `_plain_params`."""
        return _plain_params(super().get_params(ctx), ctx)

    def list_commands(self, ctx: Any) -> list[str]:
        """The commands in `COMMAND_ORDER` (any other after them, by name)."""
        names = list(super().list_commands(ctx))
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))

    def get_command(self, ctx: Any, name: str) -> Any:
        """The command ``name``, its summary for the command list set to its docstring's first sentence."""
        command = super().get_command(ctx, name)
        if command is not None and getattr(command, "short_help", None) is None and command.help:
            from qgraph.text import first_sentence

            command.short_help = first_sentence(command.help)
        return command

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """Rich's boxed help on a wide terminal, click's plain layout on a narrow one or a pipe."""
        if not _narrow_help():
            super().format_help(ctx, formatter)
            return
        mode, self.rich_markup_mode = self.rich_markup_mode, None
        try:
            super().format_help(ctx, formatter)
        finally:
            self.rich_markup_mode = mode


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
#: Table width when the stream is not a terminal (a CI log, a pipe, a file) and ``COLUMNS`` is unset. Messages
#: there are not wrapped at all (one record a line, see `emit`); tables fit this width, numbers never cut
#: (`qgraph.analysis.diff.tables`).
PIPED_WIDTH = 120


def console_width(stream: TextIO, environ: Mapping[str, str] = os.environ) -> int | None:
    """The width to give a console on ``stream``: None (rich's own: the terminal's, or ``COLUMNS``) on a terminal
    or when ``COLUMNS`` is set, else `PIPED_WIDTH`."""
    isatty = getattr(stream, "isatty", None)
    return None if environ.get("COLUMNS") or (isatty is not None and isatty()) else PIPED_WIDTH


def make_console(stream: TextIO, *, stderr: bool) -> Console:
    """A console on ``stream`` (see `console_width`) that never interprets emoji codes in user data."""
    return Console(stderr=stderr, emoji=False, width=console_width(stream))


#: Progress, notes and errors. Emoji and markup codes are never interpreted in text that may hold user data.
console = make_console(sys.stderr, stderr=True)
#: Results (tables, JSON).
out = make_console(sys.stdout, stderr=False)
STATE: dict[str, bool] = {"debug": False}


def wraps(target: Console) -> bool:
    """Whether messages on ``target`` wrap at its width (at words, with a hanging indent): on a terminal; on a
    pipe or a file each message stays one line (``COLUMNS`` there sets the width of tables only)."""
    return target.is_terminal


def emit(target: Console, text: str, *, style: str | None = None) -> None:
    """Print one message on ``target``: wrapped at words with a hanging indent where `wraps`, else one line;
    never interpreting markup in ``text`` (it may hold user data); ``style`` colours all of it."""
    from qgraph.text import wrap_lines

    for line in wrap_lines(text, target.width if wraps(target) else None):
        target.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True, style=style)


def say(text: str) -> None:
    """Print plain text (a path, a name, a message) on the progress console (`emit`)."""
    emit(console, text)


def live_progress(target: Console, quiet: bool = False) -> bool:
    """Whether a progress display runs on ``target``: not with ``quiet``, and never on a pipe or a file (a spinner
    line there is noise before the messages that matter)."""
    return not quiet and target.is_terminal


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


#: How arrays in an .npz map to samples: `qgraph.data.DataLayout`, spelled here so that declaring the commands
#: does not import the data layer (numpy); tests/cli/test_startup.py checks that the two agree.
DataLayout = Literal["auto", "samples", "batched"]

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
