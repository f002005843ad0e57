"""``saturation: avoid`` bounded by each input channel's calibrated codes (passes/insert_qdq/pairsafe.py)."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from hypothesis import given, settings
from hypothesis import strategies as st
from insert_qdq_helpers import initializer, quantize, with_weights
from qgraph.passes.insert_qdq.pairsafe import kernel_codes

from qgraph.quant.math import quantize as q_array
from qgraph.runtime.kernels.pairs import INT16_MAX, INT16_MIN, exact_u8s8_matmul, risky_pairs, simulate_u8s8_matmul


def _layer() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """A MatMul whose inputs 0-31 reach the top of the range and 32-63 stay below a fifth of it; outputs 0-3 weigh
    the large inputs heavily, outputs 4-7 the small ones: only outputs 0-3 can saturate on this data."""
    rng = np.random.default_rng(1)
    w = np.full((64, 8), 0.05, np.float32)
    w[:32, :4] = rng.uniform(0.7, 1.0, (32, 4))
    w[32:, 4:] = rng.uniform(0.7, 1.0, (32, 4))
    x = rng.uniform(0.0, 1.0, (32, 64)).astype(np.float32)
    x[:, 32:] *= 0.2
    x[:4, :32] = 1.0
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    lin (float[1,64] x) => (float[1,8] y) { r = Relu(x)  y = MatMul(r, w) }
    """
    return with_weights(text, {"w": w}), [{"x": row[None]} for row in x]


def _activation_codes(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    xs, xz = float(initializer(model, "r/scale")), int(initializer(model, "r/zero_point"))
    return np.concatenate([q_array(np.maximum(f["x"], 0), xs, xz, "uint8") for f in feeds])


def test_calibrated_codes_raise_only_the_channels_the_data_can_saturate() -> None:
    m, feeds = _layer()
    runs = {bound: quantize(m, feeds, preset="ort-x86-avx2", saturation_codes=bound) for bound in ("calibrated", "any")}
    details = {bound: r.records[0].result.details for bound, r in runs.items()}
    (calibrated,), (anything,) = details["calibrated"]["pair_safe"], details["any"]["pair_safe"]
    assert (calibrated["channels"], calibrated["codes"]) == (4, "calibrated")
    assert (anything["channels"], anything["codes"]) == (8, "any")
    assert calibrated["weight_sqnr_pair_safe_db"] > anything["weight_sqnr_pair_safe_db"] + 1.0
    line = next(d for d in runs["calibrated"].records[0].result.decisions if d.startswith("saturation: avoid"))
    assert "calibration data" in line and "4 channel(s) at risk (of 8)" in line
    # the report analyses with the same bound: nothing left at risk on those codes
    assert details["calibrated"]["saturation"]["layers_at_risk"] == []
    for bound, res in runs.items():  # on the calibration data no pair sum saturates, either way
        a, wq = _activation_codes(res.model, feeds), initializer(res.model, "w/q")
        assert np.array_equal(simulate_u8s8_matmul(a, wq), exact_u8s8_matmul(a, wq)), bound
    # outputs 4-7 keep the 8-bit codes of the VNNI recipe's per-channel scales; 0-3 were raised
    vnni = initializer(quantize(m, feeds, preset="ort-x86-vnni").model, "w/q")
    wq = initializer(runs["calibrated"].model, "w/q")
    assert np.array_equal(wq[:, 4:], vnni[:, 4:]) and not np.array_equal(wq[:, :4], vnni[:, :4])


def test_conv_codes_follow_the_kernels_channels_last_rows_per_group() -> None:
    node = gs.Node("Conv", attrs={"group": 2})
    lo, hi = np.array([1, 2, 3, 4]), np.array([11, 12, 13, 14])
    laid = kernel_codes(node, (4, 2, 1, 2), (lo, hi))  # 4 outputs, 2 channels per group, a 1x2 kernel
    assert laid is not None
    assert laid[0].tolist() == [[1, 2, 1, 2], [1, 2, 1, 2], [3, 4, 3, 4], [3, 4, 3, 4]]
    assert laid[1].tolist() == [[11, 12, 11, 12], [11, 12, 11, 12], [13, 14, 13, 14], [13, 14, 13, 14]]
    plain = kernel_codes(gs.Node("Conv"), (3, 2, 2, 1), (lo[:2], hi[:2]))
    assert plain is not None and plain[1].tolist() == [11, 12, 11, 12]
    assert kernel_codes(gs.Node("Conv"), (3, 3, 1, 1), (lo, hi)) is None  # 4 codes for 3 channels
    assert kernel_codes(gs.Node("Gemm", attrs={"transA": 1}), (4, 3), (lo, hi)) is None
    gemm = kernel_codes(gs.Node("Gemm", attrs={"transB": 1}), (3, 4), (lo, hi))
    assert gemm is not None and gemm[0].tolist() == lo.tolist()


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 7), st.data())
def test_risky_pairs_with_per_position_codes_against_every_corner(rows: int, k: int, data: st.DataObject) -> None:
    w = np.array(data.draw(st.lists(st.lists(st.integers(-128, 127), min_size=k, max_size=k), min_size=rows,
                                    max_size=rows)), np.int64)
    ends = np.array(data.draw(st.lists(st.tuples(st.integers(0, 255), st.integers(0, 255)), min_size=k, max_size=k)))
    lo, hi = ends.min(axis=1), ends.max(axis=1)
    got = risky_pairs(w, lo, hi)
    want = []
    for r, p in itertools.product(range(rows), range(0, k, 2)):
        # a pair sum is linear in each code: its extremes are at the corners of the codes' box
        sums = [a0 * w[r, p] + (a1 * w[r, p + 1] if p + 1 < k else 0)
                for a0 in (lo[p], hi[p]) for a1 in ((lo[p + 1], hi[p + 1]) if p + 1 < k else (0,))]
        if max(sums) > INT16_MAX or min(sums) < INT16_MIN:
            want.append((r, p))
    assert list(zip(got.channel.tolist(), got.first.tolist(), strict=True)) == want

