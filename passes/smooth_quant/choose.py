"""``alpha: auto`` for many groups at once: every candidate of every group whose sampled rows and weights have
the same shapes is scored in one stacked call (`qgraph.recovery.smoothing.smoothing_errors_stacked`), at most
`STACK_VALUES` float64 activations at a time. A model with 1,000 small MatMuls then costs a few dozen numpy calls
per shape instead of a few dozen per group; a group larger than that (a transformer's projections) is scored
alone, as before. Each group's errors, and so its choice, are the ones a call for that group alone gives, bit for
bit.
"""

from __future__ import annotations

import numpy as np

from qgraph.recovery.smoothing import smoothing_errors_stacked

#: float64 values of the stacked smoothed activations ``[groups, candidates, rows, channels]`` scored in one call
STACK_VALUES = 1 << 18

_Key = tuple[tuple[int, ...], ...]


class CandidateScorer:
    """Queue ``(rows, weights, candidates, low, high)`` per group (`add`); `errors` holds each group's
    ``[candidates]`` errors once its stack is scored: when a stack of one shape reaches `STACK_VALUES`, and at
    `flush`. Only the errors are kept, so memory stays one stack per shape whatever the number of groups."""

    def __init__(self, per_channel: bool) -> None:
        self.per_channel = per_channel
        self.errors: dict[int, np.ndarray] = {}
        self._stacks: dict[_Key, list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = {}

    def add(self, index: int, x: np.ndarray, w: np.ndarray, candidates: np.ndarray, low: np.ndarray,
            high: np.ndarray) -> None:
        """Queue group ``index``: sampled rows ``x [R, K]``, weights ``w [K, N]``, ``candidates [C, K]``."""
        key = (x.shape, w.shape, candidates.shape)
        stack = self._stacks.setdefault(key, [])
        stack.append((index, x, w, candidates, low, high))
        if len(stack) * candidates.size * x.shape[0] >= STACK_VALUES:
            self._score(key)

    def flush(self) -> None:
        """Score every queued group."""
        for key in list(self._stacks):
            self._score(key)

    def _score(self, key: _Key) -> None:
        stack = self._stacks.pop(key)
        x, w, cands, low, high = (np.stack([item[i] for item in stack]) for i in range(1, 6))
        for item, row in zip(stack, smoothing_errors_stacked(x, w, cands, low, high, per_channel=self.per_channel),
                             strict=True):
            self.errors[item[0]] = row
