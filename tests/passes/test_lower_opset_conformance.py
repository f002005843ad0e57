"""Fast conformance subset: a few hundred ONNX backend node tests lowered to 17/13/11 and run in onnxruntime.

The corpus is generated into a session tmp folder. Every non-pass must be a `PassError` (refusal); wrong
outputs, invalid models and crashes fail the test. The full run lives in benchmarks/bench_lower_opset.py.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance"))

import opset_corpus as oc
from qgraph.passes.lower_opset import lower_model

from qgraph.errors import PassError

#: Tests selected to exercise every adapter family (regex over test names).
SELECT = re.compile(
    r"^test_(reduce_(l1|l2|max|min|mean|sum|sum_square|prod|log_sum|log_sum_exp)_(do_not_keepdims|keepdims|"
    r"default_axes|negative_axes|empty_set|bool)|softmax_(axis|default|negative|large)|logsoftmax_(axis|default)|"
    r"hardmax_(axis|default)|resize_(up|down)sample_(scales|sizes)_(nearest|linear|cubic)(_axes_\d_\d)?$|"
    r"(constant|edge|reflect|wrap)_pad|clip_(default|inbounds|outbounds|splitbounds|example)|split_(equal|variable|1d|2d)|squeeze$|unsqueeze_(axis_0|negative)|"
    r"layer_normalization_(2d|3d|4d)_axis(0|1|_negative_1)(_expanded)?$|gelu|mish|hardswish|swish|"
    r"rms_normalization_(2d|3d)|rotary_embedding$|rotary_embedding_no_position|attention_3d$|attention_4d$|"
    r"attention_3d_causal|tril$|triu_one_row|triu$|bitwise_and_i32|bitwise_not_2d|bitwise_xor_ui8|cumprod|argmax_.*select_last|argmin_.*select_last|shape_start|shape_end|"
    r"scatter_elements_with_(reduction|duplicate)|scatternd_(add|max)|gridsample$|gridsample_(bilinear|nearest)$|isinf|isnan|max_(int|uint)|min_(int|uint)|(add|sub|mul|div)_(u?int8|u?int16)|"
    r"castlike_FLOAT_to|dropout_default|batchnorm|group_normalization|instancenorm|center_crop_pad_crop$|"
    r"greater_equal|less_equal|affine_grid_2d|if$|loop11|constant$|gemm_default_no_bias|shape$|size$|"
    r"identity$|where_example|equal$|pow$|range_float|celu$|elu$|selu$|leakyrelu$|prelu_example|lrn$|"
    r"global_average_pool|averagepool_2d_(default|dilations)|maxpool_2d_(default|uint8)|lppool_2d_default)",
)
TARGETS = (17, 13, 11)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import onnx.backend.test.case.node as node_cases

    names = [
        c.name
        for c in node_cases.collect_testcases()
        if SELECT.match(c.name) and ("_expanded" not in c.name or "layer_norm" in c.name)
    ]
    return oc.generate_corpus(tmp_path_factory.mktemp("opset_corpus"), names)


def test_fast_conformance_subset(corpus: Path) -> None:
    tests = sorted(p for p in corpus.iterdir() if (p / "model.onnx").exists())
    assert 200 <= len(tests) <= 600
    status: dict[int, Counter[str]] = {t: Counter() for t in TARGETS}
    adapters: Counter[str] = Counter()
    failures: list[str] = []
    for case in tests:
        model, feeds, expected = oc.load_case(case)
        try:
            if not oc.outputs_match(expected, oc.run_ort(model, feeds)):
                continue
        except Exception:
            continue
        for target in TARGETS:
            if oc.default_opset(model) <= target:
                continue
            try:
                res = lower_model(model, target)
            except PassError:
                status[target]["refused"] += 1
                continue
            adapters.update(k.split(": ")[1] for k in res.adapters)
            try:
                ok = oc.outputs_match(expected, oc.run_ort(res.model, feeds))
            except Exception as exc:
                failures.append(f"{case.name}@{target}: crash {str(exc)[:160]}")
                continue
            status[target]["pass" if ok else "wrong"] += 1
            if not ok:
                failures.append(f"{case.name}@{target}: wrong outputs")
    assert not failures, "\n".join(failures)
    for target, c in status.items():
        total = sum(c.values())
        assert total >= 100, (target, c)
        assert c["pass"] / total >= 0.85, (target, c)
    required = {
        "restamp",
        "reduce_axes_to_attribute",
        "axes_to_attribute",
        "softmax_axis_semantics",
        "resize_axes_antialias",
        "resize_optional_inputs",
        "pad_axes_to_full_pads",
        "split_num_outputs",
        "split_input_to_attribute",
        "function_body",
        "layernorm_decomposition",
        "trilu_mask",
        "bitwise_by_bits",
        "bitwise_not_arithmetic",
        "cumprod_unrolled",
        "select_last_index_by_reversal",
        "shape_start_end_to_slice",
        "widen_small_ints",
        "int_max_min_by_where",
        "upcast_to_float",
        "gridsample_mode_names",
        "compare_or_equal",
        "castlike_to_cast",
    }
    assert required <= set(adapters), sorted(required - set(adapters))
