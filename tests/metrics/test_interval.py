"""The bootstrap interval of a built-in metric's score (`qgraph.metrics.interval`): per-sample counts that pool into
exactly what ``compare`` gives, intervals as wide as the binomial law says, and None where no counts pool."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgraph.metrics import FAMILIES, builtin_metric
from qgraph.metrics.boxes import Detections, match
from qgraph.metrics.interval import bootstrap, samples_to_show


def _classes(n: int, agree: int, classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Reference and candidate class scores ``[n, classes]`` whose arg-max agrees on the first ``agree`` rows."""
    rng = np.random.default_rng(n + agree)
    ref = rng.normal(size=(n, classes)).astype(np.float32)
    got = ref.copy()
    top = ref.argmax(axis=1)
    for i in range(agree, n):  # move the maximum to another class
        got[i, (top[i] + 1) % classes] = ref[i].max() + 1.0
    return ref, got


def test_top1_interval_has_the_binomial_width() -> None:
    ref, got = _classes(400, 360)
    metric = builtin_metric("top1")
    assert metric([got], [ref]) == pytest.approx(0.9)
    iv = metric.interval([got], [ref])
    assert iv is not None and iv.samples == 400 and iv.level == 0.95
    half = 1.96 * math.sqrt(0.9 * 0.1 / 400)  # the normal approximation: 0.0294
    assert iv.low == pytest.approx(0.9 - half, abs=0.006) and iv.high == pytest.approx(0.9 + half, abs=0.006)
    # seeded: the same scores give the same interval
    assert metric.interval([got], [ref]) == iv


def test_identical_outputs_are_bounded_by_the_rule_of_three_and_more_samples_narrow_it() -> None:
    ref, _ = _classes(200, 200)
    assert builtin_metric("top1").interval([ref], [ref]) is None  # the reference against itself
    iv = builtin_metric("top1").interval([ref.copy()], [ref])
    unseen = -math.log(0.025)  # 3.69 failures go unseen with probability 2.5 %
    assert iv is not None and iv.high == 1.0 and iv.unseen == pytest.approx(unseen)
    assert iv.low == pytest.approx(1.0 - unseen / 200) and "no sample differed" in iv.describe()
    (ref_s, got_s), (ref_l, got_l) = _classes(100, 90), _classes(1600, 1440)
    small = builtin_metric("top1").interval([got_s], [ref_s])
    large = builtin_metric("top1").interval([got_l], [ref_l])
    assert small is not None and large is not None
    assert (large.high - large.low) < 0.4 * (small.high - small.low)  # width ~ 1/sqrt(n): a quarter, with noise


def test_no_interval_where_no_counts_pool() -> None:
    ref, got = _classes(50, 45)
    assert builtin_metric("cosine").interval([got], [ref]) is None
    seq = np.repeat(ref[:, None, :], 3, axis=1)  # [S, T, C]: top-1 scores S x T rows, not samples
    assert builtin_metric("top1").interval([seq], [seq]) is None
    assert FAMILIES["detection"].counts is not None
    boxes = np.zeros((4, 6, 8), np.float32)
    assert builtin_metric("detection.map(layout=yolov8)").interval([boxes], [boxes]) is None


def _yolo(scores: list[list[float]]) -> np.ndarray:
    """A YOLOv8 output ``[S, 4+1, N]``: one class, a well separated 10-pixel box per anchor with these scores."""
    n = max(len(s) for s in scores)
    out = np.zeros((len(scores), 5, n), np.float32)
    for i, row in enumerate(scores):
        for j, sc in enumerate(row):
            out[i, :4, j] = (20.0 * j + 10.0, 10.0, 10.0, 10.0)
            out[i, 4, j] = sc
    return out


def test_detection_interval_counts_detections_per_image() -> None:
    # 40 images with 3 reference detections each; the candidate loses one detection in 8 of them
    ref = _yolo([[0.9, 0.8, 0.7]] * 40)
    got = _yolo([[0.9, 0.8, 0.1]] * 8 + [[0.9, 0.8, 0.7]] * 32)
    metric = builtin_metric("detection(layout=yolov8, score=0.25)")
    scores = metric.scores([got], [ref])
    assert scores["recall"] == pytest.approx(112 / 120) and scores["precision"] == 1.0
    iv = metric.interval([got], [ref])
    assert iv is not None and iv.samples == 40
    assert iv.low < scores["f1"] < iv.high < 1.0
    # resampling images: the number of images that lost one is binomial(40, 0.2)
    recall = builtin_metric("detection.recall(layout=yolov8, score=0.25)").interval([got], [ref])
    assert recall is not None
    half = 1.96 * math.sqrt(0.2 * 0.8 / 40) / 3  # a lost detection is a third of an image's detections
    assert recall.low == pytest.approx(112 / 120 - half, abs=0.012)


def test_agreeing_detections_are_bounded_by_unseen_lost_or_extra_ones() -> None:
    ref = _yolo([[0.9, 0.8, 0.7]] * 40)  # 120 detections, every one found again
    iv = builtin_metric("detection(layout=yolov8, score=0.25)").interval([ref.copy()], [ref])
    unseen = -math.log(0.025)
    recall = (120 - unseen) / 120  # lost ones: precision stays 1
    precision = 120 / (120 + unseen)  # extra ones: recall stays 1
    worst = min(2 * recall / (1 + recall), 2 * precision / (1 + precision))
    assert iv is not None and iv.high == 1.0 and iv.low == pytest.approx(worst) and 0.98 < worst < 0.99
    cer = builtin_metric("ctc.cer")
    probs = np.zeros((5, 4, 3), np.float32)
    probs[:, np.arange(4), [1, 0, 2, 0]] = 1.0  # every line reads "12": 10 characters in all
    bound = cer.interval([probs.copy()], [probs])
    assert bound is not None and bound.low == 0.0 and bound.high == pytest.approx(unseen / 10)


