"""The PP-OCRv4 recognizer (rapidocr wheel) quantized by the host's ready recipe reads held-out text lines as float
does (issue #33): exact match against the printed strings within a few lines of float's, CER against float's
strings small. Measured with the target CPU's arithmetic (``accuracy``: CI runs it again with an AVX2 and a VNNI
host declared). Skips without the wheel (``python -m pip install --no-deps rapidocr-onnxruntime==1.4.4``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from qgraph import Pipeline, Recipe
from qgraph.metrics import builtin_metric
from qgraph.metrics.text import greedy
from qgraph.runtime.kernels.measure import choose, model_target

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _wheel() -> None:
    if importlib.util.find_spec("rapidocr_onnxruntime") is None:  # not imported: its __init__ needs cv2
        pytest.skip("rapidocr_onnxruntime is not installed (python -m pip install --no-deps "
                    "rapidocr-onnxruntime==1.4.4; .ci/run installs it)")


def test_int8_recognizer_reads_the_lines_float_reads(rm: ModuleType, tmp_path: Path) -> None:
    model, cal, ev, spec = rm.load("ocr_rec", n_cal=16, n_eval=40)
    np.savez(tmp_path / "cal.npz", **rm.stack(cal))
    res = Pipeline(Recipe.from_yaml(ROOT / "recipes" / "ort-cpu.yaml").passes).run(
        model, calibration_data=str(tmp_path / "cal.npz"), samples=len(cal))
    int8 = res.model
    session = choose(model_target(int8)).kernels.session(int8)  # this host's kernels, or the target CPU emulated
    got = np.concatenate([session.run(None, f)[0] for f in ev])
    ref = np.concatenate([r[spec.outputs[0]] for r in rm.run_model(model, ev, spec)])
    rec, chars, texts = rm.ocr_rec_module(), spec.extra["chars"], [str(t) for t in spec.labels]
    floats, mine = rec.truth_scores(greedy(ref, 0), texts, chars), rec.truth_scores(greedy(got, 0), texts, chars)
    # measured on these 40 lines (2026-11-28, AMD Zen 4): float 0.675 exact (stripped) / 0.025 CER against the
    # printed strings; INT8 the same 0.675 / 0.023 with VNNI and with AVX2 emulated; against float's strings CER
    # 0.014 (VNNI) / 0.008 (AVX2), probabilities at 21 dB
    assert mine["exact_strip"] >= floats["exact_strip"] - 0.05  # at most 2 of the 40 lines more misread
    assert mine["cer_nospace"] <= floats["cer_nospace"] + 0.01
    assert builtin_metric("ctc.cer")([got], [ref]) <= 0.03
    assert rm.sqnr_db(ref, got) >= 15.0
