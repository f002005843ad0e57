"""The ``qgraph`` command line.

Exit codes: 0 ok; 1 a run failed (a pass refused, verification failed, a write failed part-way); 2 bad input
(usage, recipe, model, data, output path), printed as one paragraph without a traceback unless ``--debug`` (so is
an exception inside a pass: `qgraph.pipeline.contract` names the pass and exits 1);
3 ``run --min-sqnr`` not met (the model is written);
130 interrupted by Ctrl-C, 143 by SIGTERM (no partial output is left: every output is written atomically).
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
from types import FrameType
from typing import Annotated, Any

import typer

from qgraph._version import __version__
from qgraph.cli import calibration, check, models, recipes, run  # noqa: F401  (registers the commands)
from qgraph.cli._app import STATE, app, console, out
from qgraph.cli._app import wraps as _app_wraps
from qgraph.errors import QGraphError
from qgraph.io.outputs import Terminated

__all__ = ["app", "console", "main", "out"]


def _version(value: bool) -> None:
    if value:
        out.print(f"qgraph {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks (input errors, a pass that failed).")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    STATE["debug"] = debug


def _is_click_class(exc: BaseException, name: str) -> bool:
    # typer >= 0.29 vendors click (typer._click) and no longer installs it: recognise its exceptions by class
    # name, so the CLI works with either.
    return any(cls.__name__ == name for cls in type(exc).__mro__)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def _return_freed_memory() -> None:
    """Make glibc give freed weight-sized blocks back to the system at once (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``).

    By default glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), so the next
    weights land on the heap, whose freed space is rarely returned: a model's float weights, freed as their int8
    replace them, would stay counted in the process. A fixed threshold keeps every block over 1 MiB in its own
    mapping, released by ``free``. No-op off glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if sys.platform != "linux" or name is None:
        return
    try:
        ctypes.CDLL(name).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, mapping errors to exit codes and one-paragraph messages without tracebacks."""
    _return_freed_memory()
    previous: Any = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _main(argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _debug_first(argv: list[str] | None) -> list[str]:
    """``argv`` with a ``--debug`` written after the command (``qgraph diff A B --debug``, as the messages say)
    moved before it, where the group's option lives; arguments after ``--`` are left alone."""
    args = list(sys.argv[1:] if argv is None else argv)
    end = args.index("--") if "--" in args else len(args)
    if "--debug" in args[1:end]:
        args.remove("--debug")
        args.insert(0, "--debug")
    return args


#: Options naming one output file (``--out-dir`` names a folder and is not among them).
FILE_OUTPUTS = ("-o", "--output", "--json", "--html", "--report", "--plot", "--patch")


def _refuse_folder_outputs(args: list[str]) -> None:
    """`UsageError` for a file output written with a trailing slash (``-o out/newdir/``): a slash means a folder,
    and the parsed path has lost it (qgraph would write a file named ``newdir``)."""
    from qgraph.errors import UsageError

    for option, value in itertools.pairwise(args):
        if option in FILE_OUTPUTS and value.endswith(("/", os.sep)) and value.strip("/" + os.sep):
            raise UsageError(f"{option} {value}: ends with a slash, so it names a folder; {option} writes one file: "
                             f"give a file name (e.g. {value}model.int8.onnx).")


def _main(argv: list[str] | None) -> int:
    STATE["debug"] = False
    try:
        args = _debug_first(argv)
        _refuse_folder_outputs(args)
        code = app(args=args, standalone_mode=False, prog_name="qgraph")
    except QGraphError as exc:
        if STATE["debug"]:  # the traceback, and still the exit code of the error's kind (2: bad input)
            import traceback

            traceback.print_exc()
        from rich.text import Text

        # one text, wrapped as one paragraph on a terminal; one line on a pipe (`_app.wraps`)
        console.print(Text.assemble(("error:", "bold red"), " ", exc.message), soft_wrap=not _app_wraps(console))
        return exc.exit_code
    except (KeyboardInterrupt, Terminated) as exc:
        console.print("interrupted: nothing was written.", markup=False)
        return 143 if isinstance(exc, Terminated) else 130
    except typer.Exit as exc:
        return int(exc.exit_code)
    except SystemExit as exc:  # a user's module (data, metric) called sys.exit: still one of our codes
        if exc.code in (0, None):
            return 0
        if isinstance(exc.__context__, BrokenPipeError):  # rich exits when stdout's reader left (`| head`)
            return 141  # what a shell reports for SIGPIPE; nothing more to say to a closed pipe
        console.print(f"error: code qgraph imported called sys.exit({exc.code!r}); nothing was written.",
                      markup=False, highlight=False)
        return 2
    except Exception as exc:
        if _is_click_class(exc, "Abort"):  # click turns Ctrl-C during a command into Abort
            console.print("interrupted: nothing was written.", markup=False)
            return 130
        if _is_click_class(exc, "Exit"):
            return int(getattr(exc, "exit_code", 0))
        if _is_click_class(exc, "ClickException"):
            exc.show()  # type: ignore[attr-defined]  # usage text and the problem
            return 2
        raise
    if code == 130:  # typer turns Ctrl-C inside a command into exit code 130
        console.print("interrupted: nothing was written.", markup=False)
    return int(code) if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
