"""Consecutive samples concatenated into batches (calibration and evaluation run batched)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized

import numpy as np

from .inputs import Feed


class Batches:
    """Consecutive feeds concatenated along axis 0 into batches of ``batch_size`` (the last may be smaller).

    Iterable once per ``iter()`` over ``feeds``; has a length when ``feeds`` has one (progress bars with ETA).
    """

    def __init__(self, feeds: Iterable[Feed], batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.feeds, self.batch_size = feeds, batch_size

    def __len__(self) -> int:
        if not isinstance(self.feeds, Sized):
            raise TypeError("the underlying feeds have no length")
        return -(-len(self.feeds) // self.batch_size)

    def __iter__(self) -> Iterator[Feed]:
        pending: list[Feed] = []
        for feed in self.feeds:
            pending.append(feed)
            if len(pending) == self.batch_size:
                yield _concat(pending)
                pending = []
        if pending:
            yield _concat(pending)


def batched(feeds: Iterable[Feed], batch_size: int) -> Iterable[Feed]:
    """:class:`Batches` of ``feeds``: sized when ``feeds`` is, a plain generator otherwise."""
    batches = Batches(feeds, batch_size)
    return batches if isinstance(feeds, Sized) else iter(batches)


def _concat(feeds: list[Feed]) -> Feed:
    if len(feeds) == 1:
        return feeds[0]
    return {k: np.concatenate([f[k] for f in feeds], axis=0) for k in feeds[0]}
