"""Terminal tables that fit the console: numbers never wrap, names shorten from the middle, text wraps at words."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qgraph.analysis.diff.html import fmt, short_name


class _FittedTable:
    """A titled table that fits the console when rendered: numbers never wrap, names are shortened from the
    middle to share the width left (never wrapped per character), text wraps at words."""

    def __init__(self, title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.title, self.headers = title, list(headers)
        self.rows = [[fmt(c, 4) if not isinstance(c, str) else c for c in r] for r in rows]

    def _kinds(self) -> list[str]:
        kinds = []
        for i in range(len(self.headers)):
            col = [r[i] for r in self.rows if r[i] not in ("", "-")]
            if col and all(_is_name(c) and not _is_number(c) for c in col):
                kinds.append("name")
            elif all(_is_number(c) or len(c) <= 16 for c in col):
                kinds.append("short")
            else:
                kinds.append("text")
        return kinds

    def __rich_console__(self, console: Console, options: Any) -> Any:
        kinds = self._kinds()
        fixed = [max([len(r[i]) for r in self.rows] + [min(len(h), 8)])
                 for i, (h, k) in enumerate(zip(self.headers, kinds, strict=True)) if k == "short"]
        n_name = kinds.count("name")
        text_widths = [min(40, max((len(r[i]) for r in self.rows), default=8)) for i, k in enumerate(kinds)
                       if k == "text"]
        budget = options.max_width - sum(fixed) - 3 * len(kinds) - 1 - sum(text_widths)
        longest = max((len(r[i]) for r in self.rows for i, k in enumerate(kinds) if k == "name"), default=0)
        name_width = max(16, min(longest, budget // n_name)) if n_name else 0
        t = Table()
        for i, (h, k) in enumerate(zip(self.headers, kinds, strict=True)):
            if k == "text":
                longest_text = max((len(r[i]) for r in self.rows), default=8)
                t.add_column(h, overflow="fold", min_width=min(40, longest_text))
            elif k == "name":
                t.add_column(h, no_wrap=True, overflow="ellipsis", max_width=name_width)
            else:  # the values never wrap, the header may (at spaces)
                t.add_column(h, overflow="fold", min_width=max([len(r[i]) for r in self.rows] +
                                                               [len(w) for w in h.split()]))
        for r in self.rows:
            t.add_row(*(short_name(c, name_width) if k == "name" else _short_tokens(c) if k == "text" else c
                        for c, k in zip(r, kinds, strict=True)))
        yield Text(self.title, style="bold")
        yield t


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value) and not any(ch.isspace() for ch in value)


def _is_number(value: str) -> bool:
    try:
        float(value.split(" ")[0].rstrip("%"))
    except ValueError:
        return False
    return True


def rich_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> _FittedTable:
    """A bold title line over a table that fits the console (see `_FittedTable`)."""
    return _FittedTable(title, headers, rows)


def _short_tokens(text: str, width: int = 32) -> str:
    """Long names inside a text cell shortened from the middle, so the cell wraps at words, not per letter."""
    return " ".join(short_name(tok, width) if len(tok) > width else tok for tok in text.split(" "))


def sqnr_cell(value: float, kind: str = "exact") -> str | float:
    """An SQNR for a table: infinity spelled out (``inf (exact)``: identical values; ``inf (adds none)``: the
    layer adds no error of its own; ``inf (exact inputs)``)."""
    return f"inf ({kind})" if value == math.inf else value
