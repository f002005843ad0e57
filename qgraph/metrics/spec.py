"""The text of a built-in metric: ``NAME[.FIELD][(OPTION=VALUE, ...)]``.

``detection.f1(score=0.3, iou=0.5)`` names the family ``detection``, its field ``f1`` and two options. The same
text works after ``--metric``, in a target (``detection.f1:0.98``, ``ctc.cer<=float+0.01``) and in a recipe's
``float_fallback.auto.target``. A text with a ``:`` before any ``(`` is a user metric (``module:function``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from qgraph.errors import QGraphError

_SPEC = re.compile(r"^(?P<name>[a-z][a-z0-9_]*)(?:\.(?P<field>[a-z][a-z0-9_]*))?\s*(?:\((?P<opts>[^()]*)\))?$")
_OPTION = re.compile(r"^\s*(?P<key>[a-z][a-z0-9_]*)\s*=\s*(?P<value>[^=]*?)\s*$")


@dataclass(frozen=True)
class MetricSpec:
    """A parsed metric text: family, field (None: the family's default) and option texts."""

    text: str
    name: str
    field: str | None
    options: dict[str, str] = dataclasses.field(default_factory=dict)


def looks_builtin(text: str) -> bool:
    """Whether ``text`` has the shape of a built-in metric (a name, no ``module:function`` colon)."""
    head = text.strip().split("(", 1)[0]
    return ":" not in head and "/" not in head and _SPEC.match(head.strip()) is not None


def parse_spec(text: str, error: type[QGraphError]) -> MetricSpec:
    """Parse ``text``; a malformed option list raises ``error`` naming the fix."""
    raw = text.strip()
    m = _SPEC.match(raw)
    if m is None:
        raise error(f"metric {text!r}: expected NAME[.FIELD][(option=value, ...)], e.g. detection.f1(score=0.3).")
    options: dict[str, str] = {}
    for part in (m["opts"] or "").split(","):
        if not part.strip():
            continue
        o = _OPTION.match(part)
        if o is None:
            raise error(f"metric {text!r}: option {part.strip()!r} is not option=value (lists join with '/', "
                        "e.g. strides=8/16/32/64).")
        if o["key"] in options:
            raise error(f"metric {text!r}: option {o['key']!r} given twice.")
        options[o["key"]] = o["value"]
    return MetricSpec(raw, m["name"], m["field"], options)
