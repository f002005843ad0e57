"""Recurrent models run *streamed*: each step fed the state its own previous step produced, as deployed.

A recurrent model (a voice-activity detector, a streaming ASR encoder) takes its state as an input and returns
the next state as an output; in use the state is carried from step to step. Scoring a quantized model on
calibration samples that each carry the *float* model's state (chunk-wise) misses the error that accumulates
through the state. `Recurrence` names the feedback (``state_inputs``: model input -> the output that feeds it at
the next step) and how consecutive samples form sequences; `OutputScore` scores a candidate model against the
float reference, both run the same way:

- chunk-wise (no recurrence): every sample as it is in the data;
- streamed: samples in data order form sequences; the first sample of a sequence is fed as it is in the data,
  each later one with its state inputs replaced by the outputs the *same* model produced at the previous step
  (the float reference its own states, the candidate its own).

Sequences restart every ``sequence_length`` samples, or, by default, where the data says: sample ``t`` continues
the sequence of sample ``t - 1`` when its state inputs are (within ``tolerance``, relative to the state's largest
magnitude) the float reference's state outputs at ``t - 1``, i.e. the data was recorded by streaming the float
model; anywhere else (an utterance starting from a zero state) a new sequence starts. Data whose states were not
recorded so forms one-sample sequences: the score is then the chunk-wise one, and `OutputScore.describe` says so.

The score of a candidate is, per graph output ``o`` over every sample's output,
``SQNR_o = 10 log10(Σ y_o² / Σ (ŷ_o - y_o)²)`` (dB; +inf when identical, -inf when not finite), and the model's
score is the minimum over outputs; given the outputs' parts (`qgraph.runtime.output_parts`), per part of an output that
a final Concat joins, the worst part deciding. Cost: one run per sample (the same as chunk-wise), sequential within a
sequence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from pydantic import Field

from qgraph.data import Feed
from qgraph.errors import PassError
from qgraph.graph.names import GraphInputName, GraphOutputName
from qgraph.options import PassConfig
from qgraph.runtime.compare import session_run, session_runs
from qgraph.runtime.output_parts import OutputPart, OutputParts

__all__ = ["OutputScore", "Recurrence", "check_recurrence", "run_streamed", "sequence_starts"]


class Recurrence(PassConfig):
    """Which outputs feed which inputs at the next step, and where sequences restart (module docstring)."""

    state_inputs: dict[GraphInputName, GraphOutputName] = Field(
        min_length=1, description="Model input -> the output that feeds it at the next step (silero-vad: "
        "{state: stateN}).")
    sequence_length: int | None = Field(
        default=None, ge=1, description="Restart a sequence every N samples; unset: where the data says (a sample "
        "whose state is not the float model's state after the previous sample starts a new sequence).")
    tolerance: float = Field(
        default=1e-3, gt=0, description="Continuity test without sequence_length: max |state - previous output| "
        "<= tolerance x max |previous output|.")


def _io(model: onnx.ModelProto) -> tuple[dict[str, onnx.ValueInfoProto], dict[str, onnx.ValueInfoProto]]:
    initializers = {t.name for t in model.graph.initializer}
    inputs = {v.name: v for v in model.graph.input if v.name not in initializers}
    return inputs, {v.name: v for v in model.graph.output}


def _type(value: onnx.ValueInfoProto) -> tuple[int, list[int | str]]:
    t = value.type.tensor_type
    dims: list[int | str] = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
    return t.elem_type, dims


def check_recurrence(recurrence: Recurrence, model: onnx.ModelProto, who: str) -> None:
    """`PassError` (prefixed ``who``) unless every state input is a model input, its output a model output of
    the same element type, rank and static sizes."""
    inputs, outputs = _io(model)
    example = "e.g. `recurrent: {state_inputs: {state: stateN}}`"
    for name, out in recurrence.state_inputs.items():
        if name not in inputs:
            raise PassError(f"{who}: recurrent.state_inputs names input {name!r}, which the model does not take; "
                            f"its inputs are {sorted(inputs)}. Map each state input to the output that feeds it, "
                            f"{example}.")
        if out not in outputs:
            raise PassError(f"{who}: recurrent.state_inputs maps {name!r} to output {out!r}, which the model does "
                            f"not produce; its outputs are {sorted(outputs)}. Name the output that carries the "
                            f"next state, {example}.")
        (ti, di), (to, do) = _type(inputs[name]), _type(outputs[out])
        static = len(di) == len(do) and all(not isinstance(a, int) or not isinstance(b, int) or a in (0, b)
                                            or b == 0 for a, b in zip(di, do, strict=True))
        if ti != to or not static:
            raise PassError(f"{who}: recurrent state input {name!r} ({onnx.TensorProto.DataType.Name(ti)} {di}) "
                            f"cannot take output {out!r} ({onnx.TensorProto.DataType.Name(to)} {do}): element "
                            "type and shape must match. Map the input to the output of the same state.")


def sequence_starts(recurrence: Recurrence, feeds: Sequence[Feed],
                    chunk_outputs: Sequence[Mapping[str, np.ndarray]]) -> list[int]:
    """Indices of the samples that start a sequence (module docstring). ``chunk_outputs[t]`` holds the float
    reference's state outputs on ``feeds[t]`` as it is in the data."""
    if recurrence.sequence_length is not None:
        return list(range(0, len(feeds), recurrence.sequence_length))
    starts = [0] if feeds else []
    for t in range(1, len(feeds)):
        for name, out in recurrence.state_inputs.items():
            prev = np.asarray(chunk_outputs[t - 1][out], np.float64)
            cur = np.asarray(feeds[t][name], np.float64)
            scale = float(np.max(np.abs(prev))) if prev.size else 0.0
            if cur.shape != prev.shape or not float(np.max(np.abs(cur - prev), initial=0.0)) <= \
                    recurrence.tolerance * max(scale, 1e-30):
                starts.append(t)
                break
    return starts


