"""Save the PyTorch model's own outputs on the held-out split: the first stage of ``qgraph check``.

``qgraph check`` compares framework FP32 → ONNX FP32 → INT8 without depending on PyTorch: the framework's
outputs are saved once, here, as ``reference_outputs.npz`` (one array per ONNX output name, one row per sample).
The PyTorch module is ``train.DigitsCNN`` with the weights read back from ``model.onnx`` (the same trained
weights the export wrote), run in eval mode.

    python examples/digits/framework_outputs.py      # needs torch; writes reference_outputs.npz here
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from metric import load_eval
from onnx import numpy_helper
from train import OUTPUT_NAME, DigitsCNN

HERE = Path(__file__).resolve().parent


def main() -> None:
    """Load the weights into the PyTorch module and write its logits on eval.npz."""
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy())
               for t in onnx.load(str(HERE / "model.onnx")).graph.initializer}
    model = DigitsCNN()
    state = model.state_dict()
    model.load_state_dict({k: weights[k] if k in weights else v for k, v in state.items()}, strict=True)
    model.eval()
    feeds, _ = load_eval(HERE / "eval.npz")
    with torch.no_grad():
        logits = model(torch.from_numpy(feeds["input"])).numpy()
    np.savez(HERE / "reference_outputs.npz", **{OUTPUT_NAME: logits.astype(np.float32)})
    print(f"wrote {HERE / 'reference_outputs.npz'}: {OUTPUT_NAME} {list(logits.shape)}")


if __name__ == "__main__":
    main()
