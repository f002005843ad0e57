"""Weight correction after quantization on real weights: ``correct_bias`` and ``optimize_rounding`` added to the
``ort-x86-vnni`` recipe, on the PP-LCNet orientation classifier and the PicoDet layout detector.

Prints, per model and variant: the corpus metric on held-out data (top-1 / logits SQNR; min SQNR over the detector's
output slices), and the seconds each correction pass adds, next to a float inference over the calibration data and
the quantizing pass (whose calibration is the reference cost). onnxruntime's quantizer has no bias correction or
adaptive rounding; its ``quantize_static`` scores for the same models are in ``bench_accuracy.py``.

    python benchmarks/bench_weight_correction.py [orientation|layout ...] [--per-tensor]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_models

from qgraph import Pipeline, Recipe
from qgraph.pass_api import get_pass

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "ort-x86-vnni.yaml"
VARIANTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "insert_qdq only": [],
    "+correct_bias local": [("correct_bias", {})],
    "+correct_bias one_shot": [("correct_bias", {"mode": "one_shot"})],
    "+correct_bias sequential 4 rounds": [("correct_bias", {"mode": "sequential", "rounds": 4})],
    "+correct_bias sequential per layer": [("correct_bias", {"mode": "sequential"})],
    "+optimize_rounding": [("optimize_rounding", {})],
    "+optimize_rounding +correct_bias": [("optimize_rounding", {}), ("correct_bias", {})],
    "+optimize_rounding (no bias re-fit)": [("optimize_rounding", {"adjust_bias": False})],
    "+optimize_rounding (no re-fit) +correct_bias": [("optimize_rounding", {"adjust_bias": False}),
                                                     ("correct_bias", {})],
}
SIZES = {"orientation": {"n_cal": 32, "n_eval": 64}, "layout": {"n_cal": 8, "n_eval": 8}}


def _headline(spec: Any, s: dict[str, Any]) -> str:
    if spec.kind == "classification":
        return f"top1 {s.get('top1', float('nan')):.3f} agree {s['top1_agree']:.3f} logits {s['sqnr_db']:6.2f} dB"
    return f"min slice {s['min_db']:6.2f} dB ({s['worst']})"


def main(names: list[str], per_tensor: bool) -> None:
    for name in names:
        model, cal, ev, spec = real_models.load(name, **SIZES[name])
        ref = real_models.run_model(model, ev, spec)
        t0 = time.perf_counter()
        real_models.run_model(model, cal, spec, optimized=False)
        float_s = time.perf_counter() - t0
        print(
            f"\n{name}: {len(cal)} calibration / {len(ev)} eval samples; float inference over the calibration "
            f"data {float_s:.2f} s" + ("; per-tensor weights" if per_tensor else "")
        )
        if spec.kind == "classification" and "top1_float" in real_models.score(spec, ref, ref):
            print(f"  float top1 {real_models.score(spec, ref, ref)['top1_float']:.3f}")
        for label, extra in VARIANTS.items():
            base = Recipe.from_yaml(RECIPE).pipeline()
            passes = list(base.passes)
            if per_tensor:
                qdq = passes[-1]
                passes[-1] = type(qdq)(**{**qdq.config.recipe_options(), "weights": {"per_channel": False}})
            passes += [get_pass(p)(**o) for p, o in extra]
            res = Pipeline(passes, target=base.target, calibration=base.calibration).run(
                model, calibration_data=_source(cal)
            )
            got = real_models.score(spec, ref, real_models.run_model(res.model, ev, spec))
            costs = " ".join(
                f"{r.name} {r.seconds:.1f}s"
                for r in res.records
                if r.name in ("insert_qdq", "correct_bias", "optimize_rounding")
            )
            print(f"  {label:34s} {_headline(spec, got)}   [{costs}]")


def _source(feeds: list[Any]) -> Any:
    from qgraph.data import CallableSource

    return CallableSource(lambda: feeds, "benchmark feeds")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args or ["orientation", "layout"], "--per-tensor" in sys.argv)
