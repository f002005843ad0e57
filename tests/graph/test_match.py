"""The one refusal mechanism (`qgraph.graph.NoMatch`): what a matcher raises and how the reason reaches the report."""

from __future__ import annotations

import pytest

from qgraph import PassResult
from qgraph.graph import NoMatch


def _matcher(op: str) -> str:
    if op != "Conv":
        raise NoMatch(f"a {op} is not a Conv")
    return "matched"


def test_a_refusal_reaches_skip_with_its_reason() -> None:
    res = PassResult("demo")
    for name, op in (("a", "Conv"), ("b", "Relu")):
        try:
            _matcher(op)
        except NoMatch as refusal:
            res.skip(name, refusal)
    assert [(s.node, s.reason) for s in res.skipped] == [("b", "a Relu is not a Conv")]


@pytest.mark.parametrize(("node", "op", "where"),
                         [("", "", "why"), ("n", "", "n: why"), ("n", "Add", "Add node 'n': why")])
def test_a_refusal_says_where(node: str, op: str, where: str) -> None:
    refusal = NoMatch("why", node, op)
    assert str(refusal) == refusal.reason == "why" and refusal.where == where
