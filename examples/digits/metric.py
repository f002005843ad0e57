"""Data loaders and the top-1 metric for the bundled digits example (needs numpy; onnxruntime to evaluate).

python examples/digits/metric.py                  # float top-1 of model.onnx on eval.npz
python examples/digits/metric.py quantized.onnx   # top-1 of any model with the same input/output
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODEL_PATH = HERE / "model.onnx"
CALIBRATION_PATH = HERE / "calibration.npz"
EVAL_PATH = HERE / "eval.npz"
INPUT_NAME = "input"


def top1(outputs: Sequence[np.ndarray] | np.ndarray, labels: np.ndarray) -> float:
    """Fraction of samples whose arg-max logit equals the label.

    ``outputs`` holds the model's logits for all samples: one ``[N, 10]`` array, or a list of per-batch
    ``[n_i, 10]`` arrays (e.g. the list a session run returns, or one such array per batch); they are
    concatenated along axis 0 and must line up with ``labels`` (shape ``[N]``).
    """
    if isinstance(outputs, np.ndarray):
        logits = outputs
    else:
        logits = np.concatenate([np.asarray(o) for o in outputs], axis=0)
    if logits.ndim != 2 or logits.shape[0] != labels.shape[0]:
        raise ValueError(f"expected logits of shape [{labels.shape[0]}, classes], got {list(logits.shape)}")
    return float(np.mean(np.argmax(logits, axis=1) == labels))


def load_eval(path: str | Path = EVAL_PATH) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Held-out images as feeds ``{"input": float32 [N, 1, 8, 8]}`` and their ``labels`` (int64 [N])."""
    with np.load(path) as data:
        return {INPUT_NAME: data[INPUT_NAME].astype(np.float32)}, data["labels"].astype(np.int64)


def load_calibration(path: str | Path = CALIBRATION_PATH) -> dict[str, np.ndarray]:
    """Calibration images ``{"input": float32 [200, 1, 8, 8]}`` (training images, same preprocessing)."""
    with np.load(path) as data:
        return {name: data[name].astype(np.float32) for name in data.files}


def calibration_feeds(path: str | Path = CALIBRATION_PATH, batch_size: int = 1) -> list[dict[str, np.ndarray]]:
    """Split the calibration set into feed dicts of ``batch_size`` images each."""
    images = load_calibration(path)[INPUT_NAME]
    return [{INPUT_NAME: images[i : i + batch_size]} for i in range(0, len(images), batch_size)]


def evaluate(model: str | Path | bytes = MODEL_PATH, eval_path: str | Path = EVAL_PATH, batch_size: int = 64) -> float:
    """Top-1 of ``model`` (path or serialized bytes) on the held-out split, run in onnxruntime on CPU."""
    import onnxruntime as ort

    source = model if isinstance(model, bytes) else str(model)
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    feeds, labels = load_eval(eval_path)
    images = feeds[INPUT_NAME]
    outputs = [session.run(None, {name: images[i : i + batch_size]})[0] for i in range(0, len(images), batch_size)]
    return top1(outputs, labels)


def main() -> None:
    """Print the top-1 of a model (default: the bundled float model) on eval.npz."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", type=Path, default=MODEL_PATH)
    args = parser.parse_args()
    print(f"top-1 {evaluate(args.model):.4f}  ({args.model})")


if __name__ == "__main__":
    main()
