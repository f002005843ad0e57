"""`RayExecutor`: the tasks as Ray tasks, the shared object in Ray's object store once."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from qgraph.runtime.executor.base import Executor, R, S, T, WorkerError, expired, remaining, require_ray
from qgraph.runtime.parallel import default_runs

_RAY_SHARED: dict[str, Any] = {}
#: Seconds a cluster address has to accept a connection before qgraph says it did not answer (``ray.init`` itself
#: retries for minutes).
CONNECT_TIMEOUT = 10.0


def check_address(address: str | None, timeout: float = CONNECT_TIMEOUT) -> None:
    """`UsageError` when ``address`` cannot work: ``ray://`` without Ray's client extra installed, or a HOST:PORT
    that does not accept a TCP connection within ``timeout`` seconds (``auto`` and None are Ray's own to resolve)."""
    import importlib.util
    import socket

    from qgraph.errors import UsageError

    if address is None or address == "auto":
        return
    client = address.startswith("ray://")
    if client and importlib.util.find_spec("grpc") is None:
        raise UsageError(f"--address {address}: a ray:// address needs Ray's client: pip install 'ray[client]' "
                         "(or give the cluster's HOST:6379 address from a node of the cluster).")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--address {address}: give 'auto', HOST:PORT or ray://HOST:PORT.")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise UsageError(f"--address {address}: the Ray cluster did not answer ({why} within {timeout:g} s). Check "
                         "the address and that the cluster's head node is running.") from None


def _ray_call(fn: Callable[[Any, Any], Any], boxed: list[Any], item: Any) -> Any:
    # ``boxed`` holds the ObjectRef inside a list so Ray does not resolve it per task: the worker fetches and
    # unpickles it once, then reuses it for every later task of the same map (one object kept per worker).
    import ray

    default_runs(1)  # a task holds one CPU of the cluster (num_cpus=1)
    ref = boxed[0]
    key = ref.hex()
    if key not in _RAY_SHARED:
        _RAY_SHARED.clear()
        _RAY_SHARED[key] = ray.get(ref)
    return fn(_RAY_SHARED[key], item)


def _keeping_sigterm(start: Callable[[], Any]) -> None:
    """Run ``start`` (``ray.init``), then put back the SIGTERM handler it replaced: Ray's handler calls
    ``sys.exit(15)``, which would read as user code exiting instead of the command being terminated."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    start()
    if main and previous is not None:
        signal.signal(signal.SIGTERM, previous)


class RayExecutor(Executor):
    """Ray tasks: on the Ray this process is connected to, else on one it connects to now (``ray.init``: a local
    Ray when ``address`` is None, else the cluster at ``address``).

    At most ``workers`` tasks are in flight (default: the cluster's CPUs), each asking for one CPU; a task whose
    worker process dies is re-run up to ``max_retries`` times (Ray's own retry). ``shared`` is put in the object
    store once and kept for later maps with the same object (by identity: do not mutate it in between), so each
    worker process fetches it once per search, not once per map. A Ray connected here stays up
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
            check_address(address)
            options: dict[str, Any] = {
                "address": address,
                "include_dashboard": False,
                "logging_level": logging.ERROR,
                "log_to_driver": False,  # a task's failure comes back as its exception; worker chatter does not
                **(init_options or {}),
            }
            if address is None and workers is not None:
                options.setdefault("num_cpus", workers)
            _keeping_sigterm(lambda: ray.init(**options))
            self._started = True
        self.workers = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.max_retries = max_retries
        self._remote = ray.remote(_ray_call)
        self._shared: Any = None  # the latest shared object and its object-store reference (in a list)
        self._boxed: list[Any] | None = None

    def close(self) -> None:
        """Release the shared object; shut down the Ray this executor connected to when ``keep_ray`` is False."""
        self._shared = self._boxed = None
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
        if self._boxed is None or self._shared is not shared:  # once, whatever the number of items and maps
            self._shared, self._boxed = shared, [ray.put(shared)]
        boxed = self._boxed
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
            while index and not expired(deadline):
                ready, _ = ray.wait(list(index), num_returns=1, timeout=remaining(deadline))
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
