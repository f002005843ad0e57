"""Print a sha256 per (recipe, model) of what every ready recipe writes: run it before and after a refactor
that must not change behaviour and compare the two listings (`diff before.txt after.txt`).

    python tools/recipe_digests.py > before.txt

Models: the bundled digits CNN, squeezenet and shufflenet from the onnx wheel with seeded weights, a synthetic
Conv-BN net, the transformer encoder, and the opset-12 Paddle-style export of the old-opset recipe tests.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

from qgraph import Recipe
from qgraph.testing import cached_light_model, conv_bn_net, random_feeds, transformer_encoder

ROOT = Path(__file__).resolve().parents[1]


def _models(tmp: Path) -> dict[str, tuple[onnx.ModelProto, Path]]:
    sys.path.insert(0, str(ROOT / "tests" / "recipes"))
    from test_old_opset_models import paddle_style_opset12  # type: ignore[import-not-found]

    out: dict[str, tuple[onnx.ModelProto, Path]] = {}
    digits = ROOT / "examples" / "digits"
    out["digits"] = (onnx.load(str(digits / "model.onnx")), digits / "calibration.npz")
    for name, model in (("squeezenet", onnx.load(str(cached_light_model("squeezenet", tmp)))),
                        ("shufflenet", onnx.load(str(cached_light_model("shufflenet", tmp)))),
                        ("conv_bn_net", conv_bn_net()), ("transformer", transformer_encoder()),
                        ("paddle_opset12", paddle_style_opset12())):
        feeds = random_feeds(model, 4, seed=1)
        data = tmp / f"{name}.npz"
        np.savez(data, **{k: np.stack([f[k] for f in feeds]) for k in feeds[0]})
        out[name] = (model, data)
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        models = _models(Path(tmp))
        for recipe_path in sorted((ROOT / "recipes").glob("*.yaml")):
            recipe = Recipe.from_yaml(recipe_path)
            for name, (model, data) in models.items():
                try:
                    result = recipe.pipeline().run(model, calibration_data=data)
                    digest = hashlib.sha256(result.model.SerializeToString(deterministic=True)).hexdigest()
                except Exception as exc:  # a refusal is a behaviour too: record it
                    digest = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                print(f"{recipe_path.stem:26s} {name:16s} {digest}", flush=True)


if __name__ == "__main__":
    main()
