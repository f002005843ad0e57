"""``method: auto`` and fixed ranges of bounded ops on real weights: accuracy and calibration time per method.

For each model of the real-weight corpus (``benchmarks/real_models.py``: PP-LCNet orientation classifier, PicoDet
layout detector) and each calibration method, the recipe's preparation passes run once, then ``insert_qdq``
(preset ``ort-x86-vnni``) with ``activations.method`` = minmax / percentile / entropy / mse / auto, with
``fixed_ranges`` on and off. Printed: the corpus metric on held-out data (classifier: top-1 agreement with float,
logits SQNR; detector: SQNR per output slice, minimum), the calibration time of the pass, and what auto chose.
onnxruntime's quantizer is compared in ``bench_qdq.py``; this script compares qgraph's own methods.

    python benchmarks/bench_calib_auto.py [orientation layout] [--cal N] [--eval N] [--time]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

METHODS = ("minmax", "percentile", "entropy", "mse", "auto")


def _prepare(model: Any, calibration: list[Any]) -> Any:
    from qgraph import Pipeline, Recipe
    from qgraph.data import CallableSource

    recipe = Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml")
    prep = [p for p in recipe.passes if p.preserves_float]
    # smooth_quant measures activation maxima on data: the preparation reads the calibration samples too
    data = CallableSource(lambda: calibration, "calibration")
    return Pipeline(prep).run(model, calibration_data=data).model if prep else model


def _quantize(model: Any, calibration: list[Any], method: str, fixed: bool) -> tuple[Any, float, dict[str, Any]]:
    from qgraph import Pipeline, get_pass
    from qgraph.data import CallableSource

    qdq = get_pass("insert_qdq")(preset="ort-x86-vnni", activations={"method": method, "fixed_ranges": fixed})
    start = time.perf_counter()
    res = Pipeline([qdq]).run(model, calibration_data=CallableSource(lambda: calibration, "cal"))
    took = res.records[-1].seconds if res.records else time.perf_counter() - start
    details = res.records[-1].result.details.get("calibration", {}) if res.records else {}
    return res.model, took, details


def _metric(spec: Any, scores: dict[str, Any]) -> str:
    if spec.kind == "classification":
        return f"agree {scores['top1_agree']:.3f}  SQNR {scores['sqnr_db']:6.2f} dB"
    if spec.kind == "slices":
        slices = scores["slices_db"]
        score_min = min((v for k, v in slices.items() if "score" in k), default=float("nan"))
        box_min = min((v for k, v in slices.items() if "score" not in k), default=float("nan"))
        return f"min {scores['min_db']:6.2f} dB  scores min {score_min:6.2f}  boxes min {box_min:6.2f}"
    return f"cos {scores['cos_mean']:.4f}"


def bench(name: str, n_cal: int, n_eval: int) -> None:
    """Print one table for ``name``."""
    import real_models

    model, calibration, evaluation, spec = real_models.load(name, n_cal=n_cal, n_eval=n_eval)
    prepared = _prepare(model, calibration)
    produced = {o for n in prepared.graph.node for o in n.output}
    if spec.probe and spec.probe not in produced:  # preparation fused the probed tensor away: quantize as is
        prepared = model
    reference = real_models.run_model(prepared, evaluation, spec)
    print(f"\n## {name}: {n_cal} calibration / {n_eval} evaluation samples")
    for fixed in (False, True):
        for method in METHODS:
            qmodel, took, details = _quantize(prepared, calibration, method, fixed)
            scores = real_models.score(spec, reference, real_models.run_model(qmodel, evaluation, spec))
            chose = details.get("auto", {}).get("methods", "")
            n_fixed = len(details.get("fixed_ranges", {}))
            print(f"fixed={fixed!s:5} {method:10} {_metric(spec, scores)}  calib+quantize {took:6.2f} s"
                  f"  fixed {n_fixed:2d}  {chose}")


def time_methods(name: str, n_cal: int, rounds: int = 3) -> None:
    """Calibration time alone (every float activation, as ``qgraph calibrate``), best of ``rounds`` per method."""
    import real_models

    from qgraph.calibrate import collect_ranges
    from qgraph.cli.calibrate_command import float_activations

    model, calibration, _, _ = real_models.load(name, n_cal=n_cal, n_eval=1)
    names = float_activations(model)
    print(f"\n## {name}: calibration time, {len(names)} tensors, {n_cal} samples (best of {rounds})")
    best: dict[str, float] = {}
    for _ in range(rounds):
        for method in METHODS:
            start = time.perf_counter()
            collect_ranges(model, names, lambda: iter(calibration), method)
            best[method] = min(best.get(method, float("inf")), time.perf_counter() - start)
    hist = min(best[m] for m in ("percentile", "entropy", "mse"))
    for method, took in best.items():
        print(f"{method:10} {took:6.2f} s  {took / hist:5.2f}x the fastest histogram method")


def main() -> None:
    """Command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["orientation", "layout"])
    ap.add_argument("--cal", type=int, default=16)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--time", action="store_true", help="Only time the calibration of every method.")
    args = ap.parse_args()
    for name in args.models:
        if args.time:
            time_methods(name, args.cal)
        else:
            bench(name, args.cal, args.eval)


if __name__ == "__main__":
    main()
