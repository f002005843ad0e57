"""One interface to run independent tasks: in this process, in local worker processes, or as Ray tasks.

Code that has many independent evaluations to make (one per sensitivity candidate, one per model of a batch
run) calls ``executor.map(fn, items, shared=big)`` and never learns where they ran:

- ``fn(shared, item)`` is called once per item, anywhere; it must be a module-level function (it is pickled by
  reference) and must not rely on state of the calling process other than ``shared`` and ``item``;
- ``shared`` (the model, the evaluation data) travels to each worker once, never once per item, and not again
  for a later `map` given the same object (by identity; do not mutate it in between): `LocalExecutor` hands it
  to each worker process as it starts and keeps the pool for the next map; `RayExecutor` puts it in Ray's object
  store once (``ray.put``) and each Ray worker process fetches and unpickles it once, then keeps it;
- `close` (or leaving a ``with`` block) releases the workers and the shared object;
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

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from qgraph.errors import RecipeError
from qgraph.runtime.executor.base import RAY_EXTRA_HINT, Executor, Progress, WorkerError, require_ray
from qgraph.runtime.executor.local import LocalExecutor
from qgraph.runtime.executor.ray_tasks import RayExecutor

__all__ = [
    "RAY_EXTRA_HINT",
    "Executor",
    "ExecutorSpec",
    "LocalExecutor",
    "Progress",
    "RayExecutor",
    "WorkerError",
    "make_executor",
    "require_ray",
]


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
