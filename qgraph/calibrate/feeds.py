"""Feeding calibration data to onnxruntime: opening the source, validating each feed, running a session."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from qgraph.errors import DataError
from qgraph.runtime.compare import session_run

Feed = Mapping[str, npt.NDArray[Any]]
DataLike = Iterable[Feed] | Callable[[], Iterable[Feed]]


class Hasher(Protocol):
    """Anything with ``update(bytes)`` (``hashlib.sha256()``)."""

    def update(self, data: bytes, /) -> None: ...


def open_data(data: DataLike) -> tuple[Iterable[Feed], int | None]:
    """The feeds to read (calling ``data`` if it is a callable) and their number when known."""
    source = data() if callable(data) else data
    return source, len(source) if isinstance(source, Sized) else None


def session_inputs(sess: Any) -> set[str]:
    return {i.name for i in sess.get_inputs()}


def feeds_of(
    source: Iterable[Feed], expected: set[str], data_hasher: Hasher | None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Validated feeds with their index; raises DataError when there are none."""
    count = 0
    for index, feed in enumerate(iterate_checked(source)):
        yield index, validated(feed, expected, index, data_hasher)
        count += 1
    if count == 0:
        raise DataError("the calibration data is empty: it yielded no feed dict; provide at least one sample")


def run_session(sess: Any, outputs: Sequence[str], arrays: Mapping[str, Any], index: int) -> list[Any]:
    try:
        return session_run(sess, outputs, arrays)
    except Exception as exc:  # onnxruntime raises its own exception classes
        raise DataError(f"calibration sample {index}: onnxruntime failed to run the model: {exc}") from exc


def iterate_checked(source: Iterable[Feed]) -> Iterator[Feed]:
    try:
        yield from source
    except TypeError as exc:
        raise DataError(f"calibration data is not iterable: {exc}") from exc


def validated(feed: Any, expected: set[str], index: int, hasher: Hasher | None) -> dict[str, npt.NDArray[Any]]:
    if type(feed) is dict and hasher is None and feed.keys() == expected and all(
        type(v) is np.ndarray for v in feed.values()
    ):
        return feed  # the common case, checked with as few calls as possible (it runs once per sample)
    if not isinstance(feed, Mapping):
        raise DataError(
            f"calibration sample {index}: expected a dict of input name -> array, got {type(feed).__name__}"
        )
    missing = sorted(expected - set(feed))
    extra = sorted(set(feed) - expected)
    if missing or extra:
        raise DataError(
            f"calibration sample {index}: input names do not match the model (missing: {missing or 'none'}, "
            f"unknown: {extra or 'none'}); the model's inputs are {sorted(expected)}"
        )
    arrays = {k: np.asarray(v) for k, v in feed.items()}
    if hasher is not None:
        for name in sorted(arrays):
            arr = np.ascontiguousarray(arrays[name])
            hasher.update(f"{name}:{arr.dtype}:{arr.shape};".encode())
            hasher.update(arr.tobytes())
    return arrays
