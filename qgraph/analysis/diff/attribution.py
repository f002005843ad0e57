"""What `qgraph.analysis.diff.culprits` finds: a culprit Q/DQ pair (`Culprit`) and the ranking of all of them
(`Attribution`), kept apart from the search so the measuring modules (`alone`, `probe`) can name them without
importing it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from qgraph.analysis.diff.quant_points import PointStats, QuantPoint
from qgraph.runtime.output_parts import OutputPart, OutputParts


@dataclass
class Culprit:
    """One quantization point with what it does to its values and to the model's outputs."""

    point: QuantPoint
    stats: PointStats
    channel: int | None = None  # the worst channel of a per-channel point
    reason: str = ""
    output_noise: float | None = None  # η_p: output noise power ratio with only this pair applied
    contribution: float | None = None  # η_p / η (B's own output noise ratio)

    @property
    def local_sqnr_db(self) -> float:
        """SQNR of Q/DQ(x) against x over every value (and every channel)."""
        return _db(self.stats.noise_ratio())

    @property
    def alone_sqnr_db(self) -> float | None:
        """Output SQNR of the reference with only this pair applied."""
        return None if self.output_noise is None else _db(self.output_noise)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``scale``/``zero_point`` of the worst channel for per-channel points)."""
        p, s = self.point, self.stats
        c = self.channel if self.channel is not None else 0
        lo, hi = s.calibrated_range(p)
        return {
            "tensor": p.tensor, "node": p.node, "scope": p.scope, "kind": p.kind, "q_node": p.q_node,
            "dq_node": p.dq_node, "dtype": p.dtype.value, "axis": p.axis, "channel": self.channel,
            "scale": float(p.scale.reshape(-1)[c]), "zero_point": int(p.zero_point.reshape(-1)[c]),
            "calibrated_range": [float(lo[c]), float(hi[c])],
            "observed_range": [float(s.lo[c]), float(s.hi[c])] if s.count[c] else None,
            "clip_fraction": s.clip_fraction(self.channel), "coarseness": float(s.coarseness(p)[c]),
            "flat_clip_fraction": s.flat_clipped / float(s.count.sum()) if s.count.sum() else 0.0,
            "rounding_sqnr_db": self.local_sqnr_db, "contribution": self.contribution,
            "alone_sqnr_db": self.alone_sqnr_db, "measured": self.output_noise is not None,
            "source": "codes" if s.codes_only else "reference", "reason": self.reason,
        }


@dataclass
class Attribution:
    """Culprits of a quantized model, best (most output error) first."""

    culprits: list[Culprit] = field(default_factory=list)
    output_noise: float | None = None  # η of B against A on the same samples
    samples: int = 0
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: If/Loop bodies holding Q/DQ pairs that did not run on these inputs (their pairs are not ranked), one
    #: sentence each.
    not_run: list[str] = field(default_factory=list)
    #: How A's outputs split into parts (`qgraph.runtime.output_parts`; None: whole), and per output the part the output
    #: noise is measured on (B's worst; None: the whole output; empty: every output whole).
    output_parts: OutputParts | None = None
    scored: list[OutputPart | None] = field(default_factory=list)

    def measured_on(self) -> str:
        """``output0[4:22] (scores), the worst part of output0`` when some output is measured on a part, else ''."""
        parts = [p for p in self.scored if p is not None]
        if not parts:
            return ""
        return f"{', '.join(p.label for p in parts)}, the worst part of {', '.join(p.output for p in parts)}"

    def headline(self) -> str | None:
        """One sentence naming the worst pair and why, or None when there is no quantization point."""
        if not self.culprits:
            return None
        c = self.culprits[0]
        where = f"{c.point.kind} {c.point.tensor} (read by {c.point.node})"
        on = self.measured_on()
        whose = "its" if on and len(self.scored) == 1 else "the output"
        share = "" if c.contribution is None else (
            f"; alone it gives {_fmt_db(c.alone_sqnr_db)} dB output SQNR{f' on {on}' if on else ''}, "
            f"{share_text(c.contribution)} of {whose} error")
        return f"most output error comes from the Q/DQ pair on {where}: {c.reason}{share}."

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"samples": self.samples, "output_noise": self.output_noise, "seconds": self.seconds,
                "headline": self.headline(), "notes": self.notes, "not_run": self.not_run,
                "measured_on": [p.to_dict() if p is not None else None for p in self.scored],
                "culprits": [c.to_dict() for c in self.culprits]}


def _db(ratio: float | None) -> float:
    if ratio is None or math.isnan(ratio):
        return math.nan
    return math.inf if ratio <= 0 else -10.0 * math.log10(ratio) if math.isfinite(ratio) else -math.inf


def _fmt_db(x: float | None) -> str:
    return "?" if x is None else "inf" if x == math.inf else f"{x:.1f}"


def share_text(share: float) -> str:
    """A pair's share of the output error; over 100% said in words: alone the pair adds more error than the
    whole model has, because other pairs' errors partly cancel it."""
    if share > 1.0:
        return f"{share:.0%} (alone more than the whole model's error: other pairs partly cancel it)"
    return f"{share:.0%}"
