"""`LocalExecutor`: the tasks in this process, or in spawned worker processes of this machine."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

from qgraph.io.outputs import Terminated
from qgraph.runtime.executor.base import Executor, R, S, T, WorkerError, expired, remaining
from qgraph.runtime.parallel import default_runs, usable_cores

_WORKER: dict[str, Any] = {}


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # The parent stops the pool with SIGTERM: a running task unwinds (removing its temporary output files, as
    # the CLI does on SIGTERM), an idle worker just ends.
    if _WORKER.get("busy"):
        raise Terminated()
    os._exit(143)


def _init_worker(shared: Any, workers: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the pool
    signal.signal(signal.SIGTERM, _on_sigterm)
    default_runs(usable_cores() // workers)  # its share of the cores: the workers run side by side
    _WORKER["shared"] = shared


def _call_in_worker(fn: Callable[[Any, Any], Any], item: Any) -> Any:
    _WORKER["busy"] = True
    try:
        return fn(_WORKER["shared"], item)
    except Terminated:
        os._exit(143)  # unwound: end now, without taking another task
    finally:
        _WORKER["busy"] = False


class LocalExecutor(Executor):
    """This machine: in this process when ``workers`` is 1, else in that many spawned worker processes.

    Each worker process receives ``shared`` once, as it starts (pickled). The pool outlives a `map` call: later
    calls with the same ``shared`` object (by identity: do not mutate it in between) reuse the running workers,
    so a search that maps round after round spawns them once; another object starts a new pool, and `close`
    (or leaving a ``with`` block) ends it. A map that stops early (time budget, a failing task, Ctrl-C) ends
    every worker at once; Ctrl-C reaches only this process, so no worker is left running."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, int(workers))
        self._pool: cf.ProcessPoolExecutor | None = None
        self._shared: Any = None  # what the pool's workers hold (kept alive, so identity stays meaningful)
        self._procs: dict[int, Any] = {}

    def close(self) -> None:
        """End the worker processes (idle or busy) now."""
        if self._pool is not None:
            with _sigint_blocked():
                self._procs.update(getattr(self._pool, "_processes", None) or {})
                _stop(self._pool, list(self._procs.values()))
        self._pool, self._shared, self._procs = None, None, {}

    def imap(
        self,
        fn: Callable[[S, T], R],
        items: Sequence[T],
        *,
        shared: S,
        deadline: float | None = None,
    ) -> Iterator[tuple[int, R]]:
        """See `Executor.imap`."""
        if self.workers <= 1 or len(items) <= 1:
            for index, item in enumerate(items):
                if expired(deadline):
                    return
                yield index, fn(shared, item)
            return
        yield from self._pool_imap(fn, items, shared, deadline)

    def _pool_for(self, shared: Any) -> cf.ProcessPoolExecutor:
        if self._pool is None or self._shared is not shared:
            self.close()
            self._pool = cf.ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(shared, self.workers),
            )
            self._shared = shared
        return self._pool

    def _pool_imap(
        self, fn: Callable[[S, T], R], items: Sequence[T], shared: S, deadline: float | None
    ) -> Iterator[tuple[int, R]]:
        finished_all = False
        try:
            with _sigint_blocked():  # workers spawned now inherit the blocked Ctrl-C
                pool = self._pool_for(shared)
                futures = {pool.submit(_call_in_worker, fn, item): i for i, item in enumerate(items)}
            pending = set(futures)
            while pending and not expired(deadline):
                finished, pending = cf.wait(pending, timeout=remaining(deadline), return_when=cf.FIRST_COMPLETED)
                self._procs.update(getattr(pool, "_processes", None) or {})
                for fut in sorted(finished, key=futures.__getitem__):
                    try:
                        result = fut.result()
                    except cf.process.BrokenProcessPool:
                        raise WorkerError(
                            "a local worker process died while running a task (killed, or out of memory); "
                            "nothing was kept. Run with fewer workers, or on Ray (--executor ray), which retries "
                            "tasks whose worker died."
                        ) from None
                    yield futures[fut], result
            finished_all = not pending
        finally:  # out of time, a failing task, closed early or Ctrl-C: stop every worker now
            if not finished_all:
                self.close()


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Hold Ctrl-C back (it stays pending and is raised on exit) while workers are spawned or stopped.

    Workers spawned meanwhile inherit the blocked mask (fork + exec keep it), so Ctrl-C only ever reaches the
    parent, which then stops them; and stopping them is never cut short, so none is left running.
    """
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _stop(pool: cf.ProcessPoolExecutor, workers: list[Any]) -> None:
    # The results are in (or no longer wanted): idle or busy, the pool's own workers are ended right away
    # instead of waiting for them to wind down.
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in workers:
        if proc.is_alive():
            proc.terminate()
    for proc in workers:
        proc.join(timeout=5)
