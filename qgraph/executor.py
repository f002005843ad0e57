"""One interface to run independent tasks: in this process, in local worker processes, or as Ray tasks.

Code that has many independent evaluations to make (one per sensitivity candidate, one per model of a batch
run) calls ``executor.map(fn, items, shared=big)`` and never learns where they ran:

- ``fn(shared, item)`` is called once per item, anywhere; it must be a module-level function (it is pickled by
  reference) and must not rely on state of the calling process other than ``shared`` and ``item``;
- ``shared`` (the model, the evaluation data) travels to each worker once per `map` call, never once per item:
  `LocalExecutor` hands it to each worker process as it starts; `RayExecutor` puts it in Ray's object store
  once (``ray.put``) and each Ray worker process fetches and unpickles it once, then keeps it for the next items;
- results come back in item order (`map`) or as ``(index, result)`` pairs as they finish (`imap`);
- ``deadline`` (a `time.monotonic` value) is a time budget: when it passes, items not started are dropped and
  running ones are stopped at once (worker processes terminated, Ray tasks force-cancelled); `map` then returns
  the finished items' results, still in item order, so the caller sees how far it got;
- an exception raised by ``fn`` is raised by `map` (the original exception, also from Ray) after every other
  task is stopped. A Ray task whose worker process dies (killed, out of memory, node lost) is re-run up to
  ``max_retries`` times, so the results do not change; past that, or when a local worker dies, `WorkerError`.

`ExecutorSpec` is the recipe/CLI form (``executor: {kind: ray, address: ...}``); ``spec.create()`` builds the
executor. Ray is an optional extra (``pip install 'qgraph[ray]'``): asking for it without Ray installed is a
`RecipeError` naming the extra, raised before any work (a spec asking for Ray does not validate without it).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType, TracebackType
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from qgraph.errors import QGraphError, RecipeError

__all__ = [
    "RAY_EXTRA_HINT",
    "Executor",
    "ExecutorSpec",
    "LocalExecutor",
    "RayExecutor",
    "WorkerError",
    "make_executor",
    "require_ray",
]

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
    return ray


class ExecutorSpec(BaseModel):
    """Where independent evaluations run (a recipe's ``executor:`` mapping, or ``--executor``/``--address``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["local", "ray"] = Field(
        default="local", description="local: this machine's processes; ray: Ray tasks (pip install 'qgraph[ray]')."
    )
    address: str | None = Field(
        default=None,
        description="Ray only: cluster to join ('auto', 'HOST:6379' or 'ray://HOST:10001'); default: start a "
        "local Ray. Models, data and output folders must be at the same paths on every node.",
    )
    workers: int | None = Field(
        default=None,
        ge=1,
        description="Tasks run at once: local worker processes (default 1: in this process) or Ray tasks in "
        "flight (default: the cluster's CPUs).",
    )
    max_retries: int = Field(default=3, ge=0, description="Ray only: re-runs of a task whose worker process died.")

    @model_validator(mode="after")
    def _usable(self) -> ExecutorSpec:
        if self.address is not None and self.kind != "ray":
            raise ValueError("`address` is a Ray cluster address: set `kind: ray` too, or drop `address`")
        if self.kind == "ray":  # a recipe that cannot run here fails when it is loaded, before any work
            try:
                require_ray()
            except RecipeError as exc:
                raise ValueError(exc.message) from None
        return self

    def create(self, default_workers: int = 1) -> Executor:
        """The executor this spec describes (``default_workers`` when `workers` is not set, local only)."""
        if self.kind == "ray":
            return RayExecutor(self.address, workers=self.workers, max_retries=self.max_retries)
        return LocalExecutor(self.workers or default_workers)


def make_executor(spec: ExecutorSpec | Executor | None, jobs: int = 1) -> Executor:
    """``spec`` itself when it is an executor, else the one it describes (None: `LocalExecutor` with ``jobs``)."""
    if spec is None:
        return LocalExecutor(jobs)
    if isinstance(spec, ExecutorSpec):
        return spec.create(default_workers=jobs)
    return spec


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


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


# ----------------------------------------------------------------------------- local processes
_WORKER: dict[str, Any] = {}


