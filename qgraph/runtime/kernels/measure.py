"""How qgraph runs a model when it measures accuracy, and which way each measurement takes.

Every accuracy number qgraph prints (``check``, ``diff``, ``run``'s final check and ``--report`` fidelity,
``sensitivity``, automatic fallback, ``tune_ranges``, the weight corrections' guard) is measured through a
`Kernels`:

- ``deployed``: onnxruntime with its default graph optimizations (``ORT_ENABLE_ALL``) on this host, so Q/DQ
  layers run as the fused integer kernels a user deploys (QLinearConv, QGemm, DynamicQuantizeMatMul, ...) with
  this CPU's arithmetic;
- ``emulated``: a target CPU's arithmetic reproduced on any host (`qgraph.runtime.kernels.emulate`). The host's own
  fused kernels run every layer whose integer arithmetic is the same on both CPUs; a layer whose u8×s8 pair sums can
  leave int16 where one of them saturates (AVX2 without VNNI) is rewritten as the exact int32 sum, plus the pair
  saturation when the target has it, and onnxruntime's own requantization (`qgraph.runtime.kernels.requant`).
  Bit for bit what the target's deployed kernels give (YOLOv8n, PicoDet and the digits CNN against onnxruntime's
  real AVX2 kernels). ``exact`` (no CPU in particular) computes Q/DQ in float with optimizations off.

`choose` picks for a model made for ``target`` (a recipe's ``target.cpu``): the host's deployed kernels when the
host is that kind of CPU (or no CPU is declared), else the target's arithmetic emulated, with the host's deployed
numbers as a second opinion (`KernelChoice.other`) and one line that says so (`KernelChoice.mismatch`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

from .host import HostKernels, arithmetic, host_kernels, saturates

Mode = Literal["deployed", "emulated"]
#: What a command's ``--kernels`` asks for: ``auto`` (`choose`), or one mode for every model.
KernelsOption = Literal["auto", "deployed", "emulated"]
KERNEL_OPTIONS: tuple[str, ...] = ("auto", "deployed", "emulated")
#: Families a recipe's ``target.cpu`` can name (``host`` and ``any`` resolve to the host).
TARGET_FAMILIES = ("x86-vnni", "x86-avx2", "arm")
#: The arithmetic of no CPU in particular: exact int32 accumulation (how a recipe with ``cpu: any`` decides).
EXACT = "exact"


@dataclass
class SaturationCount:
    """How often one layer's pair sums saturated in the runs of an emulated session."""

    site: Any  # qgraph.runtime.kernels.emulate.SaturationSite
    saturated: float = 0.0
    computed: float = 0.0

    @property
    def total_pair_sums(self) -> float:
        """Every pair sum the layer computed (risky or not)."""
        return self.computed / self.site.pairs_at_risk * self.site.pairs if self.site.pairs_at_risk else 0.0

    @property
    def fraction(self) -> float:
        """Saturated pair sums among all the layer computed."""
        total = self.total_pair_sums
        return self.saturated / total if total else 0.0

    def describe(self) -> str:
        """``conv3: 1.20% of its u8×s8 pair sums saturated (412 of 34,304); input x/q, weight w; 18 of 64
        channels can``."""
        s = self.site
        return (f"{s.node}: {100 * self.fraction:.3g}% of its u8×s8 pair sums saturated ({self.saturated:,.0f} of "
                f"{self.total_pair_sums:,.0f}); Q/DQ pair {s.activation} × weight {s.weight} ({s.channels_at_risk} "
                f"of {s.channels} channels have pairs that can, worst pair sum {s.worst_pair_sum:+,})")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {**self.site.to_dict(), "saturated": self.saturated, "pair_sums": self.total_pair_sums,
                "fraction": self.fraction}


