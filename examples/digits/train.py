"""Train the bundled digits CNN and export it, its calibration set and its evaluation set.

Re-training needs PyTorch (``pip install torch``); *using* the example needs only numpy and onnxruntime.
The data is scikit-learn's digits set (1,797 8x8 grey images, shipped inside scikit-learn: no download).

    python examples/digits/train.py            # writes model.onnx, calibration.npz, eval.npz here
    python examples/digits/train.py --out DIR  # ... or into DIR

Everything is seeded: the split, the initialisation, the batch order. Training takes 10-15 s on
two CPU cores.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

SEED = 0
TEST_FRACTION = 0.25
CALIBRATION_SAMPLES = 200
EPOCHS = 30
BATCH_SIZE = 64
OPSET = 17
IR_VERSION = 8  # the IR version that introduced opset 17; onnxruntime 1.31 accepts IR <= 10
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
HERE = Path(__file__).resolve().parent


def preprocess(images: np.ndarray) -> np.ndarray:
    """Map raw digits pixels (0..16, shape [N, 64] or [N, 8, 8]) to float32 [N, 1, 8, 8] in [0, 1]."""
    return (np.asarray(images, dtype=np.float32).reshape(-1, 1, 8, 8) / 16.0).astype(np.float32)


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return the fixed stratified split (x_train, y_train, x_test, y_test), images already preprocessed."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=TEST_FRACTION, random_state=SEED, stratify=digits.target
    )
    return (
        preprocess(x_train),
        np.asarray(y_train, dtype=np.int64),
        preprocess(x_test),
        np.asarray(y_test, dtype=np.int64),
    )


class DigitsCNN(nn.Module):
    """Conv(16)-BN-ReLU → Conv(32)-BN-ReLU → MaxPool → Conv(32)-BN-ReLU → GlobalAvgPool → Linear(10)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the logits ``[N, 10]`` for images ``[N, 1, 8, 8]``."""
        return self.classifier(self.features(x))  # type: ignore[no-any-return]


def train(x_train: np.ndarray, y_train: np.ndarray) -> DigitsCNN:
    """Train with Adam + cosine schedule; deterministic on one thread."""
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model = DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    steps_per_epoch = (len(x_train) + BATCH_SIZE - 1) // BATCH_SIZE
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, EPOCHS * steps_per_epoch)
    loss_fn = nn.CrossEntropyLoss()
    xs, ys = torch.from_numpy(x_train), torch.from_numpy(y_train)
    generator = torch.Generator().manual_seed(SEED)
    model.train()
    for _ in range(EPOCHS):
        order = torch.randperm(len(xs), generator=generator)
        for start in range(0, len(xs), BATCH_SIZE):
            index = order[start : start + BATCH_SIZE]
            optimizer.zero_grad()
            loss = loss_fn(model(xs[index]), ys[index])
            loss.backward()
            optimizer.step()
            scheduler.step()
    model.eval()
    return model


def export(model: DigitsCNN, path: Path) -> onnx.ModelProto:
    """Export with the TorchScript exporter at opset 17, un-fused BatchNormalization, dynamic batch."""
    example = torch.zeros(1, 1, 8, 8)
    # The dynamo exporter targets opset 18 and folds BN into Conv; the TorchScript one keeps real
    # BatchNormalization nodes at opset 17, which is what this example is for.
    warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
    torch.onnx.export(
        model,
        (example,),
        str(path),
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
        dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        opset_version=OPSET,
        training=torch.onnx.TrainingMode.PRESERVE,  # eval mode, but keep BatchNormalization nodes
        do_constant_folding=False,
        dynamo=False,
    )
    exported = onnx.load(str(path))
    exported.ir_version = IR_VERSION
    exported.producer_name = "qgraph examples/digits/train.py"
    exported.doc_string = "Small CNN trained on scikit-learn's digits (8x8); input = pixels / 16."
    onnx.checker.check_model(exported, full_check=True)
    onnx.save(exported, str(path))
    return exported


def main() -> None:
    """Train, export and write the example's files; print the float top-1 on the held-out split."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: next to this script)")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    x_train, y_train, x_test, y_test = load_split()
    model = train(x_train, y_train)
    seconds = time.perf_counter() - started
    with torch.no_grad():
        torch_top1 = float((model(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean())

    exported = export(model, out / "model.onnx")
    calibration = x_train[np.random.default_rng(SEED).permutation(len(x_train))[:CALIBRATION_SAMPLES]]
    np.savez_compressed(out / "calibration.npz", input=calibration)  # key = INPUT_NAME
    np.savez_compressed(out / "eval.npz", input=x_test, labels=y_test)

    import onnxruntime as ort

    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {INPUT_NAME: x_test})[0]
    onnx_top1 = float((np.argmax(logits, axis=1) == y_test).mean())
    ops = sorted({n.op_type for n in exported.graph.node})
    print(f"trained in {seconds:.1f}s on {len(x_train)} images; test images: {len(x_test)}")
    print(f"top-1 torch: {torch_top1:.4f}  onnxruntime: {onnx_top1:.4f}")
    print(f"model: {len(exported.graph.node)} nodes, ops {ops}, opset {OPSET}, IR {exported.ir_version}")


if __name__ == "__main__":
    main()
