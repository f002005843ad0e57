"""The OCR text recognizer of the real-weight corpus: text-line crops, the wheel's preprocessing, the characters.

``rapidocr_onnxruntime`` (PyPI, Apache-2.0) ships ``models/ch_PP-OCRv4_rec_infer.onnx``, the PP-OCRv4 CTC text
recognizer (PP-LCNetV3 backbone, an SVTR neck: two small transformer blocks with LayerNorm spelled ReduceMean /
Sub / Pow / Sqrt / Div, MatMul attention, Softmax; a Linear head and a Softmax over 6,625 classes at opset 12).
Input ``x`` ``[N, 3, 48, W]``, output ``[N, W/8, 6625]`` probabilities. Nothing here imports the wheel (its
``__init__`` needs cv2): the model is read as a file, the preprocessing is done with numpy, the decoding is
qgraph's built-in ``ctc`` metric (greedy, `qgraph.metrics.text`).

Characters (``ch_ppocr_rec/utils.py`` ``CTCLabelDecode`` with the list the wheel reads from the model's
``metadata_props["character"]``, one per line): index 0 is ``blank``, then the 6,623 listed characters, then
``" "`` appended last (index 6624).

Preprocessing (``TextRecognizer.resize_norm_img`` with ``rec_img_shape: [3, 48, 320]``): the crop (BGR, as cv2
reads it) is resized to height 48 and width ``min(ceil(48 * w / h), W)`` with cv2's bilinear interpolation
(``cv2.resize`` default, half-pixel centres, no antialiasing: done here in numpy), scaled to
``(x/255 - 0.5) / 0.5``, CHW, and zero-padded on the right to ``W = 48 * max_wh_ratio``, the largest aspect ratio
in the batch (at least 320/48). Here every input is padded to one fixed width ``WIDTH`` = 640 (ratio 13.3): what
the wheel feeds when a line that long is in the batch, and one shape, so that calibration, latency and the INT8
models compare on the same input.

Data made here: text lines printed with Pillow's bundled font at 16-40 px, dark ink on light paper (a third of
them with paper grain and a slight blur, like a scan), 1-6 words of Python's documentation (``ocr_det.words``:
even topics for calibration, odd topics for evaluation: disjoint text), cut with the margins a detector's
unclipped box leaves (0.1-0.5 of the font size). The label is the printed string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx

HEIGHT, WIDTH = 48, 640  # the wheel's rec_img_shape height; one fixed padded width (see the module docs)


def characters(model: onnx.ModelProto) -> list[str]:
    """The decoder's character list, as the wheel builds it: ``blank``, the model's ``metadata_props["character"]``
    lines, then ``" "``."""
    meta = {p.key: p.value for p in model.metadata_props}
    if "character" not in meta:
        raise ValueError("the recognizer has no metadata_props['character'] (the wheel would need rec_keys_path)")
    return ["blank", *meta["character"].splitlines(), " "]


def resize_bilinear(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """``cv2.resize(image, (width, height))`` (INTER_LINEAR): half-pixel centres, edge clamped, no antialiasing;
    uint8 rounded to nearest."""
    h, w = image.shape[:2]

    def taps(n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = np.clip((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0, n_in - 1)
        lo = np.floor(src).astype(np.int64)
        return lo, np.minimum(lo + 1, n_in - 1), (src - lo)

    y0, y1, fy = taps(height, h)
    x0, x1, fx = taps(width, w)
    img = image.astype(np.float64)
    rows = img[y0] * (1 - fy)[:, None, None] + img[y1] * fy[:, None, None]
    out = rows[:, x0] * (1 - fx)[None, :, None] + rows[:, x1] * fx[None, :, None]
    return np.asarray(np.clip(np.round(out), 0, 255), np.uint8)


def rec_input(bgr: np.ndarray, width: int = WIDTH) -> np.ndarray:
    """The wheel's ``resize_norm_img`` on one BGR uint8 crop, padded to ``width``: 1x3x48xwidth float32."""
    h, w = bgr.shape[:2]
    resized_w = min(width, int(np.ceil(HEIGHT * w / h)))
    x = resize_bilinear(bgr, resized_w, HEIGHT).astype(np.float32).transpose(2, 0, 1) / np.float32(255.0)
    out = np.zeros((1, 3, HEIGHT, width), np.float32)
    out[0, :, :, :resized_w] = (x - np.float32(0.5)) / np.float32(0.5)
    return out


