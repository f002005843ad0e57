"""The OCR text detector of the real-weight corpus: data, the wheel's preprocessing and the DB post-process.

``rapidocr_onnxruntime`` (PyPI, Apache-2.0) ships ``models/ch_PP-OCRv4_det_infer.onnx``, a DBNet text detector
(PP-LCNetV3-style backbone: depthwise convs, HardSwish, SE blocks; an FPN whose levels are joined by nearest
Resize + Add + Concat; a head of Conv -> BN -> ReLU -> ConvTranspose -> BN -> ReLU -> ConvTranspose -> Sigmoid at
opset 12). Its output is the text probability map ``[1, 1, H, W]`` at the input resolution. The wheel's
``ch_ppocr_det/utils.py`` needs cv2, pyclipper and shapely; nothing here does: the model is read as a file, the
preprocessing is done with PIL and numpy, and the post-process is qgraph's built-in ``text_boxes`` (numpy).

Preprocessing (``DetPreProcess`` with the wheel's ``config.yaml``: ``limit_type: min``, ``limit_side_len: 736``,
mean = std = 0.5): scale so that the short side is at least 736, round each side to a multiple of 32, bilinear
resize, ``(x/255 - 0.5) / 0.5`` on BGR, CHW. Every sample here is square, so every input is ``1x3x736x736``
(a fixed size, so that latencies compare).

Post-process (``DBPostProcess``: ``thresh 0.3``, ``box_thresh 0.5``, ``unclip_ratio 1.6``, 2x2 dilation, ``fast``
score), as qgraph's built-in ``text_boxes`` metric (`qgraph.metrics.text`, docs/metrics.md): binary map ``p >
0.3``, dilated; one box per 8-connected component; a box whose short side is below 3 pixels or whose mean
probability is below 0.5 is dropped; the box grows by ``d = area * 1.6 / perimeter`` on every side (pyclipper's
unclip) and is dropped when its short side is then below 5. The wheel fits a rotated rectangle
(``cv2.minAreaRect``) to each component; here the box is axis-aligned (the text in the data is horizontal, where
the two agree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

SIDE = 736  # the wheel's limit_side_len: the short side of every input
THRESH, BOX_THRESH, UNCLIP = 0.3, 0.5, 1.6


def det_input(image: np.ndarray, resize: Callable[[np.ndarray, int, int], np.ndarray]) -> np.ndarray:
    """The wheel's ``DetPreProcess`` on an RGB uint8 image: short side up to 736, sides rounded to multiples
    of 32, bilinear resize, BGR, ``(x/255 - 0.5)/0.5``, 1x3xHxW float32."""
    h, w = image.shape[:2]
    ratio = SIDE / min(h, w) if min(h, w) < SIDE else 1.0
    nh, nw = (max(32, round(int(s * ratio) / 32) * 32) for s in (h, w))
    x = resize(image, nw, nh)[..., ::-1].astype(np.float32) / np.float32(255.0)
    return np.ascontiguousarray(((x - 0.5) / 0.5).transpose(2, 0, 1)[None]).astype(np.float32)


def square(image: np.ndarray, rng: np.random.Generator, low: float = 0.5) -> np.ndarray:
    """A random square crop whose side is ``low``..1 of the image's short side."""
    h, w = image.shape[:2]
    side = max(32, int(min(h, w) * rng.uniform(low, 1.0)))
    top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
    return image[top : top + side, left : left + side]


def words(part: int) -> list[str]:
    """Words of Python's own documentation (``pydoc_data.topics``), from the even (``part`` 0) or the odd
    (``part`` 1) topics: disjoint text for calibration and evaluation pages."""
    from pydoc_data.topics import topics

    out: list[str] = []
    for key in sorted(topics)[part::2]:
        out += [w for w in topics[key].split() if w.isascii() and 1 <= len(w) <= 14]
    return out


