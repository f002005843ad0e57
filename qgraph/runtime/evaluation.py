"""Held-out evaluation: data distinct from the calibration data, optional labels, and the user's metric.

``--eval-data`` takes any data source (``.npz``, folder, ``module:function``); ``--labels`` an ``.npy``, an
``.npz`` (its only array, or ``FILE.npz:KEY``); when the eval ``.npz`` itself holds an array named ``labels``
that is not a model input, those are the labels (and the report says so). ``--metric`` is a built-in task metric
(``detection.f1(score=0.3)``, ``text_boxes``, ``ctc.cer``, ``top1``, ...: `qgraph.metrics`, ``docs/metrics.md``;
its direction comes with it) or ``package.module:function`` or ``path/to/file.py:function``, called as::

    metric(outputs, labels)       # with labels: outputs[i] = model output i over all samples (axis 0)
    metric(outputs, references)   # without: references = the reference model's outputs, same layout

and returns a float (higher is better unless told otherwise). Every model is scored on the same samples; the
reference's own score is ``metric(reference_outputs, labels or reference_outputs)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qgraph.data import DataSource, Feed, import_callable, open_data_source, user_code
from qgraph.errors import DataError
from qgraph.io.inputs import array_file_problem, input_file_problem
from qgraph.metrics import BuiltinMetric, Interval, builtin_metric, is_builtin
from qgraph.runtime.compare import TensorDiff, session_runs
from qgraph.runtime.kernels.measure import Kernels, SaturationCount, deployed, emulation_notes, saturation_of
from qgraph.runtime.output_parts import OutputParts, PartDiffs

Metric = Callable[[list[np.ndarray], Any], float]
LABEL_KEY = "labels"


def load_labels(spec: str | Path) -> tuple[np.ndarray, str]:
    """Labels from ``FILE.npy``, ``FILE.npz`` (one array, or one named ``labels``) or ``FILE.npz:KEY``."""
    text = str(spec)
    path_text, _, key = text.rpartition(":") if text.count(":") and not Path(text).exists() else (text, "", "")
    path = Path(path_text)
    problem = input_file_problem(path)
    if problem is not None:
        raise DataError(f"--labels {path}: {problem}.")
    if not path.is_file():
        raise DataError(f"--labels {text}: no such file. Give FILE.npy, FILE.npz or FILE.npz:KEY.")
    if path.suffix in (".npy", ".npz") and (problem := array_file_problem(path, path.suffix)) is not None:
        raise DataError(f"--labels {path}: {problem}.")
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False), str(path)
    if path.suffix != ".npz":
        raise DataError(f"--labels {text}: unsupported file type {path.suffix!r}; give .npy or .npz[:KEY].")
    with np.load(path, allow_pickle=False) as data:
        keys = list(data.files)
        if not key:
            key = keys[0] if len(keys) == 1 else LABEL_KEY
        if key not in keys:
            raise DataError(f"--labels {text}: {path} has no array {key!r} (it has {keys}); give FILE.npz:KEY.")
        return np.asarray(data[key]), f"{path}:{key}"


def load_metric(spec: str) -> Metric:
    """The built-in metric ``spec`` names (`qgraph.metrics`), else import ``module:function`` or
    ``path/to/file.py:function``."""
    if is_builtin(spec):
        return builtin_metric(spec, DataError)
    return import_callable(spec, DataError, "--metric")


def labels_for(metric: Metric | None, labels: np.ndarray, rows: int | None) -> np.ndarray:
    """The labels ``metric`` is called with for ``rows`` output rows: the first ``rows`` (one label per sample),
    or the whole table for a metric whose labels are one table for every sample (detection boxes)."""
    if isinstance(metric, BuiltinMetric) and not metric.labels_per_sample:
        return labels
    return labels[:rows]


@dataclass
class Evaluation:
    """Samples to evaluate on, with optional labels and metric (see module docs)."""

    feeds: list[Feed]
    description: str
    labels: np.ndarray | None = None
    labels_from: str | None = None
    metric_spec: str | None = None
    metric: Metric | None = None
    higher_is_better: bool = True
    held_out: bool = True  # False when the samples are the calibration data (the report says so)

    @classmethod
    def open(
        cls,
        model: onnx.ModelProto,
        data: str | Path,
        *,
        labels: str | Path | None = None,
        metric: str | None = None,
        samples: int | None = None,
        higher_is_better: bool = True,
    ) -> Evaluation:
        """Bind ``data`` to ``model``'s inputs, load labels (given or found in the ``.npz``) and the metric."""
        source = open_data_source(str(data), samples=samples).bind(model)
        feeds = list(source)
        if not feeds:
            raise DataError(f"evaluation data {data}: no samples.")
        label_arr, label_from = (None, None)
        if labels is not None:
            label_arr, label_from = load_labels(labels)
        elif str(data).endswith(".npz") and Path(str(data)).is_file():
            inputs = {i.name for i in model.graph.input}
            with np.load(str(data), allow_pickle=False) as npz:
                if LABEL_KEY in npz.files and LABEL_KEY not in inputs:
                    label_arr, label_from = np.asarray(npz[LABEL_KEY]), f"{data}:{LABEL_KEY}"
        fn = load_metric(metric) if metric else None
        if isinstance(fn, BuiltinMetric):  # a built-in knows its direction (ctc.cer: lower is better)
            higher_is_better = fn.higher_is_better
        # one label per sample, checked before any model runs; a detection label table is the metric's to read
        if label_arr is not None and (not isinstance(fn, BuiltinMetric) or fn.labels_per_sample):
            label_arr, label_from = _checked_labels(label_arr, str(label_from), feeds, source.truncated)
        ev = cls(feeds, _sample_count(len(feeds), source) + f" sample(s) of {source.description}" +
                 (" (--samples to use more)" if source.truncated else ""), label_arr, label_from, metric,
                 fn, higher_is_better)
        return ev

    def describe(self) -> str:
        """Which data, labels and metric were used (one line for reports and summaries)."""
        parts = [self.description + ("" if self.held_out else " (the calibration data itself: not held out)")]
        if self.labels_from:
            parts.append(f"labels {self.labels_from}")
        if self.metric_spec:
            parts.append(f"metric {self.metric_spec} ({'higher' if self.higher_is_better else 'lower'} is better)")
        return "; ".join(parts)

    def _target(self, outputs: list[np.ndarray], references: list[np.ndarray]) -> Any:
        """What the metric compares with: the labels for these output rows, else the reference outputs."""
        if self.labels is None:
            return references
        rows = outputs[0].shape[0] if outputs and np.ndim(outputs[0]) else len(self.feeds)
        per_sample = not isinstance(self.metric, BuiltinMetric) or self.metric.labels_per_sample
        if per_sample and rows > len(self.labels):
            raise DataError(f"labels {self.labels_from}: {len(self.labels)} label(s) for {rows} output rows; "
                            "give one label per sample.")
        return labels_for(self.metric, self.labels, rows)

    def score(self, outputs: list[np.ndarray], references: list[np.ndarray]) -> float | None:
        """The metric on ``outputs`` (None without a metric); NaN when the metric returns NaN."""
        return self.scored(outputs, references)[0]

    def scored(self, outputs: list[np.ndarray], references: list[np.ndarray]) -> tuple[float | None, Interval | None]:
        """`score` and, for a built-in metric, the 95 % bootstrap interval of it over the samples
        (`qgraph.metrics.interval`; None for a user metric or a field that pools no per-sample counts)."""
        if self.metric is None:
            return None, None
        target = self._target(outputs, references)
        with user_code(f"--metric {self.metric_spec}", "the metric", should="A metric returns a float; it is called "
                       "as function(outputs, labels or reference outputs), outputs[i] = output i over all samples "
                       "(axis 0)."):
            if isinstance(self.metric, BuiltinMetric):
                return self.metric.score_with_interval(outputs, target)
            return float(self.metric(outputs, target)), None

    def metric_and_interval(self, outputs: list[np.ndarray], references: list[np.ndarray]
                            ) -> tuple[float | None, dict[str, Any] | None]:
        """`scored` with the interval in JSON form (report rows)."""
        value, spread = self.scored(outputs, references)
        return value, spread.to_dict() if spread is not None else None

    def outputs(self, model: onnx.ModelProto | str | Path,
                kernels: Kernels | None = None) -> tuple[list[str], list[np.ndarray]]:
        """``model``'s output names and outputs over every sample, concatenated on axis 0, run with ``kernels``
        (default: this host's deployed kernels)."""
        return self.run(model, kernels)[:2]

    def run(self, model: onnx.ModelProto | str | Path, kernels: Kernels | None = None
            ) -> tuple[list[str], list[np.ndarray], list[SaturationCount], list[str]]:
        """`outputs`, the layers whose int16 pair sums saturated on the way (emulated AVX2 arithmetic), and where
        an emulation is not bit for bit the target's deployed arithmetic (`emulation_notes`)."""
        session = (kernels or deployed()).session(model, mem_pattern=False, count=True)
        names = [o.name for o in session.get_outputs()]
        per: list[list[np.ndarray]] = [[] for _ in names]
        for values in session_runs(session, names, self.feeds):
            for i, v in enumerate(values):
                per[i].append(np.asarray(v))
        return names, [concat(v) for v in per], saturation_of(session), emulation_notes(session)


