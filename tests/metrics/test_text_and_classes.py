"""``text_boxes``, ``ctc``, ``top1``/``topk``, ``cosine``/``sqnr``: hand-computed cases and properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from qgraph.errors import DataError
from qgraph.metrics import builtin_metric
from qgraph.metrics.components import components
from qgraph.metrics.text import TextBoxOptions, edit_distance, greedy, text_boxes


def test_a_text_block_becomes_one_unclipped_box() -> None:
    prob = np.zeros((64, 64), np.float32)
    prob[10:20, 30:50] = 0.9  # dilated (down/right by 1): rows 10..20, cols 30..50 -> 11 x 21
    prob[40:42, 5:60] = 0.9  # 3 rows after dilation, mean 0.9*2*55/(3*56) = 0.589: kept
    prob[50, 5:60] = 0.9  # 2 rows after dilation: short side below 3, dropped
    found = text_boxes(prob[None, None], TextBoxOptions())
    d = 11 * 21 * 1.6 / (2 * 32)  # 5.775
    assert found.boxes[0].tolist() == [round(30 - d), round(10 - d), round(51 + d), round(21 + d)]
    assert found.scores[0] == pytest.approx(10 * 20 * 0.9 / (11 * 21))
    assert len(found) == 2
    assert len(text_boxes(prob, TextBoxOptions(box_thresh=0.6))) == 1


@settings(max_examples=40, deadline=None)
@given(arrays(bool, st.tuples(st.integers(1, 24), st.integers(1, 24)), elements=st.booleans()))
def test_components_match_scipy_labelling(mask: np.ndarray) -> None:
    ndimage = pytest.importorskip("scipy.ndimage")
    labels, _ = ndimage.label(mask, structure=np.ones((3, 3), bool))
    want = sorted((s[0].start, s[1].start, s[0].stop, s[1].stop) for s in ndimage.find_objects(labels) if s)
    got = sorted(tuple(int(v) for v in (b[0], b[1], b[2], b[3])) for b in components(mask))
    assert got == want


def test_text_boxes_metric_counts_a_lost_line() -> None:
    ref = np.zeros((1, 1, 64, 64), np.float32)
    ref[0, 0, 10:20, 5:60] = 0.9
    ref[0, 0, 30:40, 5:60] = 0.9
    got = ref.copy()
    got[0, 0, 30:40] = 0.2  # the second line fades below the threshold
    scores = builtin_metric("text_boxes").scores([got], [ref])
    assert (scores["precision"], scores["recall"], scores["f1"]) == pytest.approx((1.0, 0.5, 2 / 3))


def _onehot(ids: list[list[int]], vocab: int = 6) -> np.ndarray:
    return np.eye(vocab, dtype=np.float32)[np.array(ids)]


def test_greedy_ctc_merges_repeats_then_drops_blanks() -> None:
    assert greedy(_onehot([[0, 3, 3, 0, 3, 5, 5, 0]]), blank=0) == [(3, 3, 5)]
    assert greedy(_onehot([[5, 5, 1, 5]]), blank=5) == [(1,)]


def test_edit_distance_by_hand() -> None:
    kitten, sitting = (tuple(map(ord, w)) for w in ("kitten", "sitting"))
    assert edit_distance(kitten, sitting) == 3
    assert edit_distance((), (1, 2)) == 2
    assert edit_distance((1, 2, 3), (1, 2, 3)) == 0


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=9), st.lists(st.integers(0, 3), max_size=9))
def test_edit_distance_equals_the_textbook_table(a: list[int], b: list[int]) -> None:
    table = [[i + j if not i * j else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i][j] = min(table[i - 1][j] + 1, table[i][j - 1] + 1, table[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    assert edit_distance(tuple(a), tuple(b)) == table[-1][-1]
    assert edit_distance(tuple(a), tuple(b)) == edit_distance(tuple(b), tuple(a))


def test_ctc_exact_and_cer_against_the_reference_and_labels(tmp_path: object) -> None:
    ref = _onehot([[1, 2, 0, 3], [4, 0, 4, 0]])  # "1 2 3", "4 4"
    got = _onehot([[1, 2, 0, 0], [4, 0, 4, 0]])  # "1 2": one deletion
    scores = builtin_metric("ctc").scores([got], [ref])
    assert scores == pytest.approx({"exact": 0.5, "cer": 1 / 5})
    assert builtin_metric("ctc.cer").higher_is_better is False
    labels = np.array([[1, 2, 3], [4, 4, -1]])
    assert builtin_metric("ctc.exact")([got], labels) == 0.5
    chars = tmp_path / "chars.txt"  # type: ignore[operator]
    chars.write_text("a\nb\nc\nd\ne\n", encoding="utf-8")
    assert builtin_metric(f"ctc.cer(chars={chars})")([got], np.array(["abc", "dd"])) == pytest.approx(1 / 5)
    with pytest.raises(DataError, match="not in"):
        builtin_metric(f"ctc(chars={chars})")([got], np.array(["abz", "dd"]))


def test_top1_and_topk() -> None:
    ref = np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5]])
    got = np.array([[0.6, 0.4, 0.0], [0.7, 0.2, 0.1], [0.2, 0.3, 0.5]])
    assert builtin_metric("top1")([got], [ref]) == pytest.approx(2 / 3)
    assert builtin_metric("topk(k=2)")([got], [ref]) == 1.0
    # candidate arg-max 0, 0, 2
    assert builtin_metric("top1")([got[:, :, None, None]], np.array([1, 0, 1])) == pytest.approx(1 / 3)


def test_cosine_and_sqnr_take_the_worst_slice() -> None:
    ref = np.concatenate([np.full((2, 4, 5), 100.0), np.full((2, 2, 5), 0.01)], axis=1)
    got = ref.copy()
    sign = np.where(np.arange(20).reshape(2, 2, 5) % 2, 1.0, -1.0)
    got[:, 4:] += 0.001 * sign  # the scores slice: noise 1e-6 per value on a signal of 1e-4 (20 dB); boxes exact
    assert builtin_metric("sqnr(split=4)")([got], [ref]) == pytest.approx(20.0)
    assert builtin_metric("sqnr")([got], [ref]) == pytest.approx(10 * math.log10((40 * 1e4 + 20 * 1e-4) / 20e-6))
    assert builtin_metric("cosine(split=4)")([got], [ref]) == pytest.approx(1 / math.sqrt(1.01))
    assert builtin_metric("sqnr(outputs=1, split=4)")([got, got], [got, ref]) == pytest.approx(20.0)
    assert builtin_metric("sqnr")([ref], [ref]) == math.inf
