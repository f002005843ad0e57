"""The executor protocol (see `qgraph.runtime.executor`), the errors and the helpers its implementations share."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType, TracebackType
from typing import Protocol, TypeVar

from qgraph.errors import QGraphError, RecipeError

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")

#: ``progress(done, total)`` after each finished item.
Progress = Callable[[int, int], None]

#: How to get Ray: every "Ray is missing" error ends with it.
RAY_EXTRA_HINT = "pip install 'qgraph[ray]'"


class WorkerError(QGraphError):
    """A worker process died while running a task (and, on Ray, every retry of it did too)."""

    exit_code = 1


def require_ray() -> ModuleType:
    """The ``ray`` module, or `RecipeError` (exit 2) in one sentence naming the extra that provides it."""
    try:
        import ray
    except ImportError:
        raise RecipeError(
            f"the Ray executor needs Ray, an optional extra that is not installed: {RAY_EXTRA_HINT}."
        ) from None
    module: ModuleType = ray  # typed whether or not Ray (and its stubs) is installed where mypy runs
    return module


class Executor(Protocol):
    """Runs ``fn(shared, item)`` for every item somewhere (see the module docs for the contract)."""

    #: Tasks run at once.
    workers: int

    def imap(
        self,
        fn: Callable[[S, T], R],
        items: Sequence[T],
        *,
        shared: S,
        deadline: float | None = None,
    ) -> Iterator[tuple[int, R]]:
        """``(index, fn(shared, items[index]))`` as tasks finish; stops (and stops all tasks) at ``deadline``.

        Closing the iterator early (``break``, an exception) stops every task still running."""
        ...

    def close(self) -> None:
        """Release what the executor holds (a Ray it started is shut down). Idempotent."""
        ...

    def map(
        self,
        fn: Callable[[S, T], R],
        items: Sequence[T],
        *,
        shared: S,
        progress: Progress | None = None,
        deadline: float | None = None,
    ) -> list[R]:
        """Results in item order; after ``deadline`` only the finished items' (still in item order)."""
        done: dict[int, R] = {}
        total = len(items)
        it = self.imap(fn, items, shared=shared, deadline=deadline)
        try:
            for index, result in it:
                done[index] = result
                if progress is not None:
                    progress(len(done), total)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        return [done[i] for i in sorted(done)]

    def __enter__(self) -> Executor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
