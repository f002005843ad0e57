"""`qgraph.PassDetails`: the JSON form of a typed details record (order, absent keys, nesting), its read-only
mapping view, and `PassResult` taking a record or a plain dict alike."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from qgraph import PassDetails, PassResult, Skipped
from qgraph.pipeline.pass_details import KEEP_NONE, details_dict


@dataclass(frozen=True)
class _Row(PassDetails):
    node: str
    range: tuple[float, float]
    axis: int | None = field(default=None, metadata=KEEP_NONE)


@dataclass(frozen=True, kw_only=True)
class _Details(PassDetails):
    early: dict[str, int] | None = None
    count: int
    rows: list[_Row]
    skipped: list[Skipped] = field(default_factory=list)
    optional: str | None = None


def test_json_form_follows_the_fields() -> None:
    d = _Details(count=2, rows=[_Row("a", (0.0, 1.5)), _Row("b", (-1.0, 1.0), axis=0)], skipped=[Skipped("c", "why")])
    assert json.dumps(d.to_dict()) == (
        '{"count": 2, "rows": [{"node": "a", "range": [0.0, 1.5], "axis": null}, '
        '{"node": "b", "range": [-1.0, 1.0], "axis": 0}], "skipped": [{"node": "c", "reason": "why"}]}'
    )
    assert list(_Details(early={"x": 1}, count=0, rows=[], optional="o").to_dict()) == [
        "early", "count", "rows", "skipped", "optional"]


def test_mapping_view_reads_like_the_old_dict() -> None:
    d = _Details(count=3, rows=[_Row("a", (0.0, 1.0))])
    assert d["count"] == 3 and d["rows"] == [{"node": "a", "range": [0.0, 1.0], "axis": None}]
    assert "optional" not in d and d.get("optional", "absent") == "absent" and len(d) == 3
    assert d.count == 3 and d.rows[0].range == (0.0, 1.0)  # the typed attributes


def test_pass_result_serialises_a_record_like_the_dict() -> None:
    typed, plain = PassResult(), PassResult()
    typed.details = _Details(count=1, rows=[])
    plain.details = {"count": 1, "rows": [], "skipped": []}
    assert json.dumps(typed.to_dict()) == json.dumps(plain.to_dict())
    assert plain.details_dict() is plain.details  # a plug-in's dict is passed on as it is
    assert details_dict(typed.details) == {"count": 1, "rows": [], "skipped": []}
