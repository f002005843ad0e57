"""Predicting output error from local noise ratios: additive noise per graph output, calibrated on the INT8 run.

"Output" below is each scored part of the graph outputs (`qgraph.runtime.output_parts`: the parts of an output a final
Concat joins, each with its own weights ``κ``, else the whole output), in the order of the baseline's diffs.

Model. Quantization noise injected at different nodes is uncorrelated and, relative to the signal it rides
on, passes through the layers after it roughly unchanged, so each graph output's noise ratio is a sum over the
nodes that reach it: ``η_o ∝ Σ_n κ_n,o η_n`` (``η_n`` and the output weights ``κ`` from
`qgraph.analysis.sensitivity.probe`; ``κ`` discounts branches that merge into larger signals). The constant is fixed by
the INT8 model's measured output noise ``η_o`` (from its SQNR), so with the nodes ``S`` back in float

    f_o(S) = Σ_{n ∉ S} κ_n,o η_n / Σ_n κ_n,o η_n
    SQNR_o(S) = SQNR_o - 10 log10 f_o(S)
    cosine_o(S) = 1 / sqrt(1 + (1/cosine_o² - 1) · f_o(S))

and the target's score is the smallest over the outputs (user metrics have no prediction: NaN).

`order` ranks the nodes for the search: greedy on the worst predicted output (take the largest ``κ_n,o η_n``
for the output ``o`` whose predicted SQNR is lowest, update the sums, repeat): O(N · outputs + N log N).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from qgraph.analysis.sensitivity.probe import LocalError
from qgraph.analysis.sensitivity.targets import Target
from qgraph.runtime.compare import TensorDiff

#: Noise ratio standing for a non-finite local error (a node whose copy gives NaN/Inf): ranked first.
ETA_CAP = 1e6


class NoiseModel:
    """Per-output additive noise model (see module docs)."""

    def __init__(self, errors: dict[str, LocalError], baseline: Sequence[TensorDiff]) -> None:
        self.errors = errors
        # Output-referred local noise: η_n · κ_n,o (`probe.output_weights`).
        self.eta = {n: min(e.eta, ETA_CAP) for n, e in errors.items()}
        self.contrib = {n: [self.eta[n] * k for k in e.weights] for n, e in errors.items()}
        self.sqnr = [d.sqnr_db for d in baseline]
        self.cosine = [d.cosine for d in baseline]
        self.outputs = [o for o, d in enumerate(baseline) if not math.isnan(d.sqnr_db)]
        self.names = [d.output for d in baseline]  # the graph output of each scored part
        self.total = [0.0] * len(baseline)
        self.bits = {n: [o for o in self.outputs if o < len(c) and c[o] > 0] for n, c in self.contrib.items()}
        for n in self.eta:
            for o in self._bits(n):
                self.total[o] += self.contrib[n][o]

    def _bits(self, name: str) -> list[int]:
        return self.bits[name]

    def _output_score(self, target: Target, o: int, remaining: float) -> float:
        f = remaining / self.total[o] if self.total[o] > 0 else 1.0
        f = max(f, 0.0)
        if target.kind == "cosine":
            cos = self.cosine[o]
            eta_c = 1.0 / (cos * cos) - 1.0 if 0.0 < cos < 1.0 else 10.0 ** (-self.sqnr[o] / 10.0)
            return 1.0 / math.sqrt(1.0 + eta_c * f)
        if f == 0.0:
            return math.inf
        return self.sqnr[o] - 10.0 * math.log10(f)

    def score(self, target: Target, remaining: Sequence[float]) -> float:
        """Predicted target score with ``remaining[o]`` of output ``o``'s local noise left (NaN for metrics)."""
        if target.kind == "metric" or not self.outputs:
            return math.nan
        kind = target if target.kind == "cosine" else Target("sqnr", "sqnr")
        scored = [o for o in self.outputs if not target.outputs or self.names[o] in target.outputs]
        return min((self._output_score(kind, o, remaining[o]) for o in scored), default=math.nan)

    def gain_alone(self, target: Target, name: str) -> float:
        """Predicted gain of the target score with only ``name`` back in float."""
        rem = list(self.total)
        for o in self._bits(name):
            rem[o] -= self.contrib[name][o]
        return target.gain(self.score(target, rem), self.score(target, self.total))

    def order(self) -> list[str]:
        """Every node, in the order the search falls them back (see module docs)."""
        by_eta = sorted(self.eta, key=lambda n: -self.eta[n])
        lists = {o: sorted((n for n in by_eta if o in self._bits(n)), key=lambda n: -self.contrib[n][o])
                 for o in self.outputs}
        ptr = dict.fromkeys(self.outputs, 0)
        rem = list(self.total)
        chosen: set[str] = set()
        out: list[str] = []
        sqnr = Target("sqnr", "sqnr")
        while True:
            worst, worst_score = None, math.inf
            for o in self.outputs:
                items = lists[o]
                while ptr[o] < len(items) and items[ptr[o]] in chosen:
                    ptr[o] += 1
                if ptr[o] < len(items) and self.contrib[items[ptr[o]]][o] > 0:
                    s = self._output_score(sqnr, o, rem[o])
                    if s < worst_score or worst is None:
                        worst, worst_score = o, s
            if worst is None:
                break
            name = lists[worst][ptr[worst]]
            chosen.add(name)
            out.append(name)
            for o in self._bits(name):
                rem[o] -= self.contrib[name][o]
        return out + [n for n in by_eta if n not in chosen]

    def prefix_scores(self, target: Target, order: Sequence[str]) -> list[float]:
        """Predicted score with the first ``m`` nodes of ``order`` in float, for m = 0 .. len(order)."""
        rem = list(self.total)
        scores = [self.score(target, rem)]
        for name in order:
            if name in self.eta:
                for o in self._bits(name):
                    rem[o] -= self.contrib[name][o]
            scores.append(self.score(target, rem))
        return scores
