"""Terminal tables that fit the console: numbers never wrap, names shorten from the middle, text wraps at words."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qgraph.analysis.diff.html import fmt, short_name
from qgraph.text import pack_items, wrap_lines

#: Narrowest a text or name column is drawn before columns are dropped (a name cut to 8 reads ``/fe…Conv``).
MIN_TEXT_WIDTH = 8
#: Narrowest a text column is shared out before the right-most text column is dropped to widen the others.
SHARE_WIDTH = 16


class _FittedTable:
    """A titled table that fits the console when rendered, whatever its width (60, 80, 120 columns, a pipe):

    - number-like columns (numbers, ``inf (exact)``, short words) keep their full width and never wrap or cut;
    - the other columns share what is left: each gets its natural width when that fits, else an equal share
      (water-filling); names (no spaces) are shortened from the middle, text wraps at words;
    - when even the narrowest text columns do not fit, text columns are dropped from the right (the title says
      which), never a number column.
    """

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

    def _natural(self, i: int) -> int:
        return max([len(r[i]) for r in self.rows] + [max((len(w) for w in self.headers[i].split()), default=1)])

    def widths(self, max_width: int) -> tuple[list[int | None], list[str]]:
        """Each column's width (None: dropped) at ``max_width`` columns, and the headers of dropped columns."""
        kinds = self._kinds()
        widths: list[int | None] = [self._natural(i) for i in range(len(kinds))]
        flexible = [i for i, k in enumerate(kinds) if k != "short"]
        dropped: list[str] = []
        while True:
            shown = [i for i, w in enumerate(widths) if w is not None]
            budget = max_width - (3 * len(shown) + 1) - sum(widths[i] or 0 for i in shown if kinds[i] == "short")
            flex = [i for i in flexible if widths[i] is not None]
            if budget >= SHARE_WIDTH * len(flex) or len(flex) <= 1:
                break
            last = flex[-1]  # the right-most text column goes first
            widths[last] = None
            dropped.append(self.headers[last])
        for i, w in zip(flex, _share(budget, [self._natural(i) for i in flex]), strict=True):
            widths[i] = w
        return widths, dropped

    def fits(self, max_width: int) -> bool:
        """Whether the number columns, with the narrowest text column beside them, fit ``max_width``; else
        `records` lays the rows out."""
        kinds = self._kinds()
        short = sum(self._natural(i) for i, k in enumerate(kinds) if k == "short")
        flexible = [k for k in kinds if k != "short"]
        shown = kinds.count("short") + min(1, len(flexible))
        return short + 3 * shown + 1 + MIN_TEXT_WIDTH * min(1, len(flexible)) <= max_width

    def records(self, max_width: int) -> list[str]:
        """The rows as records, for a width where the numbers do not fit as columns: the text cells on one line,
        then ``header value`` pairs, each wrapped at words (never inside a number)."""
        kinds = self._kinds()
        lines = []
        for r in self.rows:
            names = [short_name(r[i], max_width - 6) for i, k in enumerate(kinds) if k != "short" and r[i]]
            pairs = [f"{h} {c}" for h, c, k in zip(self.headers, r, kinds, strict=True) if k == "short"]
            lines += wrap_lines("  " + "  ".join(names), max_width) if names else []
            lines += pack_items(pairs, max_width, "      ")
        return lines

    def __rich_console__(self, console: Console, options: Any) -> Any:
        if not self.fits(options.max_width):
            yield Text(self.title, style="bold")
            for line in self.records(options.max_width):
                yield Text(line, no_wrap=True, overflow="ignore")
            return
        kinds = self._kinds()
        widths, dropped = self.widths(options.max_width)
        t = Table()
        shown = [i for i, w in enumerate(widths) if w is not None]
        for i in shown:
            w = widths[i]
            if kinds[i] == "short":  # the values never wrap or cut; the header may wrap at spaces
                t.add_column(self.headers[i], overflow="fold", min_width=w, max_width=w)
            else:
                t.add_column(self.headers[i], overflow="fold", min_width=w, max_width=w,
                             no_wrap=kinds[i] == "name")
        for r in self.rows:
            cells = []
            for i in shown:
                w, c = widths[i] or MIN_TEXT_WIDTH, r[i]
                cells.append(short_name(c, w) if kinds[i] == "name" else _short_tokens(c, w) if kinds[i] == "text"
                             else c)
            t.add_row(*cells)
        note = f" (column{'s' if len(dropped) > 1 else ''} {', '.join(dropped)} left out: widen the terminal or " \
               "use --json)" if dropped else ""
        yield Text(self.title + note, style="bold")
        yield t


def _share(budget: int, naturals: Sequence[int]) -> list[int]:
    """Widths for columns wanting ``naturals`` within ``budget``: the narrow ones get what they want, the rest
    share equally what is left (water-filling); never below `MIN_TEXT_WIDTH`."""
    widths = [0] * len(naturals)
    left, todo = budget, sorted(range(len(naturals)), key=lambda i: naturals[i])
    while todo:
        share = left // len(todo)
        i = todo[0]
        if naturals[i] <= share:
            widths[i] = naturals[i]
            left -= naturals[i]
            todo.pop(0)
            continue
        for j in todo:
            widths[j] = max(MIN_TEXT_WIDTH, share)
        break
    return widths


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
    return " ".join(short_name(tok, max(width, MIN_TEXT_WIDTH)) if len(tok) > width else tok
                    for tok in text.split(" "))


def sqnr_cell(value: float, kind: str = "exact") -> str | float:
    """An SQNR for a table: infinity spelled out (``inf (exact)``: identical values; ``inf (adds none)``: the
    layer adds no error of its own; ``inf (exact inputs)``)."""
    return f"inf ({kind})" if value == math.inf else value
