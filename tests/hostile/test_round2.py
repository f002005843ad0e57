"""Hostile input, round 2 (issue #31): every file an input reads is safe from the outputs, the gate never passes
what it did not check, invalid models are blamed on the model, and nothing hangs. One case per item of the issue,
each building its hostile files in the workspace (see `conftest.Workspace.run` for the promises checked)."""

from __future__ import annotations

import os

import onnx
import pytest
from conftest import RECIPE_PREP, Workspace, conv_model  # type: ignore[import-not-found]


def save_external(ws: Workspace, name: str = "m.onnx", data: str = "m.data") -> None:
    """``conv_model`` saved as ``name`` with every weight in ``data`` beside it."""
    onnx.save(conv_model(), ws.root / name, save_as_external_data=True, location=data, size_threshold=0)


# ------------------------------------------------------------------ 1. outputs never replace a file an input reads
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "{prep.yaml}", "{m.onnx}", "-o", "{m.data}"], "-o {m.data}: writing it would overwrite a file"),
        (["run", "{prep.yaml}", "{m.onnx}", "-o", "{m}"], "the model's weights would go to {m.data}"),
        (["lower", "{m.onnx}", "--opset", "13", "-o", "{m.data}"], "({m.onnx}, which reads {m.data})"),
        (["diff", "{m.onnx}", "{model.onnx}", "--html", "{m.data}"], "--html {m.data}: writing it"),
        (["diff", "{model.onnx}", "{m.onnx}", "--json", "{hard.data}"], "which reads"),
        (["check", "{model.onnx}", "{m.onnx}", "--data", "{data.npz}", "--json", "{m.data}"], "which reads"),
        (["run", "{prep.yaml}", "{model.onnx}", "-o", "{folder/b.npz}", "--calibration-data", "{folder}"],
         "which reads {folder/b.npz}"),
        (["run", "{cal.yaml}", "{model.onnx}", "-o", "{data.npz}"], "is also an input"),
        (["diff", "{model.onnx}", "{model.onnx}", "--inputs", "{data.npz}", "--metric", "{metric.py}:score",
          "--json", "{metric.py}"], "is also an input"),
        (["calibrate", "{cal.yaml}", "{model.onnx}", "-o", "{data.npz}"], "is also an input"),
    ],
    ids=["run-external-data", "run-companion-data", "lower-external-data", "diff-html", "diff-json-hard-link",
         "check-json", "data-folder-file", "recipe-calibration-data", "metric-file", "calibrate-recipe-data"],
)
def test_an_output_never_overwrites_a_file_an_input_reads(ws: Workspace, argv: list[str], says: str) -> None:
    save_external(ws)
    os.link(ws.root / "m.data", ws.root / "hard.data")
    (ws.root / "folder").mkdir()
    for name in ("a.npz", "b.npz"):
        (ws.root / "folder" / name).write_bytes((ws.root / "data.npz").read_bytes())
    (ws.root / "cal.yaml").write_text(RECIPE_PREP + f"calibration: {{data: {ws.path('data.npz')}}}\n")
    (ws.root / "metric.py").write_text("def score(outputs, refs):\n    return 1.0\n")
    names = ["prep.yaml", "cal.yaml", "m.onnx", "m.data", "hard.data", "model.onnx", "data.npz", "folder/b.npz",
             "folder", "metric.py", "m"]

    def fill(text: str) -> str:
        for name in sorted(names, key=len, reverse=True):
            text = text.replace("{" + name + "}", ws.path(name))
        return text

    ws.run(*[fill(a) for a in argv], code=2, says=(fill(says),))
