"""Plain-text helpers (`qgraph.text`) and the one-sentence summaries built on them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qgraph.pipeline.pass_api import discover
from qgraph.text import first_sentence, wrap_lines


def test_first_sentence_stops_outside_parentheses_and_drops_rst_backticks() -> None:
    assert first_sentence("Rank nodes (the first K measured exactly: gain when float); with --target, search.") \
        == "Rank nodes (the first K measured exactly: gain when float)."
    assert first_sentence("Cross-layer equalization: ``W1[i] /= s_i``\nmore\n\nSecond paragraph.") \
        == "Cross-layer equalization."
    assert first_sentence("Fold ``BatchNormalization``\ninto the Conv before it") \
        == "Fold BatchNormalization into the Conv before it."
    assert first_sentence("") == ""


def test_every_pass_summary_is_one_whole_sentence() -> None:
    for name, cls in discover().items():
        summary = cls.summary()
        assert summary.endswith(".") and "``" not in summary and "\n" not in summary, (name, summary)
        assert not summary.rstrip(".").endswith((" with", " and", " or", " the", " a", " of")), (name, summary)


@given(st.lists(st.from_regex(r"[a-z]{1,15}", fullmatch=True), min_size=1, max_size=40),
       st.integers(min_value=30, max_value=120), st.integers(min_value=0, max_value=6))
def test_wrap_lines_keeps_every_word_in_order_within_the_width(words: list[str], width: int, indent: int) -> None:
    text = " " * indent + " ".join(words)
    lines = wrap_lines(text, width)
    assert " ".join(" ".join(lines).split()) == " ".join(words)
    assert all(len(line) <= max(width, indent + 4 + 20) for line in lines)
    assert all(line.startswith(" " * (indent + 4)) for line in lines[1:])