class EmulatedSession:
    """An onnxruntime session over an emulation model: its extra counter outputs are hidden and accumulated."""

    def __init__(self, session: Any, emulation: Any) -> None:
        self.session = session
        self.emulation = emulation
        self.counts = [SaturationCount(s) for s in emulation.sites]
        self._lock = threading.Lock()  # runs of several samples at once add their counts (`session_runs`)
        hidden = set(emulation.counters)
        self._outputs = [o for o in session.get_outputs() if o.name not in hidden]

    def get_inputs(self) -> list[Any]:
        """The model's inputs."""
        return list(self.session.get_inputs())

    def get_outputs(self) -> list[Any]:
        """The model's outputs, without the counters."""
        return list(self._outputs)

    def run(self, output_names: Any, input_feed: Any, run_options: Any = None) -> Any:
        """``session.run``, counting each site's saturated pair sums on the way."""
        names = list(output_names) if output_names else [o.name for o in self._outputs]
        values = self.session.run(names + self.emulation.counters, input_feed, run_options)
        self._add(values[len(names):])
        return values[:len(names)]

    def count(self, input_feed: Any) -> None:
        """Run for the counters only."""
        self._add(self.session.run(self.emulation.counters, input_feed))

    def _add(self, extra: list[Any]) -> None:
        with self._lock:
            for i, count in enumerate(self.counts):
                count.saturated += float(extra[2 * i])
                count.computed += float(extra[2 * i + 1])

    def saturation(self) -> list[SaturationCount]:
        """The layers that saturated at least once, most saturated first."""
        return sorted((c for c in self.counts if c.saturated), key=lambda c: -c.fraction)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["session"], name)


class CountedSession:
    """A deployed session on an AVX2 host, with the emulation beside it run for its saturation counters only."""

    def __init__(self, session: Any, counting: EmulatedSession) -> None:
        self.session = session
        self.counting = counting

    def run(self, output_names: Any, input_feed: Any, run_options: Any = None) -> Any:
        """The deployed outputs; the emulation's counters accumulated."""
        self.counting.count(input_feed)
        return self.session.run(output_names, input_feed, run_options)

    def saturation(self) -> list[SaturationCount]:
        """As `EmulatedSession.saturation`."""
        return self.counting.saturation()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["session"], name)


def saturation_of(session: Any) -> list[SaturationCount]:
    """The saturation counts of a session `Kernels.session` made (empty for any other session)."""
    return session.saturation() if isinstance(session, (EmulatedSession, CountedSession)) else []


def emulation_notes(session: Any) -> list[str]:
    """`qgraph.runtime.kernels.emulate.Emulation.notes` of a session `Kernels.session` made (empty for any other
    session)."""
    if isinstance(session, CountedSession):
        session = session.counting
    return list(session.emulation.notes()) if isinstance(session, EmulatedSession) else []


