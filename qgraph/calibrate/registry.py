"""The calibration methods by name: ``make_observer("entropy", ...)`` and the ``OBSERVERS`` table."""

from __future__ import annotations

from typing import Any

from qgraph.calibrate.auto import AutoObserver
from qgraph.calibrate.observer_base import Observer
from qgraph.calibrate.observers import EntropyObserver, MinMaxObserver, MseObserver, PercentileObserver

__all__ = ["OBSERVERS", "make_observer"]

OBSERVERS: dict[str, type[Observer]] = {
    cls.method: cls for cls in (MinMaxObserver, PercentileObserver, EntropyObserver, MseObserver, AutoObserver)
}


def make_observer(method: str, name: str = "", axis: int | None = None, **options: Any) -> Observer:
    """Create the observer for ``method`` (``minmax``, ``percentile``, ``entropy``, ``mse``, ``auto``).

    Raises:
        ValueError: unknown method or option.
    """
    try:
        cls = OBSERVERS[method]
    except KeyError:
        known = ", ".join(sorted(OBSERVERS))
        raise ValueError(f"unknown calibration method {method!r}; choose one of {known}") from None
    try:
        return cls(name, axis, **options)
    except TypeError as exc:
        raise ValueError(f"invalid options for calibration method {method!r}: {exc}") from None