def _checked_labels(labels: np.ndarray, where: str, feeds: list[Feed], truncated: bool) -> tuple[np.ndarray, str]:
    """Labels checked against the samples before any model runs: one row per sample row (the first input's axis 0
    summed over the feeds); more labels are used in part only when --samples cut the data (and the description
    says so), otherwise they are an error, as fewer are."""
    if labels.ndim == 0:
        raise DataError(f"labels {where}: a single value (a 0-d array); give one label per sample (an array whose "
                        "axis 0 indexes the samples).")
    rows = sum(int(np.shape(next(iter(f.values())))[0]) if f and np.ndim(next(iter(f.values()))) else 1
               for f in feeds)
    if len(labels) < rows or (len(labels) > rows and not truncated):
        raise DataError(f"labels {where}: {len(labels)} label(s) for {rows} sample row(s) of the evaluation data; "
                        "give exactly one label per sample.")
    if len(labels) > rows:
        return labels[:rows], f"{where} (the first {rows} of {len(labels)}, as --samples cut the data)"
    return labels, where


def _sample_count(used: int, source: DataSource) -> str:
    """``8``, or ``8 of 12`` when a --samples cap used fewer than the source holds (``first 8`` when its size is
    unknown)."""
    if not source.truncated:
        return str(used)
    total = source.available
    return f"{used} of {total}" if total is not None else f"the first {used}"


