"""Hostile input, part 3: random recipes and random bytes as models never crash the CLI, and the installed console
script answers usage errors with exit 2 and its usage text (issue #17 done-when, issue #12 item 9)."""

from __future__ import annotations

import hashlib
import os
import resource
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_support import calibration, hang_guard  # type: ignore[import-not-found]
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_round2 import two_outputs  # type: ignore[import-not-found]

from qgraph.cli import main

# YAML-ish text: the characters recipes are made of plus a few that YAML treats specially.
_YAML_ALPHABET = st.sampled_from([*"abcdefgnpsrt_ :-[]{}&*!|>#'\"\n\t0123456789.,", "pass", "passes", "name"])
_RECIPE_WORDS = st.sampled_from([
    "name: r\n", "passes:\n", "  - pass: cleanup\n", "  - pass: fold_constants\n", "    max_bytes: -1\n",
    "  - pass: insert_qdq\n", "    preset: tensorrt\n", "    nodes: {regex: ['(']}\n", "target: {opset: 99}\n",
    "calibration: {samples: 0}\n", "x: &a [1, 2]\n", "y: [*a, *a]\n", "  - pass: lower_opset\n",
    "    opset: 9\n", "  - !!python/object:os.system 'true'\n", "\x00", "passes: []\n",
])


def _bounded(argv: list[str]) -> tuple[int, float]:
    start = time.perf_counter()
    code = main(argv)
    return code, time.perf_counter() - start


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.lists(_RECIPE_WORDS, max_size=12).map("".join),
                      st.lists(_YAML_ALPHABET, max_size=200).map("".join)))
def test_random_recipes_never_crash(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text, encoding="utf-8")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, seconds = _bounded(["validate", str(recipe)])
    captured = capsys.readouterr()
    assert code in (0, 2), (code, text)
    assert "Traceback" not in captured.err + captured.out
    assert seconds < 5.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200_000  # KiB


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=400))
def test_random_bytes_as_models_never_crash(tmp_path: Path, capsys: pytest.CaptureFixture[str], blob: bytes) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(blob)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\npasses:\n  - pass: cleanup\n")
    for argv in (["inspect", str(model)], ["run", str(recipe), str(model), "-o", str(tmp_path / "o.onnx")]):
        code, seconds = _bounded(argv)
        captured = capsys.readouterr()
        assert code in (0, 1, 2), argv
        assert "Traceback" not in captured.err + captured.out
        assert seconds < 5.0
    assert model.read_bytes() == blob


def _console_script() -> Path:
    script = Path(sys.executable).parent / "qgraph"
    if not script.exists():
        pytest.fail(f"the qgraph console script is not installed beside {sys.executable}: install the package "
                    "(pip install -e .) in this environment")
    return script


@pytest.mark.parametrize(
    ("args", "says"),
    [([], "Usage: qgraph"), (["bogus"], "No such command 'bogus'"),
     (["lower", "m.onnx", "--opset", "abc", "-o", "o.onnx"], "Invalid value for '--opset'")],
    ids=["no-args", "unknown-command", "bad-option-value"],
)
def test_installed_console_script_usage_errors(tmp_path: Path, args: list[str], says: str) -> None:
    proc = subprocess.run([str(_console_script()), *args], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert says in text
    assert "Usage:" in text
    assert "Traceback" not in text
    assert list(tmp_path.iterdir()) == []


# Round 2 (issue #31): each input of `check` drawn from good files, files that are not regular (a FIFO, a device
# node, a symlink loop) and models that must never pass the gate (outputs swapped, every output NaN).
_KINDS = st.sampled_from(["good", "fifo", "device", "loop", "swapped", "nan"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reference=_KINDS, candidate=_KINDS, data=st.sampled_from(["good", "fifo", "device", "loop"]))
@example(reference="good", candidate="nan", data="good")  # every run: a NaN model beside good ones must fail on
@example(reference="nan", candidate="swapped", data="good")  # its NaN (a drawn case once met other output names)
def test_hostile_files_in_check_never_hang_crash_or_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         reference: str, candidate: str, data: str) -> None:
    # a fresh folder per example: hypothesis may run the same example again (replay, shrinking)
    folder = Path(tempfile.mkdtemp(prefix=f"{reference}-{candidate}-{data}-", dir=tmp_path))

    def make(kind: str, name: str, good: onnx.ModelProto | None) -> Path:
        path = folder / name
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "device":
            try:
                os.mknod(path, 0o600 | stat.S_IFCHR, os.stat("/dev/zero").st_rdev)
            except (PermissionError, FileNotFoundError):
                os.mkfifo(path)  # no right to make a device node here: a FIFO blocks just as well
        elif kind == "loop":
            path.symlink_to(path)
        elif kind == "nan" and good is not None:
            # the good model's outputs, every value NaN: the output names match, so only the NaN can fail it
            onnx.save(two_outputs(("y", "s"), weight=np.full((4, 3, 3, 3), np.nan, np.float32)), path)
        elif kind == "swapped" and good is not None:
            onnx.save(two_outputs(("s", "y")), path)
        elif good is not None:
            onnx.save(good, path)
        else:
            np.savez(path, **calibration())
        return path

    good = two_outputs(("y", "s"))
    paths = [make(reference, "ref.onnx", good), make(candidate, "cand.onnx", good), make(data, "data.npz", None)]
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths if not p.is_symlink() and p.is_file()}
    with hang_guard(120):
        code = main(["check", str(paths[0]), str(paths[1]), "--data", str(paths[2])])
    text = " ".join((lambda c: c.err + c.out)(capsys.readouterr()).split())
    assert "Traceback" not in text
    assert code in (0, 1, 2), text
    if code == 0:  # a PASS only for good inputs: swapped outputs are the same outputs, paired by name
        assert {reference, candidate} <= {"good", "swapped"} and data == "good", text
    if "nan" in (reference, candidate) and data == "good" and {reference, candidate} <= {"good", "swapped", "nan"}:
        assert code == 1 and "NaN/Inf in output" in text, text
    assert before == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in before}
