"""The public pass API: what a pass is, what it returns, and how it is found.

A pass is a small class::

    class FuseBatchNormConfig(PassConfig):
        include_matmul: bool = True

    @register
    class FuseBatchNorm(Pass[FuseBatchNormConfig]):
        '''Fold inference BatchNormalization into the preceding Conv/Gemm.'''
        name = "fuse_batchnorm"
        config_class = FuseBatchNormConfig
        preserves_float = True

        def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult: ...

Its registered ``name`` is its recipe key; its config class is its schema. Built-in passes and third-party
passes are discovered the same way, through the ``qgraph.passes`` entry-point group.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np
import onnx

from qgraph.errors import RecipeError
from qgraph.graph import GraphHandle
from qgraph.options import PassConfig
from qgraph.pipeline.pass_result import NestedRun
from qgraph.pipeline.pass_result import PassResult as PassResult  # re-exported: the pass API's return type
from qgraph.pipeline.pass_result import Skipped as Skipped
from qgraph.pipeline.target import CalibrationSpec, TargetSpec

if TYPE_CHECKING:
    from qgraph.data import DataSource
    from qgraph.runtime.kernels.measure import KernelChoice, Kernels

ENTRY_POINT_GROUP = "qgraph.passes"


class PassContext:
    """Services a running pipeline offers to passes: calibration data, target, shared caches."""

    def __init__(
        self,
        *,
        calibration_data: DataSource | None = None,
        target: TargetSpec | None = None,
        calibration: CalibrationSpec | None = None,
        options: dict[str, Any] | None = None,
        input_model: onnx.ModelProto | None = None,
        on_progress: Callable[[str, int, int | None], None] | None = None,
        kernels: str = "auto",
        made_for: str | None = None,
    ) -> None:
        self.calibration_data = calibration_data
        #: How accuracy is measured during the run (`qgraph.runtime.kernels.measure`): auto, deployed or emulated.
        self.kernels_option = kernels
        self.made_for = made_for  # the CPU family the model is made for without a target.cpu (`Pass.made_for_cpu`)
        self._kernel_choice: KernelChoice | None = None
        self._on_progress = on_progress
        #: The pipeline's input model as loaded (read-only: the float reference for accuracy-driven passes).
        self.input_model = input_model
        #: What the recipe declares about the deployment target (runtime, opset, CPU).
        self.target: TargetSpec = target or TargetSpec()
        #: The recipe's calibration settings (samples, batch size, a ranges file to reuse).
        self.calibration: CalibrationSpec = calibration or CalibrationSpec()
        self.options: dict[str, Any] = dict(options or {})
        #: Free-form cache passes may share (e.g. calibration results keyed by graph fingerprint).
        self.cache: dict[str, Any] = {}
        self._float_reference: onnx.ModelProto | None = None
        self._float_weights: dict[str, np.ndarray] = {}
        self._reference_graph: tuple[weakref.ref[GraphHandle], int] | None = None  # exported from, at version
        #: The passes run inside the current pass through `run_pass`, in order (the pipeline moves them into the
        #: pass's record after it ends).
        self.nested: list[NestedRun] = []
        #: The recipe pass being run ("pass #3 'insert_qdq'"), for messages about the passes it runs inside itself.
        self.running: str | None = None

    def run_pass(self, p: Pass[Any], graph: GraphHandle) -> PassResult:
        """Run pass ``p`` on ``graph`` from inside another pass, held to the contract the pipeline holds every pass
        to (`qgraph.pipeline.contract`: ``requires``, a `PassResult`, a checked graph, ``ensures``; a crash names
        both passes) and recorded in `nested`. Nodes it creates belong to the calling pass (its provenance tag)."""
        if _NESTED_RUNNER is None:  # pragma: no cover - the contract module installs it when qgraph loads
            raise RuntimeError("qgraph.pipeline.contract is not loaded")
        start = time.perf_counter()
        with self.float_preserving(graph) if p.preserves_float else contextlib.nullcontext():
            result = _NESTED_RUNNER(p, graph, self)
        self.nested.append(NestedRun(p.name, p.config.recipe_options(), result, time.perf_counter() - start))
        return result

    @property
    def kernel_choice(self) -> KernelChoice:
        """The kernels this run measures accuracy with (`qgraph.runtime.kernels.measure.choose`): the host's deployed
        kernels when it is the recipe's ``target.cpu``, else the target's arithmetic emulated; a recipe that
        declares no CPU decides with exact int32 arithmetic (the same on every host)."""
        if self._kernel_choice is None:
            from qgraph.runtime.kernels.measure import EXACT, choose, target_family

            family = target_family(self.target.cpu) or self.made_for
            self._kernel_choice = choose(family or EXACT, self.kernels_option)
        return self._kernel_choice

    @property
    def kernels(self) -> Kernels:
        """``kernel_choice.kernels``."""
        return self.kernel_choice.kernels

    @property
    def float_reference(self) -> onnx.ModelProto | None:
        """The model as it was right before the first pass that changes float results (``preserves_float =
        False``, e.g. ``insert_qdq``; not one that only changes the interface, ``keeps_float_values``) ran: float
        weights and activations after every float-preserving rewrite (folded BatchNorms, lowered opsets, fixed
        inputs), so its tensors carry the names the quantized graph still uses.

        Read-only. The pipeline exports it once, and only when a pass of the recipe declares
        ``needs_float_reference = True``; None otherwise (and when no float-changing pass ran before the asking
        pass: the reference is then the model that pass received).

        The pipeline exports it weightless (`qgraph.GraphHandle.weightless_export`): its large initializers are
        placeholders whose values are `float_reference_weights` (the arrays the graph owned then, shared, not
        copied); `qgraph.graph.with_weights` makes a self-contained copy when one is needed."""
        return self._float_reference

    @property
    def float_reference_weights(self) -> dict[str, np.ndarray]:
        """Values of the float reference's weightless placeholders by name (empty for a self-contained one)."""
        return self._float_weights

    def set_float_reference(self, model: onnx.ModelProto | None, weights: dict[str, np.ndarray] | None = None,
                            graph: GraphHandle | None = None) -> None:
        """Record the float reference and, for a weightless one, its placeholders' values (the pipeline does
        this; tests and scripts running passes by hand may); ``graph``: the graph it was exported from, now
        (`is_float_reference`).

        The values are the graph's own arrays (no copy): they are made read-only here, so a later pass that
        writes into a weight in place raises instead of silently changing the reference; passes replace arrays
        (`qgraph.graph.set_const`, `renew_const`)."""
        self._float_reference = model
        self._float_weights = dict(weights or {})
        for value in self._float_weights.values():
            value.setflags(write=False)
        self._reference_graph = (weakref.ref(graph), graph.version) if graph is not None and model is not None else None

    @contextlib.contextmanager
    def float_preserving(self, graph: GraphHandle) -> Iterator[None]:
        """Around an edit that keeps every float value (a topological sort, a raised opset): a graph that was the
        float reference before it still is after (`is_float_reference`)."""
        was_reference = self.is_float_reference(graph)
        yield
        if was_reference:
            self._reference_graph = (weakref.ref(graph), graph.version)

    def is_float_reference(self, graph: GraphHandle) -> bool:
        """Whether ``graph`` still is the float reference: the graph it was exported from, not changed since
        (`GraphHandle.version`) but by float-preserving passes run through `run_pass` (``insert_qdq`` raising the
        opset) or edits inside `float_preserving`. What a pass measures by running it then is what the reference
        gives (up to onnxruntime's graph optimizations), so it may keep it for later passes
        (`qgraph.recovery.reference_outputs`)."""
        if self._reference_graph is None:
            return False
        ref, version = self._reference_graph
        return ref() is graph and graph.version == version

    def fix_inputs(self, values: dict[str, np.ndarray]) -> None:
        """Tell the pipeline that graph inputs became constants (``specialize_inputs``): from now on, calibration
        samples come without them (a sample with another value for them is an error)."""
        from qgraph.data import without_fixed_inputs

        if self.calibration_data is not None and values:
            self.calibration_data = without_fixed_inputs(self.calibration_data, dict(values))

    @property
    def target_opset(self) -> int | None:
        """The opset the recipe's target asks for (None: keep the model's)."""
        return self.target.opset

    @property
    def target_runtime(self) -> str:
        """The runtime the recipe's target names."""
        return self.target.runtime

    def progress(self, task: str) -> Callable[[int, int | None], None] | None:
        """A ``(done, total or None)`` callback reporting the progress of a long step (``task`` names it,
        e.g. ``"calibrating"``) to whoever runs the pipeline; None when nobody listens."""
        report = self._on_progress
        if report is None:
            return None
        return lambda done, total: report(task, done, total)