def concat(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Per-sample arrays joined on axis 0 (scalars stacked)."""
    if not parts:
        return np.zeros((0,), np.float32)
    return np.concatenate(parts, axis=0) if np.ndim(parts[0]) else np.stack(parts)


def top1_agreement(reference: np.ndarray, candidate: np.ndarray, min_classes: int = 2) -> float | None:
    """Share of rows whose arg-max class agrees, for class scores ``[N, C]`` (or ``[N, C, 1, ...]``) with at least
    ``min_classes`` columns. Whether an output is class scores at all is the graph's business
    (`qgraph.runtime.class_outputs`): callers ask only for the outputs it names."""
    if reference.ndim < 2 or reference.shape[1] < max(2, min_classes) or reference.shape != candidate.shape or \
            any(d != 1 for d in reference.shape[2:]) or reference.dtype.kind != "f" or not len(reference):
        return None
    r, c = reference.reshape(reference.shape[0], -1), candidate.reshape(candidate.shape[0], -1)
    return float(np.mean(r.argmax(axis=1) == c.argmax(axis=1)))


@dataclass
class StageScore:
    """One model (or saved outputs) scored against the reference outputs on the same samples."""

    stage: str
    outputs: list[TensorDiff] = field(default_factory=list)
    top1: list[float | None] = field(default_factory=list)
    metric: float | None = None
    #: How far the metric could move on another draw of as many samples (built-in metrics; `qgraph.metrics.interval`)
    metric_interval: Interval | None = None
    error: str | None = None
    #: The scored parts of the outputs (`qgraph.runtime.output_parts`: each part of an output a final Concat joins, else
    #: the whole output); empty: the outputs themselves.
    parts: list[TensorDiff] = field(default_factory=list)

    @property
    def scored(self) -> list[TensorDiff]:
        """What the lowest SQNR and cosine are taken over: the parts, else the outputs."""
        return self.parts or self.outputs

    @property
    def sqnr_db(self) -> float:
        """Lowest output SQNR (dB), over the parts of split outputs."""
        return min((d.sqnr_db for d in self.scored), default=math.nan)

    @property
    def cosine(self) -> float:
        """Lowest output cosine similarity, over the parts of split outputs."""
        return min((d.cosine for d in self.scored), default=math.nan)

    @property
    def top1_agreement(self) -> float | None:
        """Top-1 agreement of the first classification-shaped output, if any."""
        return next((t for t in self.top1 if t is not None), None)


def paired(names: Sequence[str], got_names: Sequence[str], got: Sequence[np.ndarray]) -> list[np.ndarray] | str:
    """``got`` (outputs named ``got_names``) in the order of the reference's ``names``: outputs are compared by name,
    never by position (two models listing the same outputs in another order must not be compared crosswise). A
    sentence naming both sides when the names differ."""
    if sorted(got_names) != sorted(names):
        return (f"its outputs are {list(got_names)}, the reference's {list(names)}: outputs are compared by name, so "
                "both models must have the same output names (rename them)")
    by_name = dict(zip(got_names, got, strict=True))
    return [by_name[n] for n in names]


def score_stage(stage: str, reference: Sequence[np.ndarray], names: Sequence[str], got: Sequence[np.ndarray],
                evaluation: Evaluation | None = None, parts: OutputParts | None = None,
                classes: Mapping[str, int] | None = None, got_names: Sequence[str] | None = None) -> StageScore:
    """Compare ``got`` with ``reference`` output by output (by name when ``got_names`` are given, see `paired`;
    else by position), and part by part where ``parts`` split an output (`qgraph.runtime.output_parts`), and apply
    the metric. Top-1 agreement only for the outputs ``classes`` names (`qgraph.runtime.class_outputs`; None:
    every output shaped like class scores)."""
    if got_names is not None:
        ordered = paired(names, got_names, got)
        if isinstance(ordered, str):
            return StageScore(stage, error=ordered)
        got = ordered
    if len(got) != len(reference):
        return StageScore(stage, error=f"{len(got)} outputs where the reference has {len(reference)}")
    out = StageScore(stage)
    for name, r, g in zip(names, reference, got, strict=True):
        if np.shape(r) != np.shape(g):
            return StageScore(stage, error=f"output {name}: shape {list(np.shape(g))} vs reference "
                                           f"{list(np.shape(r))}")
        need = classes.get(name) if classes is not None else 2
        out.top1.append(top1_agreement(np.asarray(r), np.asarray(g), need) if need is not None else None)
    diffs = PartDiffs(parts if parts is not None else OutputParts.whole(names), names)
    diffs.add(reference, got)
    out.outputs, out.parts = diffs.whole(), diffs.scored() if parts is not None and parts.split else []
    if evaluation is not None:
        out.metric, out.metric_interval = evaluation.scored(list(got), list(reference))
    return out
