"""Model runs over many samples, several at a time: one onnxruntime run per core, results in sample order.

qgraph's data passes (calibration, bias correction's means, the guards' scores, smooth_quant's rows) run a model
over every calibration sample. Each session computes with one intra-op thread, and up to `parallel_runs` samples
run at once on threads (onnxruntime releases the GIL while it runs), their results handed back in sample order
by `ordered_map`. So a run gives the bits one thread gives, on any host whatever its core count, and uses every
core. onnxruntime's own intra-op threads do not: its float Conv without graph optimizations splits work
differently from 3 threads on (SqueezeNet: 33 of 52 tensors change bits between 2 and 3 threads), and with graph
optimizations the PP-OCRv4 recognizer's activations change between 1 and 2, so the model a recipe writes would
depend on the core count. Measured on DNSMOS (speechmos wheel, 16 clips of 9 s, 2-core
AMD Zen 4, float model without graph optimizations): one thread 3.9-4.1 s; onnxruntime's 2 intra-op threads
2.0-2.1 s; 2 one-thread samples at a time 2.05-2.1 s, with the same bits as one thread.

Memory: each run in flight holds its results; where they are a sample's fetched activations (calibration,
`qgraph.runtime.layer_data.sample_inputs`), the first result's size caps the runs in flight to `IN_FLIGHT_BYTES`
of them, so a many-core machine does not hold one large sample per core.

``QGRAPH_THREADS=n`` sets the number of runs at once (default: every core this process may use); a worker process
of a parallel search (`qgraph.runtime.executor`) takes its share of the cores, so that workers do not
oversubscribe them.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from qgraph.errors import UsageError

__all__ = ["ENV", "IN_FLIGHT_BYTES", "array_bytes", "default_runs", "ordered_map", "parallel_runs", "usable_cores"]

T = TypeVar("T")
R = TypeVar("R")

#: Environment variable that sets how many model runs go at once.
ENV = "QGRAPH_THREADS"

#: Bytes of results (fetched activations) `ordered_map` holds in flight at most, when it is told their size.
IN_FLIGHT_BYTES = 1 << 30

_LOCK = threading.Lock()
_POOL: dict[int, ThreadPoolExecutor] = {}  # the shared pool by its size (at most one)
_INSIDE = threading.local()  # set on the pool's threads: a map inside a mapped function runs in place


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def parallel_runs() -> int:
    """How many model runs go at once: ``QGRAPH_THREADS`` when set, else `usable_cores`."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return usable_cores()
    try:
        runs = int(value)
    except ValueError:
        runs = 0
    if runs < 1:
        raise UsageError(f"{ENV}={value!r}: expected a whole number >= 1 of model runs at once (or unset it to "
                         f"use every core: {usable_cores()} here)")
    return runs


def default_runs(runs: int) -> None:
    """This process runs ``runs`` models at once (at least one) unless ``QGRAPH_THREADS`` says otherwise: a worker
    process running beside others takes its share of the cores, not all of them."""
    if not os.environ.get(ENV, "").strip():
        os.environ[ENV] = str(max(1, runs))


def array_bytes(values: Iterable[Any]) -> int:
    """Bytes the arrays among ``values`` hold (a run's fetched outputs: `ordered_map`'s ``size_of``)."""
    return sum(int(getattr(v, "nbytes", 0)) for v in values)


def _pool(size: int) -> ThreadPoolExecutor:
    with _LOCK:
        for other in [k for k in _POOL if k != size]:
            _POOL.pop(other).shutdown(wait=False)
        if size not in _POOL:
            _POOL[size] = ThreadPoolExecutor(max_workers=size, thread_name_prefix="qgraph-run",
                                             initializer=setattr, initargs=(_INSIDE, "active", True))
        return _POOL[size]


def ordered_map(fn: Callable[[T], R], items: Iterable[T], runs: int | None = None,
                size_of: Callable[[R], int] | None = None, budget: int = IN_FLIGHT_BYTES) -> Iterator[R]:
    """``fn(item)`` for every item, up to ``runs`` (default `parallel_runs`) at once on threads, yielded in item
    order; ``items`` is read in the calling thread, one item ahead of the runs. ``fn`` must be safe to call from
    several threads at once (an onnxruntime session's ``run`` is). An exception of ``fn`` is raised here, in
    order; items not started then are dropped, and no call outlives the iterator.

    ``size_of(result)``: the bytes a result holds (fetched activations). Once the first result is known, at most
    ``budget // size`` results are in flight (at least one): on a machine with many cores, a model whose samples'
    activations are large does not hold one sample's worth per core."""
    size = parallel_runs() if runs is None else max(1, runs)
    if size <= 1 or getattr(_INSIDE, "active", False):
        yield from map(fn, items)
        return
    pool = _pool(size)
    window = size
    pending: collections.deque[Future[R]] = collections.deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            while len(pending) >= window:
                result = pending.popleft().result()
                if size_of is not None:
                    window = max(1, min(size, budget // max(1, size_of(result))))
                    size_of = None  # the first result sets the window
                yield result
        while pending:
            yield pending.popleft().result()
    finally:  # stopped early (an error, a consumer that stopped): nothing left running on the caller's sessions
        for fut in pending:
            fut.cancel()
        for fut in pending:
            if not fut.cancelled():
                fut.exception()