def run_streamed(session: Any, names: Sequence[str], feeds: Sequence[Feed], starts: Sequence[int],
                 recurrence: Recurrence) -> list[dict[str, np.ndarray]]:
    """``names`` (plus the state outputs) of ``session`` on every feed, streamed: at a sequence start the feed as
    it is, else its state inputs replaced by this session's state outputs at the previous step."""
    wanted = list(dict.fromkeys([*names, *recurrence.state_inputs.values()]))
    begin = set(starts)
    out: list[dict[str, np.ndarray]] = []
    for t, feed in enumerate(feeds):
        if t not in begin and out:
            prev = out[-1]
            feed = {**feed, **{i: prev[o].astype(np.asarray(feed[i]).dtype, copy=False)
                               for i, o in recurrence.state_inputs.items()}}
        out.append(dict(zip(wanted, (np.asarray(v) for v in session_run(session, wanted, feed)), strict=True)))
    return out


class OutputScore:
    """A float reference's outputs on ``feeds`` (chunk-wise, or streamed with ``recurrence``) and the SQNR of a
    candidate session run the same way (module docstring); ``outputs`` limits the score to those graph outputs
    (default: all); ``parts`` (`qgraph.runtime.output_parts.find_output_parts` of the reference model) scores each part
    of a split output (default: every output whole)."""

    def __init__(self, reference: Any, feeds: Sequence[Feed], recurrence: Recurrence | None = None,
                 outputs: Sequence[str] | None = None, parts: OutputParts | None = None, *,
                 given: Sequence[Sequence[Any]] | None = None) -> None:
        self.feeds = list(feeds)
        self.recurrence = recurrence
        self.names = list(outputs) if outputs else [o.name for o in reference.get_outputs()]
        split = {s.output: s.parts for s in parts.outputs} if parts is not None else {}
        #: What is scored: (position in ``names``, part) per scored part (the whole output: its one part).
        self.units = [(k, p) for k, n in enumerate(self.names) for p in split.get(n, (OutputPart(n, n),))]
        wanted = list(dict.fromkeys([*self.names, *(recurrence.state_inputs.values() if recurrence else ())]))
        if given is not None:  # `of_outputs`: ``given[i]`` holds ``names``' values on ``feeds[i]``
            if recurrence is not None or len(given) != len(self.feeds):
                raise ValueError(f"{len(given)} given output rows for {len(self.feeds)} samples (chunk-wise only)")
            chunk = [dict(zip(self.names, row, strict=True)) for row in given]
        else:
            chunk = [dict(zip(wanted, out, strict=True)) for out in session_runs(reference, wanted, self.feeds)]
        self.starts = list(range(len(self.feeds)))
        if recurrence is not None:
            self.starts = sequence_starts(recurrence, self.feeds, chunk)
            chunk = run_streamed(reference, self.names, self.feeds, self.starts, recurrence)
        self.reference = [[np.asarray(r[n], np.float64) for n in self.names] for r in chunk]
        self.last: list[Any] = []
        self.last_sums = np.zeros((0, len(self.units), 2))

    @classmethod
    def of_outputs(cls, names: Sequence[str], feeds: Sequence[Feed], outputs: Sequence[Sequence[Any]],
                   parts: OutputParts | None = None) -> OutputScore:
        """A chunk-wise score whose reference outputs were computed already: ``outputs[i]`` holds ``names``' values
        on ``feeds[i]`` (`qgraph.recovery.reference_outputs`)."""
        return cls(None, feeds, outputs=names, parts=parts, given=outputs)

    @property
    def streamed(self) -> bool:
        """Whether some sample is fed a state the model itself produced."""
        return len(self.starts) < len(self.feeds)

    def describe(self) -> str:
        """How the score is measured, for a decision line."""
        n = len(self.feeds)
        if self.recurrence is None:
            return f"chunk-wise on {n} samples"
        if not self.streamed:
            return (f"{n} samples, no two consecutive ones continue a sequence (states not recorded from the float "
                    "model: set recurrent.sequence_length), so chunk-wise")
        return f"streamed over {len(self.starts)} sequence(s) of {n} samples (own states fed back)"

    @property
    def labels(self) -> list[str]:
        """What each value of `per_output_db` measures: an output, or a part of one (``output0[4:22] (scores)``)."""
        return [p.label for _, p in self.units]

    def per_output_db(self, session: Any) -> list[float]:
        """SQNR (dB) of each scored output part of ``session`` (`labels`) against the reference, run the same way."""
        if self.recurrence is not None:
            got = [[r[n] for n in self.names]
                   for r in run_streamed(session, self.names, self.feeds, self.starts, self.recurrence)]
        else:
            got = list(session_runs(session, self.names, self.feeds))
        self.last = got
        #: per sample and scored part: (sum r², sum (c - r)²), for a paired interval of a change (`sqnr_change`)
        self.last_sums = np.zeros((len(got), len(self.units), 2))
        for s, (ref, out) in enumerate(zip(self.reference, got, strict=True)):
            for u, (k, part) in enumerate(self.units):
                a, b = part.cut(ref[k]), part.cut(np.asarray(out[k], np.float64))
                self.last_sums[s, u] = float(np.sum(a * a)), float(np.sum((a - b) ** 2))
        signal, noise = self.last_sums.sum(axis=0).T
        return [-math.inf if not math.isfinite(n) else math.inf if n == 0 else
                10 * math.log10(max(s, 1e-300) / n) for s, n in zip(signal, noise, strict=True)]

    def joined(self, rows: Sequence[Sequence[Any]] | None = None) -> list[np.ndarray]:
        """Per output, the samples of ``rows`` (default: the reference's) joined on axis 0: the layout a task
        metric (`qgraph.metrics`) is called with. `per_output_db` keeps the candidate's rows in ``last``."""
        rows = self.reference if rows is None else rows
        return [np.concatenate([np.asarray(r[k]) for r in rows]) if np.ndim(rows[0][k]) else
                np.stack([np.asarray(r[k]) for r in rows]) for k in range(len(self.names))]

    def score_db(self, session: Any) -> float:
        """min over the scored parts of `per_output_db` (NaN/Inf outputs give -inf: never "no error")."""
        return float(min(self.per_output_db(session)))
