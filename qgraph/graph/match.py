"""How a pass says a rewrite does not apply: one type, used by every pass (after onnxscript's ``MatchResult``).

A matcher returns ``MatchResult.ok()`` or ``MatchResult.fail(reason, node)``; code deep inside a matcher may
``raise NoMatch(reason)`` instead and let `MatchResult.attempt` turn it into a result. A failed match is not an
error: the pass reports it as a skipped node with its reason (``PassResult.skip``), so a user sees why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class NoMatch(Exception):
    """Raised inside a matcher: the pattern does not apply, for ``reason`` (a sentence a user can act on)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class MatchResult:
    """Whether a pattern applies at a node, and why not when it does not (truthy when it matched)."""

    node: str = ""
    reason: str | None = None
    #: The node's op type, when the caller knows it (shown as "Op node 'name': reason").
    op: str = ""

    def __bool__(self) -> bool:
        return self.reason is None

    def __str__(self) -> str:
        where = f"{self.op} node {self.node!r}" if self.op else self.node
        return f"{where}: {self.reason}" if self.reason is not None else f"{where}: matched"

    @classmethod
    def ok(cls, node: str = "") -> MatchResult:
        """The pattern applies."""
        return cls(node)

    @classmethod
    def fail(cls, reason: str, node: str = "", op: str = "") -> MatchResult:
        """The pattern does not apply at ``node`` (an ``op`` node) because of ``reason``."""
        return cls(node, reason, op)

    @staticmethod
    def attempt(fn: Callable[[], T], node: str = "") -> T | MatchResult:
        """``fn()``, or a failed `MatchResult` when it raises `NoMatch`."""
        try:
            return fn()
        except NoMatch as exc:
            return MatchResult.fail(exc.reason, node)