def test_ctc_counts_give_the_compared_fields() -> None:
    probs = np.zeros((3, 4, 3), np.float32)
    probs[:, :, 0] = 1.0  # blank everywhere: empty strings
    probs[0, 1, :] = (0, 1, 0)  # sample 0 reads "1"
    truth = probs.copy()
    truth[1, 2, :] = (0, 0, 1)  # the reference reads "2" in sample 1
    metric = builtin_metric("ctc")
    fields = metric.scores([probs], [truth])
    assert fields == {"exact": pytest.approx(2 / 3), "cer": pytest.approx(1 / 2)}
    iv = metric.interval([probs], [truth])
    assert iv is not None and 0.0 <= iv.low <= 2 / 3 <= iv.high <= 1.0


_det = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(1, 4), st.floats(0.3, 1.0)),
                max_size=4)


@given(st.lists(st.tuples(_det, _det), min_size=1, max_size=8))
@settings(max_examples=60, deadline=None)
def test_pooled_counts_are_the_ratios_of_all_detections(
        images: list[tuple[list[tuple[int, int, int, float]], ...]]) -> None:
    """Summing the per-image counts and pooling them gives F1, precision and recall over every detection, as
    ``compare`` does."""
    def dets(rows: list[tuple[int, int, int, float]]) -> Detections:
        boxes = np.array([(x * 10.0, y * 10.0, x * 10.0 + w * 4.0, y * 10.0 + w * 4.0) for x, y, w, _ in rows],
                         np.float64).reshape(-1, 4)
        return Detections(boxes, np.array([s for *_, s in rows]), np.zeros(len(rows), np.int64))

    got, truth = [dets(a) for a, _ in images], [dets(b) for _, b in images]
    family = FAMILIES["detection"]
    opts = family.options()
    assert family.counts is not None and family.pooled is not None
    pooled = family.pooled(family.counts(opts, got, truth).sum(axis=0))
    # the pooled formulas, written out: COCO matching per image, then ratios of the totals
    tp = sum(int(match(g, t, np.array([opts.match]))[0].sum()) for g, t in zip(got, truth, strict=True))
    n_got, n_truth = sum(len(g) for g in got), sum(len(t) for t in truth)
    precision = tp / n_got if n_got else 1.0
    recall = tp / n_truth if n_truth else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    expected = {"f1": f1, "precision": precision, "recall": recall}
    for name, value in expected.items():
        assert float(pooled[name]) == pytest.approx(value, abs=1e-12)
        assert family.compare(opts, got, truth, "f1")[name] == pytest.approx(value, abs=1e-12)


def test_bootstrap_bounds_memory_by_blocks() -> None:
    """Draws are made in blocks: a sample count past the block size still gives ``rounds`` draws."""
    counts = np.stack([np.ones(9000), (np.arange(9000) % 10 != 0).astype(float)], axis=1)
    iv = bootstrap(counts, FAMILIES["top1"].pooled or (lambda s: {}), "agreement", rounds=1500)
    assert iv is not None and iv.low < 0.9 < iv.high and iv.high - iv.low < 0.02


def test_samples_to_show_a_goal_solve_the_rule_of_three() -> None:
    """A model agreeing on every sample: how many samples put the interval's worse end at the goal."""
    unseen = -math.log(0.025)
    family = FAMILIES["detection"]
    assert family.pooled is not None
    counts = np.tile([3.0, 3.0, 3.0], (40, 1))  # 40 images, 3 detections each, all found
    end, needed = samples_to_show(counts, family.pooled, "f1", 0.995, family.failures)
    recall = (120 - unseen) / 120
    assert end == pytest.approx(2 * recall / (1 + recall))
    # F1 of n detections with `unseen` lost: 2(n - u) / (2n - u) >= 0.995  <=>  n >= u (2 - g) / (2 (1 - g))
    detections = unseen * (2 - 0.995) / (2 * (1 - 0.995))
    assert needed is not None and abs(needed * 3 - detections) <= 3.5
    assert samples_to_show(counts, family.pooled, "f1", 0.95, family.failures)[1] is None  # 120 are enough
    assert samples_to_show(counts, family.pooled, "f1", 1.0, family.failures)[1] == 0  # never


def test_sqnr_change_is_paired_over_samples() -> None:
    from qgraph.metrics.interval import sqnr_change

    rng = np.random.default_rng(0)
    signal = rng.uniform(1.0, 2.0, size=(40, 2))
    noise = rng.uniform(0.01, 0.02, size=(40, 2))
    before = np.stack([signal, noise], axis=2)
    assert sqnr_change(before, before) == (0.0, 0.0)
    doubled = np.stack([signal, 2 * noise], axis=2)  # every sample's error doubled: -3.01 dB, nothing else
    low, high = sqnr_change(before, doubled)
    assert low == pytest.approx(-10 * math.log10(2), abs=1e-9) and high == pytest.approx(low, abs=1e-9)
    # one sample much better, the others a little worse: the pooled score falls, but the samples cannot show it
    mixed = noise.copy()
    mixed[0] *= 0.2
    mixed[1:] *= 1.05
    noisy_before = np.stack([signal, noise * np.where(np.arange(40) == 0, 30.0, 1.0)[:, None]], axis=2)
    noisy_after = np.stack([signal, mixed * np.where(np.arange(40) == 0, 30.0, 1.0)[:, None]], axis=2)
    low, high = sqnr_change(noisy_before, noisy_after)
    assert low < 0.0 < high
    exact = np.stack([signal, np.zeros_like(noise)], axis=2)
    assert sqnr_change(exact, before)[1] == -math.inf  # from no error to some: always a loss