@dataclass(frozen=True)
class Kernels:
    """How a model is run when qgraph measures it (see module docs)."""

    mode: Mode
    #: Whose integer arithmetic: the host's for ``deployed``, the emulated target's for ``emulated``.
    family: str
    host: HostKernels = field(compare=False)

    @property
    def emulates(self) -> bool:
        """True when models run through an emulation (asked for, or a declared host whose kernels differ)."""
        return self.mode == "emulated" or self.host.emulated

    def session(self, model: onnx.ModelProto | str | Path, *, weights: Mapping[str, np.ndarray] | None = None,
                mem_pattern: bool = True, threads: int = 1, count: bool = False) -> Any:
        """An onnxruntime CPU session that computes ``model`` with these kernels (``weights``: the values of a
        weightless model's placeholders, `qgraph.runtime.compare.make_session`). An emulated AVX2 session counts the
        pair
        sums that saturate (`saturation_of`); with ``count``, so does a deployed one on an AVX2 host (the
        emulation runs beside it for the counts only: twice the work)."""
        import onnxruntime as ort

        from qgraph.runtime.compare import make_session

        # where this runs may not be where the choice was made (a Ray worker on another machine): deployed
        # kernels are only this family's arithmetic on a host of that family
        here = host_kernels() if self.mode == "deployed" else self.host
        native = self.mode == "deployed" and not here.emulated and here.family == self.family
        if native or not _integer_work(model):  # a float model runs the same for every CPU
            if weights:  # integer kernels fuse only where the weights are initializers
                from qgraph.graph.detach import with_weights

                assert isinstance(model, onnx.ModelProto)
                model, weights = with_weights(model, weights), None
            real = make_session(model, optimization=ort.GraphOptimizationLevel.ORT_ENABLE_ALL, threads=threads,
                                mem_pattern=mem_pattern)
            if not (count and native and saturates(self.family) and _integer_work(model)):
                return real
            counting = emulated(self.family, here).session(model, mem_pattern=mem_pattern, threads=threads)
            return CountedSession(real, counting) if isinstance(counting, EmulatedSession) else real
        from .emulate import emulate

        proto = _load(model)
        if self.fused:  # onnxruntime fuses every layer the emulation leaves alone: weights must be initializers
            if weights:
                from qgraph.graph.detach import with_weights

                proto, weights = with_weights(proto, weights), None
            level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        else:
            level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        emulation = emulate(proto, self.family, host_saturates=here.probed_saturation, weights=weights,
                            requantize=self.fused)
        session = make_session(emulation.model, optimization=level, threads=threads, mem_pattern=mem_pattern,
                               weights=weights)
        return EmulatedSession(session, emulation) if emulation.sites or emulation.notes() else session

    @property
    def fused(self) -> bool:
        """Whether an emulation runs on this host's fused kernels, with only the layers whose arithmetic differs
        rewritten (`qgraph.runtime.kernels.requant`): every CPU family; not ``exact`` (Q/DQ in float, the
        arithmetic of no CPU in particular)."""
        return self.family != EXACT

    def label(self) -> str:
        """A few words: ``deployed kernels (x86-vnni)`` or ``x86-avx2 arithmetic, emulated``."""
        if self.mode == "deployed" and not self.host.emulated:
            return f"deployed kernels ({self.family}, this host)"
        if self.mode == "deployed":
            return f"this host's arithmetic ({self.family}), emulated"
        return f"{self.family} arithmetic, emulated"

    def describe(self) -> str:
        """One sentence: runtime, provider, optimization level and the arithmetic measured."""
        h = self.host
        if self.mode == "deployed" and not h.emulated:
            return f"deployed kernels: {h.runtime} {h.provider}, ORT_ENABLE_ALL, on this host {h.describe()}"
        why = " (this host as $QGRAPH_CPU_FLAGS declares it)" if self.mode == "deployed" else ""
        if not self.fused:
            return f"{self.family} arithmetic emulated{why}: {h.runtime} {h.provider}, ORT_DISABLE_ALL, Q/DQ in " \
                "float (exact int32)"
        head = (f"{self.family} arithmetic emulated{why}: {h.runtime} {h.provider}, ORT_ENABLE_ALL, this host's "
                "fused kernels")
        if not (saturates(self.family) or h.probed_saturation):
            return f"{head} (their integer arithmetic is the target's: no layer rewritten)"
        return (f"{head}, with every u8×s8 layer whose pair sums can leave int16 rewritten as the exact int32 sum"
                f"{' plus its int16 pair saturation' if saturates(self.family) else ''} and onnxruntime's "
                "requantization")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"mode": self.mode, "family": self.family, "emulated": self.emulates,
                "arithmetic": arithmetic(self.family),
                "optimization": "ORT_DISABLE_ALL" if self.emulates and not self.fused else "ORT_ENABLE_ALL",
                "runtime": self.host.runtime, "provider": self.host.provider,
                "host": self.host.to_dict(), "description": self.describe()}


def _integer_work(model: onnx.ModelProto | str | Path) -> bool:
    """Whether the model holds Q/DQ or integer ops (a path is read without its external data)."""
    from .emulate import has_integer_work

    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    return has_integer_work(proto)


