"""How a pass says a rewrite does not apply: one mechanism, used by every pass.

A matcher that finds the pattern does not apply raises `NoMatch` with a sentence a user can act on, however deep
inside the matcher it is found; the pass catches it where it loops over nodes and hands it to
``PassResult.skip(node, refusal)``, so the user sees why that node was left alone. A failed match is not an error
(that is `qgraph.errors.PassError`). Refusals that are collected rather than skipped one by one (``lower_opset``
lists every node it cannot lower before refusing the model) keep the `NoMatch` objects: each knows its node and op.

    try:
        found = match_conv_bn(graph, node)
    except NoMatch as refusal:
        res.skip(node.name, refusal)
        continue
"""

from __future__ import annotations


class NoMatch(Exception):
    """The pattern does not apply, for ``reason`` (a sentence a user can act on); ``node`` / ``op`` say where,
    when the code raising it knows. ``str()`` is the reason alone; `where` adds the node."""

    def __init__(self, reason: str, node: str = "", op: str = "") -> None:
        super().__init__(reason)
        self.reason, self.node, self.op = reason, node, op

    @property
    def where(self) -> str:
        """``<op> node '<name>': <reason>`` (or ``<name>: <reason>`` without an op; the reason alone without a
        node): the refusal as a line of a list."""
        place = f"{self.op} node {self.node!r}" if self.op else self.node
        return f"{place}: {self.reason}" if place else self.reason
