"""The YOLO detector of the real-weight corpus: data, the wheel's preprocessing and the YOLOv8 post-process.

``nudenet`` (PyPI, 3.4.2) ships ``nudenet/320n.onnx``: an Ultralytics YOLOv8n detector (8.2.46 export, opset 17,
18 classes of body parts, faces among them) with the standard YOLOv8 head. Per FPN level (strides 8, 16, 32) a
box branch (64 channels: 4 sides x 16 distance bins) and a class branch (18 logits) are concatenated, the levels
joined, split again; the box bins go through Softmax and the DFL Conv, become ``(cx, cy, w, h)`` in input pixels
(anchor points, ``x stride``), and the class logits through Sigmoid; one final Concat joins the boxes
(0..320 px) and the scores (0..1) into ``output0 [1, 22, 2100]``: the classic head whose shared scale rounds every
score to zero. The wheel's ``nudenet.py`` needs cv2; nothing here does.

Preprocessing (``_read_image``): pad the image at the bottom/right to a square with black, resize to 320x320,
RGB, ``x/255``, CHW (``cv2.dnn.blobFromImage(..., 1/255, swapRB=True)``; here PIL's bilinear resize).

Data: the detector fires on faces. Each sample is a scene of a background photo crop with a person photo crop
(``astronaut`` for calibration, ``camera`` for evaluation) and 0-3 face thumbnails of ``skimage.data.lfw_subset``
(faces 0-99 for calibration, 100-199 for evaluation) pasted at seeded places and sizes; the backgrounds are
disjoint photos too; every other sample is a close-up of the person's face (the stride-16/32 heads fire on
those). Most samples have a detection above the wheel's threshold, at every level.

Post-process: a cell is a candidate when its best class score is >= 0.2, then NMS at IoU 0.45
(``cv2.dnn.NMSBoxes`` with score threshold 0.25): qgraph's built-in metric :data:`METRIC` (docs/metrics.md).
:func:`detection_f1` matches the INT8 model's detections to float's (same class, IoU >= 0.5): the "INT8 detector
finds nothing" symptom in one number.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

SIDE = 320
STRIDES = (8, 16, 32)
CELLS = tuple((SIDE // s) ** 2 for s in STRIDES)  # 1600, 400, 100 anchors per level
CLASSES = (
    "FEMALE_GENITALIA_COVERED",
    "FACE_FEMALE",
    "BUTTOCKS_EXPOSED",
    "FEMALE_BREAST_EXPOSED",
    "FEMALE_GENITALIA_EXPOSED",
    "MALE_BREAST_EXPOSED",
    "ANUS_EXPOSED",
    "FEET_EXPOSED",
    "BELLY_COVERED",
    "FEET_COVERED",
    "ARMPITS_COVERED",
    "ARMPITS_EXPOSED",
    "FACE_MALE",
    "BELLY_EXPOSED",
    "MALE_GENITALIA_EXPOSED",
    "ANUS_COVERED",
    "FEMALE_BREAST_COVERED",
    "BUTTOCKS_COVERED",
)
CANDIDATE, SCORE_THRESH, NMS_IOU = 0.2, 0.25, 0.45
# (person photo, backgrounds, lfw face indices): disjoint between calibration and evaluation
CAL = ("astronaut", ("coffee", "rocket", "brick", "grass", "hubble_deep_field"), (0, 100))
EVAL = ("camera", ("chelsea", "coins", "gravel", "stereo_motorcycle", "retina"), (100, 200))


def yolo_input(image: np.ndarray, resize: Callable[[np.ndarray, int, int], np.ndarray]) -> np.ndarray:
    """The wheel's preprocessing on an RGB uint8 image: black padding to a square at the bottom/right, resize
    to 320x320, ``x/255``, RGB CHW, 1x3x320x320 float32."""
    h, w = image.shape[:2]
    side = max(h, w)
    padded = np.zeros((side, side, 3), np.uint8)
    padded[:h, :w] = image
    x = resize(padded, SIDE, SIDE).astype(np.float32) / np.float32(255.0)
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None]).astype(np.float32)


def faces() -> np.ndarray:
    """The 200 grey 25x25 face thumbnails that ship inside scikit-image (``skimage.data.lfw_subset``)."""
    import skimage.data

    return np.asarray(skimage.data.lfw_subset(), np.float64)


def scene(
    rng: np.random.Generator,
    person: np.ndarray,
    background: np.ndarray,
    thumbnails: np.ndarray,
    resize: Callable[[np.ndarray, int, int], np.ndarray],
) -> np.ndarray:
    """A background crop (320-480 px wide, aspect 0.75-1.33) with a person crop and 0-3 tinted face thumbnails."""
    w = int(rng.integers(320, 481))
    h = int(w * rng.uniform(0.75, 1.33))
    bh, bw = background.shape[:2]
    ch, cw = int(bh * rng.uniform(0.5, 1.0)), int(bw * rng.uniform(0.5, 1.0))
    top, left = int(rng.integers(0, bh - ch + 1)), int(rng.integers(0, bw - cw + 1))
    canvas = resize(np.ascontiguousarray(background[top : top + ch, left : left + cw]), w, h).copy()
    # the person: a crop around the upper part of the photo (where the face is), 35-80% of the scene's short side
    ph, pw = person.shape[:2]
    side = int(min(ph, pw) * rng.uniform(0.45, 0.9))
    py, px = int(rng.integers(0, max(1, ph // 3 - side // 4) + 1)), int(rng.integers(0, pw - side + 1))
    py = min(py, ph - side)
    size = int(min(w, h) * rng.uniform(0.35, 0.8))
    crop = resize(np.ascontiguousarray(person[py : py + side, px : px + side]), size, size)
    y, x = int(rng.integers(0, h - size + 1)), int(rng.integers(0, w - size + 1))
    canvas[y : y + size, x : x + size] = crop
    for _ in range(int(rng.integers(0, 4))):
        face = thumbnails[int(rng.integers(len(thumbnails)))]
        tint = np.array([1.0, rng.uniform(0.75, 0.95), rng.uniform(0.6, 0.85)])  # grey -> a skin tone
        rgb = (np.clip(face[..., None] * tint, 0, 1) * 255).astype(np.uint8)
        s = int(rng.integers(40, max(41, min(w, h) // 3)))
        y, x = int(rng.integers(0, h - s + 1)), int(rng.integers(0, w - s + 1))
        canvas[y : y + s, x : x + s] = resize(np.ascontiguousarray(rgb), s, s)
    return canvas


FACE_CENTRE = (140, 230)  # row, column of the face in both person photos (512x512)


def close_up(rng: np.random.Generator, person: np.ndarray) -> np.ndarray:
    """A square crop around the person's face, 140-240 px: the face fills 40-100% of the input, so the stride-16
    and stride-32 heads fire (a scene's faces are small: the stride-8 head)."""
    h, w = person.shape[:2]
    side = int(rng.integers(140, 241))
    cy, cx = (c + int(rng.integers(-40, 41)) for c in FACE_CENTRE)
    top = int(np.clip(cy - side // 2, 0, h - side))
    left = int(np.clip(cx - side // 2, 0, w - side))
    return person[top : top + side, left : left + side]


def samples(
    n: int,
    seed: int,
    person: str,
    backgrounds: Sequence[str],
    face_range: tuple[int, int],
    photo: Callable[[str], np.ndarray],
    resize: Callable[[np.ndarray, int, int], np.ndarray],
) -> list[dict[str, np.ndarray]]:
    """``n`` samples through the wheel's preprocessing, ``{"images": 1x3x320x320}``: every other one a close-up of
    the person's face, one in eight the whole person photo, the rest scenes with small faces."""
    rng = np.random.default_rng(seed)
    thumbnails = faces()[face_range[0] : face_range[1]]
    people, grounds = photo(person), [photo(b) for b in backgrounds]
    feeds = []
    for i in range(n):
        if i % 8 == 7:
            image = people
        elif i % 2 == 0:
            image = np.ascontiguousarray(close_up(rng, people))
        else:
            image = scene(rng, people, grounds[i % len(grounds)], thumbnails, resize)
        feeds.append({"images": yolo_input(image, resize)})
    return feeds


#: The wheel's post-process as qgraph's built-in metric (docs/metrics.md): class-agnostic NMS like cv2.dnn.NMSBoxes.
METRIC = f"detection(layout=yolov8, score={max(CANDIDATE, SCORE_THRESH)}, iou={NMS_IOU}, agnostic=true)"


def detections(output: np.ndarray) -> list[tuple[int, float, np.ndarray]]:
    """The wheel's post-process on ``output0`` of one image: ``(class, score, xyxy box)`` after NMS
    (`qgraph.metrics.detection`, the same decoding the built-in metric uses)."""
    from qgraph.metrics import builtin_metric

    metric = builtin_metric(METRIC)
    (found,) = metric.family.decode(metric.options, [np.asarray(output).reshape(1, 4 + len(CLASSES), -1)])
    return [(int(c), float(s), b) for c, s, b in zip(found.classes, found.scores, found.boxes, strict=True)]


def detection_f1(reference: Sequence[np.ndarray], test: Sequence[np.ndarray], iou: float = 0.5) -> dict[str, float]:
    """F1 of the test model's detections against float's (same class, IoU >= ``iou``, COCO's greedy order), pooled
    over the images (the built-in ``detection`` metric), with the detection counts and mAP@0.5."""
    from qgraph.metrics import builtin_metric

    metric = builtin_metric(METRIC[:-1] + f", match={iou})")
    shape = (-1, 4 + len(CLASSES), np.shape(reference[0])[-1])
    ref = np.concatenate([np.asarray(r).reshape(shape) for r in reference])
    got = np.concatenate([np.asarray(t).reshape(shape) for t in test])
    s = metric.scores([got], [ref], "map50")
    return {"det_f1": s["f1"], "det_float": s["reference_count"], "det_int8": s["count"], "det_map50": s["map50"]}