def page(
    rng: np.random.Generator,
    vocabulary: Sequence[str],
    scans: Sequence[str],
    figures: Sequence[str],
    photo: Callable[[str], np.ndarray],
    resize: Callable[[np.ndarray, int, int], np.ndarray],
) -> np.ndarray:
    """A square page (RGB uint8, 736x736): a light background, blocks of printed lines (Pillow's bundled font,
    12-34 px, dark ink, words of ``vocabulary``), crops of the scanned ``scans`` at 1-2x their scale and photo
    ``figures``, stacked from the top with random indents."""
    from PIL import Image, ImageDraw, ImageFont

    canvas = Image.new("RGB", (SIDE, SIDE), tuple(int(v) for v in rng.integers(215, 256, 3)))
    draw = ImageDraw.Draw(canvas)
    margin = int(rng.integers(16, 48))
    y = margin
    while y < SIDE - margin - 24:
        kind = rng.choice(["lines", "lines", "lines", "scan", "figure"])
        x = margin + int(rng.integers(0, 60))
        if kind == "lines":
            size = int(rng.integers(12, 35))
            font = ImageFont.load_default(size=size)
            ink = tuple(int(v) for v in rng.integers(0, 90, 3))
            for _ in range(int(rng.integers(1, 6))):
                if y + size > SIDE - margin:
                    break
                text = " ".join(vocabulary[int(i)] for i in rng.integers(0, len(vocabulary), 12))
                while text and draw.textlength(text, font=font) > SIDE - margin - x:
                    text = text.rsplit(" ", 1)[0] if " " in text else ""
                draw.text((x, y), text, fill=ink, font=font)
                y += int(size * rng.uniform(1.25, 1.8))
        else:
            w = int(rng.integers(160, SIDE - margin - x))
            h = min(int(rng.integers(60, 220)), SIDE - margin - y)
            if kind == "scan":
                src, zoom = photo(scans[int(rng.integers(len(scans)))]), rng.uniform(1.0, 2.0)
                sh, sw = min(src.shape[0], int(h / zoom)), min(src.shape[1], int(w / zoom))
                top, left = int(rng.integers(0, src.shape[0] - sh + 1)), int(rng.integers(0, src.shape[1] - sw + 1))
                block = resize(np.ascontiguousarray(src[top : top + sh, left : left + sw]), w, h)
            else:
                block = resize(np.ascontiguousarray(square(photo(str(rng.choice(figures))), rng)), w, h)
            canvas.paste(Image.fromarray(block), (x, y))
            y += h
        y += int(rng.integers(8, 40))
    return np.asarray(canvas)


def samples(
    n: int,
    seed: int,
    part: int,
    scans: Sequence[str],
    figures: Sequence[str],
    photo: Callable[[str], np.ndarray],
    resize: Callable[[np.ndarray, int, int], np.ndarray],
) -> list[dict[str, np.ndarray]]:
    """``n`` detector inputs (``{"x": 1x3x736x736}``): 5 in 8 square pages (:func:`page`, words of documentation
    ``part``), 2 in 8 square crops of a raw scan, 1 in 8 a photo crop; the wheel's preprocessing on each."""
    rng = np.random.default_rng(seed)
    vocabulary = words(part)
    feeds = []
    for i in range(n):
        if i % 8 in (5, 6):
            image = square(photo(scans[i % len(scans)]), rng, 0.6)
        elif i % 8 == 7:
            image = square(photo(figures[(i // 8) % len(figures)]), rng)
        else:
            image = page(rng, vocabulary, scans, figures, photo, resize)
        feeds.append({"x": det_input(image, resize)})
    return feeds


# ---------------------------------------------------------------------------------------------- post-process
def _options(iou: float = 0.5) -> Any:
    from qgraph.metrics.text import TextBoxOptions

    return TextBoxOptions(thresh=THRESH, box_thresh=BOX_THRESH, unclip=UNCLIP, match=iou)


def boxes(prob: np.ndarray) -> np.ndarray:
    """DB boxes ``[k, 4]`` as ``(y0, x0, y1, x1)`` (half-open, in pixels) from one probability map ``[H, W]`` (any
    leading axes of size 1 are dropped): qgraph's built-in ``text_boxes`` (`qgraph.metrics.text`)."""
    from qgraph.metrics.text import text_boxes

    return text_boxes(prob, _options()).boxes[:, [1, 0, 3, 2]].astype(np.int64)


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU matrix ``[len(a), len(b)]`` of axis-aligned boxes (`qgraph.metrics.boxes.box_iou`)."""
    from qgraph.metrics.boxes import box_iou as iou

    return iou(np.asarray(a)[:, [1, 0, 3, 2]], np.asarray(b)[:, [1, 0, 3, 2]])


def box_f1(reference: Sequence[np.ndarray], test: Sequence[np.ndarray], iou: float = 0.5) -> dict[str, float]:
    """Agreement of ``test`` maps with ``reference`` maps through their DB boxes (the built-in ``text_boxes``
    metric): a test box is a true positive when it takes a reference box with IoU >= ``iou``; precision, recall,
    F1 (1.0 when neither has a box)."""
    from qgraph.metrics.boxes import f1_counts
    from qgraph.metrics.text import text_boxes

    opts = _options(iou)
    s = f1_counts([text_boxes(t, opts) for t in test], [text_boxes(r, opts) for r in reference], iou)
    return {"box_f1": s["f1"], "box_precision": s["precision"], "box_recall": s["recall"],
            "boxes_float": s["reference_count"]}


def mask_iou(reference: Sequence[np.ndarray], test: Sequence[np.ndarray]) -> float:
    """IoU of the binary maps ``p > 0.3`` pooled over the samples: Σ|A ∩ B| / Σ|A ∪ B|."""
    inter = union = 0
    for r, t in zip(reference, test, strict=True):
        a, b = np.asarray(r) > THRESH, np.asarray(t) > THRESH
        inter += int(np.sum(a & b))
        union += int(np.sum(a | b))
    return inter / union if union else 1.0
