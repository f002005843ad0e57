"""Typed, user-facing errors.

Every error a user can fix by changing their input is one of these. Each message says *what* is wrong,
*where* (file:line:column, node, tensor) and *how to fix it*. The CLI turns them into exit code 2 (bad input)
or 1 (a pass or verification failed) without a traceback.
"""

from __future__ import annotations


class QGraphError(Exception):
    """Base class of every error qgraph reports to a user."""

    exit_code: int = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RecipeError(QGraphError):
    """A recipe (YAML or Python-built) is invalid: unknown key, wrong type, missing field, unknown pass."""


class ModelError(QGraphError):
    """An ONNX model cannot be used: missing, corrupt, not ONNX, cyclic or otherwise invalid."""


class DataError(QGraphError):
    """Calibration/evaluation data does not fit the model (names, dtypes, shapes) or is not finite."""


class PassError(QGraphError):
    """A pass cannot do what the recipe asks on this model (e.g. lowering an op that has no exact form)."""

    exit_code = 1


class VerificationError(PassError):
    """Numeric verification after a float-preserving pass found outputs that differ beyond tolerance."""


class OutputError(QGraphError):
    """An output path cannot be used: empty, a directory or device, one of the command's inputs, not writable."""


class WriteError(QGraphError):
    """Writing an output failed part-way (disk full, I/O error); nothing was written."""

    exit_code = 1


class UsageError(QGraphError):
    """A command-line option has a value the command cannot use (checked before any work)."""


class FidelityError(QGraphError):
    """``qgraph run --min-sqnr``: an output of the written model is below the asked SQNR (or not comparable)."""

    exit_code = 3