def line(rng: np.random.Generator, vocabulary: Sequence[str], max_ratio: float) -> tuple[np.ndarray, str]:
    """One printed text line (RGB uint8 crop) and its string: 1-6 words, no wider than ``max_ratio`` times its
    height."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    size = int(rng.integers(16, 41))
    font = ImageFont.load_default(size=size)
    words = [vocabulary[int(i)] for i in rng.integers(0, len(vocabulary), int(rng.integers(1, 7)))]
    top, bottom, side = (int(size * rng.uniform(0.1, 0.5)) + 1 for _ in range(3))
    draw = ImageDraw.Draw(Image.new("RGB", (8, 8)))
    while True:
        text = " ".join(words)
        x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
        w, h = int(x1 - x0) + 2 * side, int(y1 - y0) + top + bottom
        if w <= max_ratio * h or len(words) == 1:
            break
        words.pop()
    if len(text) > 1 and w > max_ratio * h:  # one long word: cut it
        text = text[: max(1, int(len(text) * max_ratio * h / w))]
        x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
        w = int(x1 - x0) + 2 * side
    paper = tuple(int(v) for v in rng.integers(200, 256, 3))
    ink = tuple(int(v) for v in rng.integers(0, 90, 3))
    image = Image.new("RGB", (w, h), paper)
    ImageDraw.Draw(image).text((side - x0, top - y0), text, fill=ink, font=font)
    if rng.random() < 1 / 3:  # a scan: paper grain and a slight blur
        image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 0.8))))
        grain = rng.normal(0, 6, (h, w, 1))
        return np.clip(np.asarray(image) + grain, 0, 255).astype(np.uint8), text
    return np.asarray(image), text


def samples(n: int, seed: int, vocabulary: Sequence[str], width: int = WIDTH
            ) -> tuple[list[dict[str, np.ndarray]], list[str]]:
    """``n`` recognizer inputs (``{"x": 1x3x48xwidth}``, the wheel's preprocessing on BGR) and their strings:
    printed lines of words of ``vocabulary`` (``ocr_det.words(part)``: 0 calibration, 1 evaluation)."""
    rng = np.random.default_rng(seed)
    feeds, texts = [], []
    for _ in range(n):
        image, text = line(rng, vocabulary, width / HEIGHT)
        feeds.append({"x": rec_input(np.ascontiguousarray(image[..., ::-1]), width)})
        texts.append(text)
    return feeds, texts


def encode(texts: Sequence[str], chars: Sequence[str]) -> np.ndarray:
    """Strings as the ``ctc`` metric's integer labels ``[S, L]`` (character indices, padded with -1)."""
    index = {c: i for i, c in enumerate(chars) if i}
    longest = max((len(t) for t in texts), default=0)
    out = np.full((len(texts), max(longest, 1)), -1, np.int64)
    for row, text in enumerate(texts):
        out[row, : len(text)] = [index[c] for c in text]
    return out


def decode(ids: Sequence[Sequence[int]], chars: Sequence[str]) -> list[str]:
    """Id sequences (``qgraph.metrics.text.greedy``) as strings."""
    return ["".join(chars[i] for i in seq) for seq in ids]


def truth_scores(ids: Sequence[Sequence[int]], texts: Sequence[str], chars: Sequence[str]) -> dict[str, float]:
    """Decoded id sequences against the printed strings: ``exact`` (as decoded), ``exact_strip`` (leading and
    trailing spaces dropped: the crop's margins make the model emit them, and the wheel's users strip them),
    ``exact_nospace`` (every space dropped) and ``cer_nospace`` (character error rate without spaces)."""
    from qgraph.metrics.text import edit_distance

    got = decode(ids, chars)
    pairs = list(zip(got, texts, strict=True))
    squeeze = [(g.replace(" ", ""), t.replace(" ", "")) for g, t in pairs]
    index = {c: i for i, c in enumerate(chars)}
    errors = sum(edit_distance(tuple(index[c] for c in g), tuple(index[c] for c in t)) for g, t in squeeze)
    return {"exact": float(np.mean([g == t for g, t in pairs])),
            "exact_strip": float(np.mean([g.strip() == t.strip() for g, t in pairs])),
            "exact_nospace": float(np.mean([g == t for g, t in squeeze])),
            "cer_nospace": errors / max(1, sum(len(t) for _, t in squeeze))}
