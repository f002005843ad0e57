"""Every built-in pass reports typed details (`qgraph.PassDetails`) whose JSON form has exactly the keys, in the
order, the hand-built dicts had before the details were typed (the ``--report`` JSON is unchanged), on the real
digits CNN through the ready recipes and the passes no ready recipe runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
import pytest
from qgraph.passes.cleanup import CleanupDetails
from qgraph.passes.equalize_weights.details import EqualizedPair, EqualizeWeightsDetails
from qgraph.passes.insert_qdq.details import InsertQDQDetails, QuantizedUnit
from qgraph.passes.smooth_quant.details import SmoothQuantDetails
from qgraph.passes.specialize_inputs import SpecializeInputsDetails

from qgraph import PassDetails, PipelineResult, Recipe

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits"

_QDQ = ["preset", "why", "mode", "reduce_range", "cpu", "quantized", "quantized_ops", "integer_data_movement",
        "quantized_tensors", "calibrated_tensors", "excluded_tensors", "asymmetric_weights",
        "subgraph_nodes_quantized", "subgraph_nodes_quantized_static"]
#: The keys each pass wrote into its details dict on the digits CNN before they were typed, in order.
BEFORE: dict[str, list[str]] = {
    "fold_constants": ["constant_nodes", "shape_nodes", "evaluated_nodes", "initializers", "bytes", "sessions",
                       "scopes"],
    "fuse_bias": ["folded"],
    "fuse_affine": ["after", "before"],
    "fuse_batchnorm": ["batchnorm_seen", "folded_into_preceding", "folded_into_following", "rewritten_to_mul_add",
                       "kept", "scopes"],
    "fuse_activations": ["fused"],
    "cleanup": ["identity", "dropout", "dead_nodes", "unused_initializers", "unused_graph_inputs",
                "duplicate_initializers", "renamed_nodes", "reordered_graphs", "scopes"],
    "equalize_weights": ["pairs", "rounds", "converged", "equalized"],
    "smooth_quant": ["groups", "smoothed"],
    "insert_qdq (ort-x86-avx2)": ["latency", *_QDQ, "calibration", "saturation", "pair_safe"],
    "correct_bias": ["layers", "model_runs"],
    "insert_qdq": [*_QDQ, "calibration"],
    "float_fallback": ["fallen_back", "relu_restored", "float_weights_restored", "outputs_still_quantized_for"],
    "optimize_rounding": ["layers"],
    "tune_ranges": ["score_before_db", "score_after_db", "factors", "pairs", "evaluations", "samples", "streamed",
                    "sequences", "scored_db_before", "scored_db_after"],
    "lower_opset": ["source_opset", "target_opset", "adapters", "ops"],
    "raise_opset": ["source_opset", "target_opset", "adapters", "dropped_attributes"],
    "quantize_weights": ["weight_bytes", "algorithm", "format"],
}


def _run(recipe: Recipe) -> PipelineResult:
    return recipe.pipeline().run(onnx.load(str(DIGITS / "model.onnx")), calibration_data=DIGITS / "calibration.npz")


def _recipe(*passes: dict[str, Any]) -> Recipe:
    return Recipe.from_dict({"name": "details", "passes": list(passes)})


@pytest.fixture(scope="module")
def records() -> dict[str, Any]:
    """Each pass's result, by name (insert_qdq of the AVX2 recipe under its own key)."""
    out: dict[str, Any] = {}
    for rec in _run(Recipe.from_yaml(ROOT / "recipes" / "ort-x86-avx2.yaml")).records:
        out[rec.name + (" (ort-x86-avx2)" if rec.name == "insert_qdq" else "")] = rec.result
    # fuse_bias: no ready recipe runs it since fuse_affine does what it did
    for recipe in (_recipe({"pass": "fuse_bias"}, {"pass": "insert_qdq"},
                           {"pass": "float_fallback", "nodes": {"op_types": ["Conv"]}},
                           {"pass": "optimize_rounding"}, {"pass": "tune_ranges"}),
                   _recipe({"pass": "lower_opset", "opset": 7}), _recipe({"pass": "raise_opset", "opset": 17}),
                   Recipe.from_yaml(ROOT / "recipes" / "int4-weight-only.yaml")):
        out.update({rec.name: rec.result for rec in _run(recipe).records if rec.name not in out})
    return out


@pytest.mark.parametrize("name", list(BEFORE))
def test_details_keep_their_json_keys(records: dict[str, Any], name: str) -> None:
    result = records[name]
    data = result.details_dict()
    assert list(data) == BEFORE[name]
    assert json.loads(json.dumps(data)) == json.loads(json.dumps(result.to_dict()["details"]))  # what --report writes
    if name == "float_fallback":  # a TypedDict: a dict whose key order follows what the pass did
        assert type(result.details) is dict and data is result.details
        return
    assert isinstance(result.details, PassDetails), type(result.details)
    for key in data:  # the record's mapping view and its attributes agree with its JSON form
        assert result.details[key] == data[key]
        assert key in result.details


def test_typed_attributes_on_a_real_model(records: dict[str, Any]) -> None:
    qdq = records["insert_qdq (ort-x86-avx2)"].details
    assert isinstance(qdq, InsertQDQDetails) and qdq.preset == "ort-x86-avx2" and qdq.mode == "static"
    assert all(isinstance(u, QuantizedUnit) for u in qdq.quantized)
    assert sum(qdq.quantized_ops.values()) == len(qdq.quantized) > 0
    assert qdq.to_dict()["quantized"][0] == {"node": qdq.quantized[0].node, "op": qdq.quantized[0].op,
                                             "kind": qdq.quantized[0].kind, "absorbed": qdq.quantized[0].absorbed,
                                             "per_channel": qdq.quantized[0].per_channel}
    cleanup = records["cleanup"].details
    assert isinstance(cleanup, CleanupDetails) and cleanup.scopes == 1
    eq = records["equalize_weights"].details
    assert isinstance(eq, EqualizeWeightsDetails) and eq.pairs >= len(eq.equalized or [])
    assert all(isinstance(p, EqualizedPair) and p.scale[0] <= p.scale[1] for p in eq.equalized or [])
    sq = records["smooth_quant"].details
    assert isinstance(sq, SmoothQuantDetails) and sq.smoothed == [] and sq.groups == 0  # a CNN: no MatMul input


def test_specialize_inputs_details_in_order() -> None:
    details = SpecializeInputsDetails(inputs=["mode"], ifs_inlined=2, ifs_left=0)
    assert json.dumps(details.to_dict()) == '{"inputs": ["mode"], "ifs_inlined": 2, "ifs_left": 0}'