C = TypeVar("C", bound=PassConfig)

#: How `PassContext.run_pass` runs a pass: installed by `qgraph.pipeline.contract` when it loads (the contract sits
#: above this module, which it imports), so a nested pass meets the same checks as a recipe's.
_NESTED_RUNNER: Callable[[Pass[Any], GraphHandle, PassContext], PassResult] | None = None


def install_nested_runner(runner: Callable[[Pass[Any], GraphHandle, PassContext], PassResult]) -> None:
    """Set what `PassContext.run_pass` calls (done once, by `qgraph.pipeline.contract`)."""
    global _NESTED_RUNNER
    _NESTED_RUNNER = runner


class Pass(Generic[C]):
    """Base class of every pass. Subclasses set ``name``, ``config_class`` and implement `run`."""

    name: ClassVar[str]
    config_class: ClassVar[type[PassConfig]]
    #: True when the pass keeps the model's float results (checked numerically with ``--verify``).
    preserves_float: ClassVar[bool] = True
    #: Whether the pipeline pauses the cyclic GC while the pass runs (right for graph rewriting; a pass that builds
    #: many temporary models or sessions, like a sensitivity search, sets False so their garbage is collected).
    pause_gc: ClassVar[bool] = True
    #: Whether the pass reads `PassContext.float_reference` (weight correction after quantization): the pipeline
    #: then keeps a copy of the model as it was before the first float-changing pass.
    needs_float_reference: ClassVar[bool] = False
    #: For a pass with ``preserves_float = False`` that computes the same float values for the inputs it keeps
    #: and changes only the interface (``specialize_inputs`` fixes an input: ``--verify`` cannot feed both models
    #: alike, yet no value changes): the float reference is taken after it, so it has the names and inputs of the
    #: graph that later passes quantize.
    keeps_float_values: ClassVar[bool] = False
    #: True for a pass that decides which nodes run in integer (inserts Q/DQ or takes them out: insert_qdq,
    #: float_fallback): its skip reasons answer "why is this node not integer" before any other pass's, whose
    #: skips are about their own technique (equalization, bias correction).
    quantizes: ClassVar[bool] = False
    #: True for a pass that adds graph inputs or outputs: the option values of later passes naming one
    #: (`qgraph.graph.names`) are then only warned about before the run, not refused (`qgraph.pipeline.preflight`).
    adds_graph_io: ClassVar[bool] = False

    def __init__(self, config: C | None = None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError("pass either a config object or keyword options, not both")
        if config is None:
            from pydantic import ValidationError

            try:
                config = self.config_class(**options)  # type: ignore[assignment]
            except ValidationError as exc:
                from qgraph.options import validation_problems

                raise RecipeError(f"{self.name}: invalid options: {validation_problems(exc)}") from None
        elif not isinstance(config, self.config_class):
            raise TypeError(f"{self.name} expects a {self.config_class.__name__}, got {type(config).__name__}")
        self.config: C = config  # type: ignore[assignment]

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Transform ``graph`` in place and report what changed."""
        raise NotImplementedError

    def requires(self, graph: GraphHandle, ctx: PassContext) -> None:
        """Preconditions, checked right before `run` (raise `PassError` naming what is missing and how to fix it;
        nothing may be changed here)."""

    def option_issues(self, model: onnx.ModelProto) -> list[tuple[tuple[int | str, ...], str]]:
        """Option values that cannot work on the input ``model`` (a value that does not fit an input's dtype), as
        (option path in the config, message) pairs. The pipeline asks every pass before the first one runs and
        reports them as recipe errors located at the option in the recipe file (`qgraph.pipeline.preflight`)."""
        return []

    def missing_data(self, calibration: CalibrationSpec) -> str | None:
        """Why this pass, as configured, cannot run without calibration data (None: it can). The pipeline asks
        every pass before the first one runs when no data was given, so a missing ``--calibration-data`` fails in
        a second (`DataError`) instead of after the passes before this one; `requires` still checks it."""
        return None

    def streams_file(self) -> bool:
        """Whether this pass, as configured, can transform a model *file* one initializer at a time (`run_file`):
        ``qgraph run`` then streams a recipe made of this pass alone over a model whose weights live in external
        data, never holding them all (weight-only quantization of a model larger than memory)."""
        return False

    def run_file(self, src: Path, dst: Path) -> PassResult:
        """Transform the model file ``src`` into ``dst`` (external data beside it) without loading its weights;
        only called when `streams_file` is True."""
        raise NotImplementedError(f"{self.name} does not stream files")

    def ensures(self, graph: GraphHandle, ctx: PassContext, result: PassResult) -> None:
        """Postconditions, checked after `run` and the pipeline's own structural check (raise `PassError`)."""

    def made_for_cpu(self) -> str | None:
        """The CPU family this pass makes the model for when the recipe declares none (a quantizer's CPU preset),
        recorded as ``qgraph.target_cpu`` and measured with (`qgraph.runtime.kernels`); None: no particular CPU."""
        return None

    @classmethod
    def help_text(cls) -> str:
        """What `qgraph passes NAME` shows above the options: the docstring (paragraphs separated by blank lines).
        Passes with named presets or modes override this to explain them."""
        return inspect.cleandoc(cls.__doc__ or "")

    @classmethod
    def summary(cls) -> str:
        """The first sentence of the pass's docstring, on one line (the pass catalogue's summary)."""
        from qgraph.text import first_sentence

        return first_sentence(cls.__doc__ or "")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


PassClass = type[Pass[Any]]
_REGISTRY: dict[str, PassClass] = {}
_DISCOVERED = False


def register(cls: PassClass) -> PassClass:
    """Class decorator: make ``cls`` available under ``cls.name`` (used by entry points and tests)."""
    if not getattr(cls, "name", None) or not getattr(cls, "config_class", None):
        raise TypeError(f"{cls.__name__} must define `name` and `config_class`")
    existing = _REGISTRY.get(cls.name)
    if existing is not None and existing is not cls and existing.__qualname__ != cls.__qualname__:
        raise TypeError(f"pass name {cls.name!r} is already registered by {existing.__module__}")
    _REGISTRY[cls.name] = cls
    return cls


def discover() -> dict[str, PassClass]:
    """Load every pass advertised in the ``qgraph.passes`` entry-point group (built-ins included)."""
    global _DISCOVERED
    if not _DISCOVERED:
        _DISCOVERED = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            problem = _load_plugin(ep.name, ep.load)
            if problem is not None:  # a broken or mis-declared plug-in is left out; every other pass still works
                warnings.warn(f"qgraph: pass plug-in {ep.name!r} ({ep.value}) is excluded: {problem}", stacklevel=2)
    return dict(sorted(_REGISTRY.items()))


def _load_plugin(name: str, load: Callable[[], Any]) -> str | None:
    """Register the pass an entry point names; the reason it cannot be, or None."""
    try:
        obj = load()
    except Exception as exc:
        return f"it fails to import ({type(exc).__name__}: {exc})"
    if not (isinstance(obj, type) and issubclass(obj, Pass)):
        return f"it names {obj!r}, not a qgraph.Pass subclass"
    if getattr(obj, "name", None) != name:
        return f"the entry point is called {name!r} but the pass's name is {getattr(obj, 'name', None)!r}"
    config = getattr(obj, "config_class", None)
    if not (isinstance(config, type) and issubclass(config, PassConfig)):
        return "its config_class is not a qgraph.PassConfig subclass"
    try:
        register(obj)
    except TypeError as exc:
        return str(exc)
    return None


def rediscover() -> dict[str, PassClass]:
    """Forget cached discovery and scan entry points again (after installing a plug-in at run time)."""
    global _DISCOVERED
    _DISCOVERED = False
    return discover()


def get_pass(name: str) -> PassClass:
    """The pass class registered as ``name``; `RecipeError` with the closest names otherwise."""
    passes = discover()
    if name in passes:
        return passes[name]
    close = difflib.get_close_matches(name, list(passes), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise RecipeError(f"unknown pass {name!r}.{hint} Known passes: {', '.join(passes)}.")


ProgressCallback = Callable[[int, int | None], None]