def _load(model: onnx.ModelProto | str | Path) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    from qgraph.io.model_io import load_model

    return load_model(model)


@dataclass(frozen=True)
class KernelChoice:
    """The kernels that measure a model made for a target, and the second opinion when host and target differ."""

    kernels: Kernels
    #: The host's deployed kernels when ``kernels`` emulate a target this host is not (else None).
    other: Kernels | None = None
    #: One line saying the host is not the target, and what each set of numbers is.
    mismatch: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"kernels": self.kernels.to_dict(), "host_kernels": self.other.to_dict() if self.other else None,
                "mismatch": self.mismatch}


def deployed(host: HostKernels | None = None) -> Kernels:
    """This host's deployed kernels."""
    h = host or host_kernels()
    return Kernels("deployed", h.family, h)


def emulated(family: str, host: HostKernels | None = None) -> Kernels:
    """``family``'s arithmetic emulated on this host."""
    return Kernels("emulated", family, host or host_kernels())


def choose(target: str | None, option: str = "auto", host: HostKernels | None = None) -> KernelChoice:
    """The kernels for a model made for ``target`` (``x86-vnni``, ``x86-avx2``, ``arm``; None: this host;
    ``exact``: exact int32 arithmetic on any host, what a recipe that declares no CPU decides with) under
    ``--kernels option`` (see module docs)."""
    h = host or host_kernels()
    if target == EXACT:
        return KernelChoice(deployed(h) if option == "deployed" else emulated(EXACT, h))
    family = target if target in TARGET_FAMILIES else h.family
    if option == "deployed":
        return KernelChoice(deployed(h))
    if option == "emulated":
        return KernelChoice(emulated(family, h))
    if same_arithmetic(family, h.family):
        return KernelChoice(deployed(h))
    line = (f"this host is not the target: made for {family} ({arithmetic(family)}), this host is {h.describe()}; "
            f"numbers use {family} arithmetic, emulated, with this host's deployed kernels beside them")
    return KernelChoice(emulated(family, h), deployed(h), line)


def same_arithmetic(a: str, b: str) -> bool:
    """Whether two families compute u8×s8 products the same way (VNNI, ARM and others exactly; AVX2 not)."""
    return a == b or (not saturates(a) and not saturates(b) and "arm" not in (a, b))


#: Provenance key of the CPU family a model was made for (written by the pipeline; absent: no CPU declared).
TARGET_KEY = "qgraph.target_cpu"


def target_family(cpu: str | None, host: HostKernels | None = None) -> str | None:
    """The family a recipe's ``target.cpu`` names: itself, this host's for ``host`` (probe-corrected), None for
    ``any``."""
    if cpu in TARGET_FAMILIES:
        return cpu
    if cpu == "host":
        family = (host or host_kernels()).family
        return family if family in TARGET_FAMILIES else None
    return None


def model_target(model: onnx.ModelProto | str | Path) -> str | None:
    """The CPU family a model was made for, from its provenance (``qgraph.target_cpu``, else the recipe's
    ``target.cpu``); None for a model qgraph did not make or made for no CPU in particular."""
    if isinstance(model, onnx.ModelProto):
        props = model.metadata_props
    else:
        from qgraph.io.proto_stream import read_header

        props = read_header(model).metadata_props
    meta = {p.key: p.value for p in props}
    if TARGET_KEY in meta:
        return meta[TARGET_KEY] if meta[TARGET_KEY] in TARGET_FAMILIES else None
    recipe = meta.get("qgraph.recipe")
    if not recipe:
        return None
    from ruamel.yaml import YAML

    try:
        data = YAML(typ="safe").load(recipe)
    except Exception:  # provenance written by another tool: no claim
        return None
    cpu = (data.get("target") or {}).get("cpu") if isinstance(data, dict) else None
    return cpu if cpu in TARGET_FAMILIES else None
