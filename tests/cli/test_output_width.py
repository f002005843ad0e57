"""Output that fits the terminal: tables keep every number at 60, 80 and 120 columns (text columns shrink,
then drop, then the rows become records), messages wrap at words on a terminal and stay one line on a pipe,
help reads at 80 columns, and no progress line reaches a pipe."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from qgraph.analysis.diff.tables import MIN_TEXT_WIDTH, rich_table
from qgraph.cli._app import emit
from qgraph.text import pack_items, wrap_lines

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits"
WIDTHS = (60, 80, 120)
SPINNER = re.compile("[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏━]")


def _render(table: object, width: int) -> list[str]:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.file.getvalue().splitlines()  # type: ignore[attr-defined]


names = st.text(alphabet="abcdefghij/._0123456789", min_size=1, max_size=70)
numbers = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False) | st.sampled_from([float("inf"), "inf (exact)"])


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(names, names, numbers, numbers, numbers, numbers), min_size=1, max_size=6),
       width=st.sampled_from(WIDTHS))
def test_a_table_fits_and_keeps_every_number(rows: list[tuple[object, ...]], width: int) -> None:
    headers = ["node", "tensor", "SQNR dB", "input SQNR dB", "cosine", "max abs"]
    table = rich_table("layers", headers, [list(r) for r in rows])
    lines = _render(table, width)
    assert all(len(line) <= width for line in lines), "\n".join(lines)
    text = "\n".join(lines)
    for r in table.rows:  # each number as formatted, whole, on one line
        for cell in r[2:]:
            assert cell in text, (cell, text)


def test_text_columns_shrink_then_drop_never_numbers() -> None:
    row = ["/encoder/layer.0/attention/self/query/MatMul", "MatMul", "/encoder/layer.0/attention/output_0", 38.25,
           41.5, 0.99991, 0.0123]
    table = rich_table("t", ["node", "op", "tensor", "SQNR dB", "input SQNR dB", "cosine", "max abs"], [row])
    numbers = [5, 5, 6, 6]  # "38.25", header word "input", "0.9999", "0.0123"
    # 80 columns: the right-most text column goes first; the node name gets the rest
    assert table.widths(80) == ([33, 6, None, *numbers], ["tensor"])
    assert table.widths(60) == ([22, None, None, *numbers], ["tensor", "op"])  # then the next; numbers stay
    assert table.widths(200) == ([44, 6, 35, *numbers], [])
    assert table.widths(45)[0][0] == MIN_TEXT_WIDTH  # a name is never drawn narrower
    assert not table.fits(40) and table.fits(60)  # below that the rows become records
    records = table.records(40)
    assert all(len(line) <= 40 for line in records) and "SQNR dB 38.25" in "\n".join(records)


def test_messages_wrap_at_words_on_a_terminal_and_stay_one_line_on_a_pipe() -> None:
    text = "    decision: calibration method auto chose minmax for 2, mse for 2, entropy for 1 tensor(s) by error"
    tty = Console(width=60, file=io.StringIO(), force_terminal=True, color_system=None)
    emit(tty, text)
    lines = tty.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 2 and all(len(line) <= 60 for line in lines)
    assert lines[1].startswith(" " * 8) and not lines[1].startswith(" " * 9)  # hanging under the message
    assert " ".join(" ".join(lines).split()) == " ".join(text.split())  # no word broken or lost
    pipe = Console(width=60, file=io.StringIO(), force_terminal=False)
    emit(pipe, text)
    assert pipe.file.getvalue() == text + "\n"  # type: ignore[attr-defined]


@given(st.lists(st.from_regex(r"[ab]{1,12}( [ab.]{1,30})?", fullmatch=True), min_size=1, max_size=12),
       st.integers(min_value=20, max_value=120))
def test_pack_items_keeps_every_item_whole_and_in_order(items: list[str], width: int) -> None:
    lines = pack_items(items, width, "  ")
    assert all(line.startswith("  ") for line in lines)
    assert [part for line in lines for part in line[2:].split(" · ")] == items
    assert all(len(line) <= width or " · " not in line for line in lines)  # only a lone long item overflows


def test_wrap_lines_never_breaks_a_word() -> None:
    words = "a" * 30 + " " + "b" * 10
    assert wrap_lines(words, 20) == ["a" * 30, "    " + "b" * 10]
    assert wrap_lines(words, None) == [words]


@pytest.fixture(scope="module")
def digits_int8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("w") / "d8.onnx"
    from qgraph.cli import main

    assert main(["run", str(ROOT / "recipes" / "ort-cpu.yaml"), str(DIGITS / "model.onnx"), "-q", "-o", str(out),
                 "--calibration-data", str(DIGITS / "calibration.npz"), "--no-check"]) == 0
    return out


def _cli(args: list[str], columns: int | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-c", "import sys; from qgraph.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("columns", [*WIDTHS, None])
def test_diff_fits_every_width_with_every_sqnr(digits_int8: Path, tmp_path: Path, columns: int | None) -> None:
    report = tmp_path / "d.json"
    done = _cli(["diff", str(DIGITS / "model.onnx"), str(digits_int8), "--eval-data", str(DIGITS / "eval.npz"),
                 "--json", str(report)], columns)
    assert done.returncode == 0, done.stderr
    width = columns or 120  # a pipe: tables at PIPED_WIDTH
    too_wide = [line for line in done.stdout.splitlines() if len(line) > width and "│" in line]
    assert not too_wide, "\n".join(too_wide)
    layers = json.loads(report.read_text())["numeric"]["layers"]
    sqnrs = {f"{x['sqnr_db']:.4g}" for x in layers if isinstance(x.get("sqnr_db"), float)}
    assert sqnrs and all(s in done.stdout for s in sqnrs), (sqnrs, done.stdout)
    assert not SPINNER.search(done.stderr)


def test_a_piped_run_prints_no_progress_line_and_one_record_a_line(tmp_path: Path) -> None:
    done = _cli(["run", str(ROOT / "recipes" / "ort-x86-vnni.yaml"), str(DIGITS / "model.onnx"), "-o",
                 str(tmp_path / "m.onnx"), "--calibration-data", str(DIGITS / "calibration.npz")], None)
    assert done.returncode == 0, done.stderr
    assert not SPINNER.search(done.stderr), done.stderr
    decisions = [line for line in done.stderr.splitlines() if line.startswith("    decision: ")]
    assert decisions and all(line.rstrip() == line for line in decisions)
    # a record is never continued on the next line: every line starts a message, a pass or a result
    assert all(re.match(r"(  )?(✓|✗|  \w|\w)", line) for line in done.stderr.splitlines() if line), done.stderr


def test_help_is_readable_at_80_columns() -> None:
    done = _cli(["run", "--help"], 80)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and all(len(line) <= 80 for line in lines)
    samples = next(i for i, line in enumerate(lines) if line.lstrip().startswith("--samples"))
    assert "Read at most N calibration samples" in lines[samples]  # the text beside the option, 40+ columns
    assert "qgraph[ray]" in done.stdout and "\\[" not in done.stdout
    top = _cli(["--help"], 80).stdout
    listed = re.findall(r"^  (\w+) {2,}", top.split("Commands:")[1], re.M)
    assert listed[:3] == ["run", "check", "diff"]
