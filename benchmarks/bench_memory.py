"""Benchmark: peak RSS and wall time of `qgraph run`, `lower`, `diff` and `calibrate` on large generated models.

    python benchmarks/bench_memory.py [--only cnn|transformer] [--keep DIR] [--commands run lower diff calibrate]

Models (random weights, generated into a temporary folder and deleted afterwards, never committed):

- ``cnn``: VGG-19 from the onnx wheel's light model with seeded weights (`qgraph.testing.materialize_light_model`),
  575 MB of float32 weights, saved as one protobuf;
- ``transformer``: a 24-layer BERT-large-shaped encoder (d_model 1024, ffn 4096; `qgraph.testing.transformer`),
  1.2 GB of weights, saved with external data.

Every command runs in its own child process; its peak RSS comes from ``os.wait4`` (the child's ``ru_maxrss``)
and is compared with the issue's ceiling ``2 x S + 300 MB`` (S = weight bytes of the input model). For `run`, the
per-pass seconds and peak RSS come from the pipeline's events (`PipelineEvent.peak_rss_mb`). onnxruntime's
``quantize_static`` on the same model is timed in the same way for comparison (``--ort``).

Measured (2 cores shared, onnxruntime 1.31; peak RSS MB, "was" = main before the #16 memory work):

    model (S, ceiling)               run              calibrate        lower            diff
    cnn VGG-19 (548 MB, 1396)        1346 (was 2535)  1191 (was 2533)  1190 (was 1600)  1187 (1187)
    transformer (1153 MB, 2606)      2416 (2416)      2415 (was 5103)  2429 (2439)      1829 (1828)

Where the memory went: ``equalize_weights`` held float64 copies of every weight (1.1 GB and 194 s on VGG-19; now
per-channel factors, ~100 s); the final fill kept the graph's arrays alive (reference cycles) and copied each
array's bytes once more; onnxruntime copied the weights given to sessions through ``add_external_initializers``
and prepacked the MatMul/Gemm ones (now fed as inputs, prepacking off in calibration); calibration held a 1 MB
outlier buffer per tensor and onnxruntime's whole-run memory pattern (2.1 GB of activations on the transformer);
``calibrate`` filled a protobuf with the prepared graph's weights and split it again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"cnn": ROOT / "recipes" / "ort-x86-vnni.yaml",
           "transformer": ROOT / "recipes" / "transformer-ort-x86-vnni.yaml"}

_GENERATE = r"""
import sys, numpy as np
from pathlib import Path
kind, folder = sys.argv[1], Path(sys.argv[2])
if kind == "cnn":
    import onnx
    from qgraph.testing import materialize_light_model
    model = materialize_light_model("vgg19")
    onnx.save(model, str(folder / "cnn.onnx"))
    feeds = {"data_0": np.random.default_rng(0).standard_normal((4, 3, 224, 224)).astype(np.float32)}
