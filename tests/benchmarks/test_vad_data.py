"""``benchmarks/vad_data.py``: silero-vad feeds streamed as the wheel's ``OnnxWrapper`` does, from synthesized speech
(skips with the reason when silero-vad or espeakng-loader is not installed)."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
for wheel in ("silero_vad", "espeakng_loader"):
    if importlib.util.find_spec(wheel) is None:
        pytest.skip(f"{wheel} is not installed (python -m pip install --no-deps silero-vad espeakng-loader)",
                    allow_module_level=True)
sys.path.insert(0, str(BENCH))
import vad_data  # noqa: E402


def test_feeds_carry_context_and_state_and_the_model_hears_speech() -> None:
    import onnxruntime as ort

    audio = vad_data.utterances(vad_data.EVAL_TEXT[:2], vad_data.EVAL_VOICES[:1], seed=3)
    feeds = vad_data.stream_feeds(audio)
    assert len(feeds) == sum((len(a) - vad_data.CHUNK) // vad_data.CHUNK + 1 for a in audio)
    assert all(f["input"].shape == (1, 576) and f["state"].shape == (2, 1, 128) for f in feeds)
    assert not feeds[0]["input"][0, :64].any() and not feeds[0]["state"].any()  # a fresh stream starts at zero
    for prev, cur in itertools.pairwise(feeds):
        np.testing.assert_array_equal(cur["input"][0, :64], prev["input"][0, -64:])  # 64 samples of context
    session = ort.InferenceSession(str(vad_data.silero_model_path()), providers=["CPUExecutionProvider"])
    prob = np.array([session.run(None, f)[0].item() for f in feeds])
    assert prob[:5].max() < 0.5 and prob.max() > 0.9  # silence first, then speech the model is sure of
    _, state = session.run(None, feeds[3])
    np.testing.assert_allclose(state, feeds[4]["state"], atol=1e-6)  # the state is carried chunk to chunk