def _init_worker(shared: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the pool
    _WORKER["shared"] = shared


def _call_in_worker(fn: Callable[[Any, Any], Any], item: Any) -> Any:
    return fn(_WORKER["shared"], item)


class LocalExecutor(Executor):
    """This machine: in this process when ``workers`` is 1, else in that many spawned worker processes.

    Each worker process receives ``shared`` once, as it starts (pickled); a pool lives for one `map` call. Ctrl-C
    reaches only this process, which then terminates every worker, so none is left running."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, int(workers))

    def close(self) -> None:
        """Nothing to release: each `map` call owns its pool."""

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
                if _expired(deadline):
                    return
                yield index, fn(shared, item)
            return
        yield from self._pool_imap(fn, items, shared, deadline)

    def _pool_imap(
        self, fn: Callable[[S, T], R], items: Sequence[T], shared: S, deadline: float | None
    ) -> Iterator[tuple[int, R]]:
        pool = cf.ProcessPoolExecutor(
            max_workers=min(self.workers, len(items)),
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(shared,),
        )
        workers: dict[int, Any] = {}
        try:
            with _sigint_blocked():
                futures = {pool.submit(_call_in_worker, fn, item): i for i, item in enumerate(items)}
            pending = set(futures)
            while pending and not _expired(deadline):
                finished, pending = cf.wait(pending, timeout=_remaining(deadline), return_when=cf.FIRST_COMPLETED)
                workers.update(getattr(pool, "_processes", None) or {})
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
        finally:  # done, out of time, a failing task, closed early or Ctrl-C: stop every worker now
            with _sigint_blocked():
                workers.update(getattr(pool, "_processes", None) or {})
                _stop(pool, list(workers.values()))


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


# ----------------------------------------------------------------------------- Ray
#: In each Ray worker process: the shared object of the latest `map` (object id -> value), fetched once.
_RAY_SHARED: dict[str, Any] = {}


def _ray_call(fn: Callable[[Any, Any], Any], boxed: list[Any], item: Any) -> Any:
    # ``boxed`` holds the ObjectRef inside a list so Ray does not resolve it per task: the worker fetches and
    # unpickles it once, then reuses it for every later task of the same map (one object kept per worker).
    import ray

    ref = boxed[0]
    key = ref.hex()
    if key not in _RAY_SHARED:
        _RAY_SHARED.clear()
        _RAY_SHARED[key] = ray.get(ref)
    return fn(_RAY_SHARED[key], item)


class RayExecutor(Executor):
    """Ray tasks: on the Ray this process is connected to, else on one it connects to now (``ray.init``: a local
    Ray when ``address`` is None, else the cluster at ``address``).

    At most ``workers`` tasks are in flight (default: the cluster's CPUs), each asking for one CPU; a task whose
    worker process dies is re-run up to ``max_retries`` times (Ray's own retry). A Ray connected here stays up
    after `close` for later executors of this process (starting one takes seconds; Ray shuts it down at exit),
    unless ``keep_ray`` is False."""

    def __init__(
        self,
        address: str | None = None,
        *,
        workers: int | None = None,
        max_retries: int = 3,
        keep_ray: bool = True,
        init_options: dict[str, Any] | None = None,
    ) -> None:
        ray = require_ray()
        self._ray = ray
        self._started = False
        self._keep_ray = keep_ray
        if not ray.is_initialized():
            options: dict[str, Any] = {
                "address": address,
                "include_dashboard": False,
                "logging_level": logging.ERROR,
                "log_to_driver": False,  # a task's failure comes back as its exception; worker chatter does not
                **(init_options or {}),
            }
            if address is None and workers is not None:
                options.setdefault("num_cpus", workers)
            ray.init(**options)
            self._started = True
        self.workers = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.max_retries = max_retries
        self._remote = ray.remote(_ray_call)

    def close(self) -> None:
        """Shut down the Ray this executor connected to, when asked to (``keep_ray=False``)."""
        if self._started and not self._keep_ray:
            self._ray.shutdown()
            self._started = False

    def imap(
        self,
        fn: Callable[[S, T], R],
        items: Sequence[T],
        *,
        shared: S,
        deadline: float | None = None,
    ) -> Iterator[tuple[int, R]]:
        """See `Executor.imap`."""
        ray = self._ray
        boxed = [ray.put(shared)]  # once per map call, whatever the number of items
        task = self._remote.options(num_cpus=1, max_retries=self.max_retries, retry_exceptions=False)
        index: dict[Any, int] = {}
        queue = iter(enumerate(items))

        def submit() -> None:
            nxt = next(queue, None)
            if nxt is not None:
                index[task.remote(fn, boxed, nxt[1])] = nxt[0]

        try:
            for _ in range(self.workers):
                submit()
            while index and not _expired(deadline):
                ready, _ = ray.wait(list(index), num_returns=1, timeout=_remaining(deadline))
                for ref in ready:
                    i = index.pop(ref)
                    result = self._get(ref)
                    submit()
                    yield i, result
        finally:  # done, out of time, a failing task or closed early: stop what still runs
            for ref in index:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)

    def _get(self, ref: Any) -> Any:
        ray = self._ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # fn raised: re-raise its own exception, as locally
            cause = getattr(exc, "cause", None)
            if isinstance(cause, BaseException):
                raise cause from None
            raise
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.OwnerDiedError,
                ray.exceptions.ObjectLostError) as exc:
            raise WorkerError(
                f"a Ray worker died while running a task and {self.max_retries} retr"
                f"{'y' if self.max_retries == 1 else 'ies'} failed too ({type(exc).__name__}); raise max_retries "
                "or check the cluster's memory."
            ) from None
