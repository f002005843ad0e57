"""The float reference's outputs on the first calibration samples, kept by the pass that already runs the float
reference over them, for the passes that score against it later: one float pass over the data fewer.

A fidelity guard (`qgraph.recovery.weight_correction.FidelityGuard`: ``correct_bias``, ``optimize_rounding``)
scores the quantized model against the float reference's outputs on its first calibration samples. The float
reference is the graph ``insert_qdq`` calibrates (the model right before the first float-changing pass:
`qgraph.PassContext.is_float_reference`), and calibration runs it over the same samples: its session then also
fetches the graph outputs (nothing more is computed) and `keep_reference_outputs` keeps those of the first
samples. The values differ from a separate run only by onnxruntime's graph optimizations (float rounding, ~1e-7
relative: -140 dB under any score a guard reads), and the guard scores "before" and "after" against the same
values. Measured on DNSMOS (speechmos wheel, 16 clips of 9 s, 2 cores): the guard's own reference pass took 2.0 s
of ``correct_bias``'s 6.0 s.

Kept only when a pass of the run will need the float reference (it was exported), the samples are run one per
call (``calibration.batch_size: 1``, so a calibration sample is a guard sample) and the outputs stay within
`MAX_BYTES`; otherwise the guard runs the reference itself, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from qgraph.graph import GraphHandle
    from qgraph.pipeline.pass_api import PassContext

__all__ = ["MAX_BYTES", "SAMPLES", "keep_reference_outputs", "reference_outputs"]

#: ``PassContext.cache`` key of the kept outputs.
KEY = "qgraph.reference_outputs"
#: Samples kept at most (a guard's default ``guard_samples``).
SAMPLES = 32
#: Bytes of outputs kept at most; past it nothing is kept (the guard runs the reference itself).
MAX_BYTES = 256 << 20


class _Kept:
    """The graph outputs of the first samples, by sample index, as an observer of each (``update``)."""

    def __init__(self, names: list[str], samples: int) -> None:
        self.names = names
        self.samples = samples
        self.rows: dict[int, dict[str, np.ndarray]] = {}
        self.bytes = 0
        self.full = False  # over MAX_BYTES: dropped

    def observer(self, name: str) -> _Output:
        """The observer of output ``name``."""
        return _Output(self, name)


class _Output:
    """Keeps output ``name`` of each of the first samples in ``kept`` (called in sample order, by one thread)."""

    def __init__(self, kept: _Kept, name: str) -> None:
        self.kept, self.name = kept, name

    def update(self, x: Any, sample_index: int | None = None) -> None:
        kept = self.kept
        if kept.full or sample_index is None or sample_index >= kept.samples:
            return
        # a copy: onnxruntime's output can share its session's memory arena, which it would keep alive
        # (DNSMOS: 490 MB of calibration activations held until the guard ran)
        value = np.array(x, copy=True)
        kept.bytes += value.nbytes
        if kept.bytes > MAX_BYTES:
            kept.full, kept.rows = True, {}
            return
        kept.rows.setdefault(sample_index, {})[self.name] = value


def keep_reference_outputs(ctx: PassContext, graph: GraphHandle) -> dict[str, Any]:
    """Observers (``{output: observer}``) to feed with the graph outputs while calibrating ``graph``, when
    ``graph`` is the float reference and the kept outputs would serve (module docstring); ``{}`` otherwise (also
    when an output is a graph input or a constant: the run does not produce it)."""
    if ctx.calibration.batch_size != 1 or ctx.float_reference is None or not ctx.is_float_reference(graph):
        return {}
    produced = {t.name for node in graph.graph.nodes for t in node.outputs}
    names = [t.name for t in graph.graph.outputs]
    if not names or not all(n in produced for n in names):
        return {}
    kept = _Kept(names, SAMPLES)
    ctx.cache[KEY] = kept
    return {n: kept.observer(n) for n in names}


def reference_outputs(ctx: PassContext, names: Sequence[str], samples: int) -> list[list[np.ndarray]] | None:
    """The float reference's outputs ``names`` on the first ``samples`` calibration samples (per sample, in
    ``names`` order), as calibration kept them; None when they were not kept (whole)."""
    kept = ctx.cache.get(KEY)
    if not isinstance(kept, _Kept) or kept.full or samples > kept.samples:
        return None
    if any(i not in kept.rows or any(n not in kept.rows[i] for n in names) for i in range(samples)):
        return None
    return [[kept.rows[i][n] for n in names] for i in range(samples)]