else:
    import onnx
    from qgraph.testing.transformer import transformer_encoder, transformer_encoder_inputs
    model = transformer_encoder(17, layers=24, d_model=1024, heads=16, seq=128)
    onnx.save(model, str(folder / "transformer.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="transformer.onnx.data", size_threshold=1024)
    feeds_list = transformer_encoder_inputs(4, seq=128, d_model=1024)
    feeds = {k: np.concatenate([f[k] for f in feeds_list]) for k in feeds_list[0]}
np.savez(folder / f"{kind}_calib.npz", **feeds)
"""

# Runs the `qgraph run` command in-process (same code path as the CLI) and records the pipeline's per-pass events.
_RUN_WITH_EVENTS = r"""
import json, sys
from qgraph.pipeline.runner import Pipeline
events = []
orig = Pipeline.run
def run(self, *a, **k):
    self.subscribe(lambda ev: events.append((ev.pass_name, ev.seconds, ev.peak_rss_mb))
                   if ev.kind == "pass_end" else None)
    return orig(self, *a, **k)
Pipeline.run = run
from qgraph.cli import main
sys.argv = ["qgraph", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    if exc.code:
        raise
finally:
    with open(__import__("os").environ["QGRAPH_BENCH_EVENTS"], "w") as f:
        json.dump(events, f)
"""


def weight_bytes(path: Path) -> int:
    """Bytes of every initializer (external data included) of the model at ``path``."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        n = int(np.prod(t.dims)) if t.dims else 1
        total += n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


def measure(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """Run ``cmd`` in a child; return (wall seconds, peak RSS MB of that child, exit status)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    err = proc.stderr.read().decode() if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        print(f"  ! {' '.join(cmd[:4])}... exited {proc.returncode}: {err.strip().splitlines()[-1:]}")
    return seconds, usage.ru_maxrss / 1024.0, proc.returncode


def bench(kind: str, folder: Path, commands: list[str], ort: bool) -> list[tuple[str, float, float, float]]:
    """Generate the ``kind`` model into ``folder`` and measure each command; rows (command, s, MB, ceiling MB)."""
    py = sys.executable
    qgraph = str(Path(py).with_name("qgraph"))
    subprocess.run([py, "-c", _GENERATE, kind, str(folder)], check=True)
    model, data = folder / f"{kind}.onnx", folder / f"{kind}_calib.npz"
    s_mb = weight_bytes(model) / 2**20
    ceiling = 2 * s_mb + 300
    print(f"\n{kind}: {model.name}, weights S = {s_mb:.0f} MB, ceiling 2S + 300 = {ceiling:.0f} MB", flush=True)
    recipe = str(RECIPES[kind])
    out = folder / f"{kind}.int8.onnx"
    rows = []
    events_file = folder / "events.json"
    env = {**os.environ, "QGRAPH_BENCH_EVENTS": str(events_file)}
    for command in commands:
        if command == "run":
            cmd = [py, "-c", _RUN_WITH_EVENTS, "run", recipe, str(model), "-o", str(out), "-q",
                   "--calibration-data", str(data)]
        elif command == "lower":
            cmd = [qgraph, "lower", str(model), "--opset", "18", "-o", str(folder / f"{kind}.lowered.onnx")]
        elif command == "diff":
            if not out.exists():
                continue
            cmd = [qgraph, "diff", str(model), str(out)]
        elif command == "calibrate":
            cmd = [qgraph, "calibrate", recipe, str(model), "-o", str(folder / "ranges.json"),
                   "--calibration-data", str(data)]
        elif command == "verify":
            cmd = [qgraph, "run", recipe, str(model), "-o", str(folder / f"{kind}.v.onnx"), "-q", "--verify",
                   "--calibration-data", str(data)]
        else:
            raise SystemExit(f"unknown command {command}")
        seconds, peak, _ = measure(cmd, env)
        rows.append((command, seconds, peak, ceiling))
        _row(command, seconds, peak, ceiling)
        if command == "run" and events_file.exists():
            for name, secs, rss in json.loads(events_file.read_text()):
                print(f"    pass {name:16s} {secs:7.2f} s   peak so far {rss:7.0f} MB", flush=True)
        for p in folder.glob(f"{kind}.lowered.onnx*"):
            p.unlink()
    if ort and kind == "cnn":
        cmd = [py, "-c", _ORT, str(model), str(data), str(folder / "ort.int8.onnx")]
        seconds, peak, _ = measure(cmd)
        rows.append(("onnxruntime quantize_static", seconds, peak, ceiling))
        _row(rows[-1][0], seconds, peak, ceiling)
    return rows


def _row(command: str, seconds: float, peak: float, ceiling: float) -> None:
    verdict = "ok" if peak <= ceiling else "OVER"
    print(f"  {command:28s} {seconds:7.1f} s   peak {peak:7.0f} MB   ({peak / ceiling:4.2f} of ceiling, {verdict})",
          flush=True)


_ORT = r"""
import sys, numpy as np
from onnxruntime.quantization import quantize_static, CalibrationDataReader, QuantFormat
model, data, out = sys.argv[1:4]
arrays = dict(np.load(data))
class Reader(CalibrationDataReader):
    def __init__(self):
        n = len(next(iter(arrays.values())))
        self.it = iter([{k: v[i:i + 1] for k, v in arrays.items()} for i in range(n)])
    def get_next(self):
        return next(self.it, None)
quantize_static(model, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["cnn", "transformer"], action="append")
    parser.add_argument("--commands", nargs="+", default=["run", "lower", "diff", "calibrate"])
    parser.add_argument("--ort", action="store_true", help="also time onnxruntime's quantize_static (CNN)")
    parser.add_argument("--keep", type=Path, help="generate into this folder and keep the files")
    args = parser.parse_args()
    for kind in args.only or ["cnn", "transformer"]:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            bench(kind, args.keep, args.commands, args.ort)
            continue
        with tempfile.TemporaryDirectory(prefix="qgraph-bench-memory-") as tmp:
            bench(kind, Path(tmp), args.commands, args.ort)


if __name__ == "__main__":
    main()
