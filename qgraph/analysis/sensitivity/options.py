"""The options of the automatic fallback search (`qgraph.analysis.sensitivity.search.auto_fallback`), as one typed
object: what the ``float_fallback`` pass builds from its ``auto`` config and ``qgraph sensitivity`` from its command
line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qgraph.analysis.sensitivity.cost import CostSpec
from qgraph.analysis.sensitivity.prefix import StageProgress
from qgraph.graph.selectors import NodeSelector
from qgraph.quant.reference_weights import ReferenceWeights
from qgraph.runtime.executor import Executor, ExecutorSpec
from qgraph.runtime.kernels.measure import Kernels
from qgraph.runtime.output_parts import OutputParts
from qgraph.runtime.streaming import Recurrence


@dataclass(frozen=True)
class SearchOptions:
    """How the automatic fallback search runs (every field has the default the CLI and the pass use)."""

    #: Which quantized nodes may go back to float (None: every quantized node).
    candidates: NodeSelector | None = None
    #: Nodes in float regardless (counted in ``max_nodes``).
    keep_float: Sequence[str] = ()
    max_nodes: int | None = None
    #: Seconds; checked before every evaluation (one that would end after it is not started).
    max_time: float | None = None
    #: Local worker processes for full evaluations when no ``executor`` is given.
    jobs: int = 1
    samples: int | None = None
    batch_size: int = 32
    #: The kernels accuracy is measured with (`qgraph.runtime.kernels.measure`; None: the deployed ones).
    kernels: Kernels | None = None
    progress: StageProgress | None = None
    #: Rank the nodes and stop (no search).
    report_only: bool = False
    #: How many of the ranked nodes to measure exactly (one evaluation each).
    exact_top: int = 0
    #: Where full evaluations run (`qgraph.runtime.executor`; one executor serves the whole search).
    executor: ExecutorSpec | Executor | None = None
    #: The float weights nodes going back to float take instead of their integer ones.
    float_weights: ReferenceWeights | None = None
    #: A latency cost table: rank by output error bought per added latency (`qgraph.analysis.sensitivity.cost`).
    costs: CostSpec | None = None
    #: > 0: time the float, INT8 and chosen models in onnxruntime that many rounds.
    latency_rounds: int = 0
    #: With ``costs``: prefixes modelled at most this many times the float model's latency (1.0: never slower),
    #: and, with ``latency_rounds``, cut back until timed within it (`qgraph.analysis.sensitivity.measured_cap`).
    max_latency: float | None = None
    #: ``latency`` (error per added latency, with ``costs``) or ``error``.
    rank_by: str = "latency"
    #: A recurrent model's state feedback: every full evaluation runs streamed (`qgraph.runtime.streaming`).
    recurrence: Recurrence | None = None
    #: What a chosen node becomes: ``float``, ``a16w8`` (16-bit activations) or ``a16w16`` (16-bit weights too).
    remedy: str = "float"
    #: Quantized nodes inside If/Loop bodies are candidates too, each measured exactly once for the ranking.
    in_bodies: bool = False
    #: The scored parts of the outputs (`qgraph.runtime.output_parts`; None: each output whole).
    parts: OutputParts | None = None
