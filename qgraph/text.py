"""Plain-text layout shared by the terminal output and the tables: lines wrapped at words with a hanging indent.

On a terminal (or with ``COLUMNS`` set) a message wraps at the width, each continuation line indented under its
first words; on a pipe it stays one record a line (`wrap_lines` with ``width=None``), so ``grep`` and log viewers
see whole messages. Never breaks inside a word or a hyphenated name.
"""

from __future__ import annotations

import textwrap

#: Extra indentation of a wrapped message's continuation lines, under its own indentation.
HANG = 4


def wrap_lines(text: str, width: int | None, hang: int = HANG) -> list[str]:
    """``text`` as lines of at most ``width`` columns (a word longer than a line stands alone), continuation lines
    indented by ``text``'s own indentation plus ``hang``; ``width=None``: the one line ``text`` (a pipe)."""
    if width is None or len(text) <= width:
        return [text]
    indent = " " * (len(text) - len(text.lstrip(" ")) + hang)
    return textwrap.wrap(text, width=max(width, len(indent) + 20), subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False) or [text]


def pack_items(items: list[str], width: int, indent: str, sep: str = " · ") -> list[str]:
    """``items`` joined by ``sep`` into lines of at most ``width`` columns, each item kept whole (a ``header
    value`` pair never split from its value); every line starts with ``indent``. An item longer than a line
    stands alone on its own line."""
    lines: list[str] = []
    line = ""
    for item in items:
        candidate = f"{line}{sep}{item}" if line else indent + item
        if line and len(candidate) > width:
            lines.append(line)
            candidate = indent + item
        line = candidate
    if line:
        lines.append(line)
    return lines


def first_sentence(text: str) -> str:
    """The first sentence of ``text`` (a docstring's first paragraph), on one line: up to the first ``.``, ``;``
    or ``:`` followed by a space outside parentheses, reStructuredText double backticks dropped."""
    paragraph = text.strip().split("\n\n", 1)[0]
    flat, depth = " ".join(paragraph.replace("``", "").split()) + " ", 0
    for i, ch in enumerate(flat[:-1]):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch in ".;:" and flat[i + 1] == " ":
            return flat[:i] + "."
    return flat.rstrip().rstrip(".") + "." if flat.strip() else ""
