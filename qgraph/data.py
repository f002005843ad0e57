"""Calibration and evaluation data sources, validated against the model before any work.

Three forms, chosen by what the user gives:

- ``data.npz``: one array per graph input, axis 0 indexes samples (see "Layouts" below). Extra arrays (labels,
  ids) are allowed and not fed; they may have any sample count.
- ``folder/``: every ``*.npz`` (one array per input) or ``*.npy`` (single-input models) file is one sample,
  in file-name order; a sample may leave out the model's batch axis of size 1.
- ``package.module:function``: a Python callable returning an iterable of feed dicts. Preprocessing is the
  callable's job; qgraph does not guess.

Layouts (``--data-layout``), for an input of rank r and a stacked array of rank a (axis 0 = samples):

- ``samples``: sample i is ``arr[i]``; when it has rank r - 1 (the batch axis left out) an axis of size 1 is
  inserted where the model's batch axis is: the first axis whose size is symbolic or 1 (``state[2, batch, 128]``
  stored as ``(N, 2, 128)`` feeds ``(2, 1, 128)``; a scalar input stored as ``(N,)`` feeds 0-d values);
- ``batched``: the array's axis 0 is the model's batch axis: sample i is ``arr[i:i+1]`` (a == r);
- ``auto`` (default): ``samples`` when a == r + 1 or when axis 0 of the input is a fixed size other than 1;
  otherwise (a == r, axis 0 symbolic or 1) the two layouts feed the same arrays and ``batched`` is reported. A
  0-d array is one sample of a scalar input. Every choice that adds a batch axis is listed in the run summary.

Every source yields feed dicts ``{input_name: array}`` (one sample each, or the callable's own batches), can be
iterated more than once (histogram calibration reads the data twice) and is checked for names, dtypes, ranks,
static dimensions and non-finite values with a `DataError` that says which sample, which input, and the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

from qgraph.errors import DataError, QGraphError

Feed = dict[str, np.ndarray]
DataLayout = Literal["auto", "samples", "batched"]
#: Samples read when neither the recipe (``calibration.samples``) nor ``--samples`` says otherwise: enough for
#: stable ranges, and a bound on a ``module:function`` generator that never ends.
DEFAULT_MAX_SAMPLES = 1024


@dataclass(frozen=True)
class InputSpec:
    """A graph input as the data must match it: name, numpy dtype, shape (None/str for dynamic dims; the whole
    shape None when the model declares no shape at all)."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int | str | None, ...] | None
    #: Wrappers around the tensor, outermost first: () for a plain tensor, ("optional", "sequence") for
    #: ``optional(seq(tensor))``. dtype/shape describe the innermost tensor.
    containers: tuple[str, ...] = ()

    def describe(self) -> str:
        """``name: float32[N,3,224,224]`` (``[?...]`` when the rank is unknown)."""
        if self.shape is None:
            inner = f"{self.dtype}[shape not declared]"
        else:
            inner = f"{self.dtype}[{','.join('?' if d is None else str(d) for d in self.shape)}]"
        for wrapper in reversed(self.containers):
            inner = f"{wrapper}({inner})"
        return f"{self.name}: {inner}"

    def batch_axis(self) -> int | None:
        """Where a left-out batch axis goes: the first axis of symbolic size or size 1 (None if there is none)."""
        for axis, d in enumerate(self.shape or ()):
            if not isinstance(d, int) or d <= 1:
                return axis
        return None


def model_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    """The graph inputs that are fed at run time (initializers excluded)."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tp, containers = vi.type, []
        while tp.WhichOneof("value") in ("optional_type", "sequence_type"):
            kind = tp.WhichOneof("value")
            containers.append("optional" if kind == "optional_type" else "sequence")
            tp = tp.optional_type.elem_type if kind == "optional_type" else tp.sequence_type.elem_type
        tt = tp.tensor_type
        dtype = _np_dtype(tt.elem_type) if tt.elem_type else np.dtype("f4")
        shape: tuple[int | str | None, ...] | None = (
            tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
            if tt.HasField("shape") else None
        )
        specs.append(InputSpec(vi.name, dtype, shape, tuple(containers)))
    return specs


def _np_dtype(elem_type: int) -> np.dtype[Any]:
    if elem_type == onnx.TensorProto.BFLOAT16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)  # type: ignore[no-any-return]
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return np.dtype("f4")


@dataclass(frozen=True)
class LayoutChoice:
    """How one stacked array was read: the layout, and the axis where a left-out batch axis was inserted."""

    input: str
    array_shape: tuple[int, ...]
    layout: Literal["samples", "batched", "single"]
    inserted_axis: int | None = None

    def describe(self) -> str:
        """``state: (16, 2, 128) read as 16 samples, batch axis inserted at 1``."""
        n = self.array_shape[0] if self.array_shape else 1
        if self.layout == "single":
            return f"{self.input}: a 0-d array, read as one sample"
        if self.layout == "batched":
            return f"{self.input}: {self.array_shape} read as {n} batches of one (axis 0 = batch axis)"
        axis = self.inserted_axis
        extra = f", batch axis of size 1 inserted at axis {axis}" if axis is not None else ""
        return f"{self.input}: {self.array_shape} read as {n} samples{extra}"


class DataSource:
    """Base of the data sources: iterate feed dicts, validate against the model, fingerprint the content."""

    description: str = "data"

    def __init__(self, samples: int | None = None, layout: DataLayout = "auto") -> None:
        self.samples = samples
        self.layout: DataLayout = layout
        self.inputs: list[InputSpec] | None = None
        #: Layout decisions worth telling the user (filled by sources that stack samples).
        self.layouts: list[LayoutChoice] = []
        #: Set when the source had more samples than `samples` allowed (the summary says so).
        self.truncated = False

    def bind(self, model: onnx.ModelProto) -> DataSource:
        """Validate against ``model``'s inputs (names, dtypes, ranks, static dims) and remember them."""
        self.inputs = model_inputs(model)
        self._validate_upfront()
        return self

    def notes(self) -> list[str]:
        """What the run summary says about the data: layouts that added a batch axis, a sample cap that cut."""
        out = [c.describe() for c in self.layouts if c.layout != "samples" or c.inserted_axis is not None]
        if self.truncated:
            out.append(f"read the first {self.samples} samples of {self.description} (more were available; "
                       "raise calibration.samples or --samples to use them)")
        return out

    def _validate_upfront(self) -> None:
        for i, feed in enumerate(self._raw()):
            self._check_feed(feed, i)
            if i >= 0:  # the first sample proves names/dtypes/ranks; the rest are checked as they stream
                break

    def _raw(self) -> Iterator[Feed]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Feed]:
        for i, feed in enumerate(self._raw()):
            if self.samples is not None and i >= self.samples:
                self.truncated = True
                return
            self._check_feed(feed, i)
            yield feed

    def fingerprint(self) -> str:
        """sha256 over every sample's names, dtypes, shapes and bytes."""
        h = hashlib.sha256()
        for feed in self:
            for name in sorted(feed):
                arr = np.ascontiguousarray(feed[name])
                h.update(f"{name}:{arr.dtype}:{arr.shape};".encode())
                h.update(arr.tobytes())
        return h.hexdigest()

    def _check_feed(self, feed: Any, index: int) -> None:
        where = f"{self.description}, sample {index}"
        if not isinstance(feed, dict):
            raise DataError(f"{where}: expected a dict of input name -> array, got {type(feed).__name__}.")
        if self.inputs is None:
            return
        expected = {s.name: s for s in self.inputs}
        missing = sorted(set(expected) - set(feed))
        extra = sorted(set(feed) - set(expected))
        if missing or extra:
            raise DataError(
                f"{where}: input names do not match the model. Missing: {missing or 'none'}; unknown: "
                f"{extra or 'none'}. The model's inputs are: "
                f"{', '.join(s.describe() for s in self.inputs)}. Rename the arrays to the model's input names."
            )
        for name, spec in expected.items():
            if not spec.containers:  # sequences/optionals come from module:function as the user builds them
                _check_array(feed[name], spec, f"{where}, input {name!r}")

    def _per_sample(self, arr: np.ndarray, spec: InputSpec | None, i: int) -> np.ndarray:
        """Sample ``i`` of a stacked array, as the layout rule says (see the module docs)."""
        if arr.ndim == 0:
            return arr
        if spec is None or spec.shape is None:
            return np.asarray(arr[i : i + 1])
        layout = self._layout_of(arr, spec)
        if layout.layout == "batched":
            return np.asarray(arr[i : i + 1])
        sample = np.asarray(arr[i])
        return np.expand_dims(sample, layout.inserted_axis) if layout.inserted_axis is not None else sample

    def _layout_of(self, arr: np.ndarray, spec: InputSpec) -> LayoutChoice:
        for choice in self.layouts:
            if choice.input == spec.name:
                return choice
        choice = decide_layout(arr.shape, spec, self.layout, self.description)
        self.layouts.append(choice)
        return choice

    def _spec(self, name: str) -> InputSpec | None:
        for s in self.inputs or []:
            if s.name == name:
                return s
        return None


def decide_layout(shape: tuple[int, ...], spec: InputSpec, layout: DataLayout, where: str) -> LayoutChoice:
    """Apply the layout rule (module docs) to a stacked array of ``shape`` for ``spec``; `DataError` if none fits."""
    assert spec.shape is not None
    rank, a = len(spec.shape), len(shape)
    if a == 0:
        return LayoutChoice(spec.name, shape, "single")
    axis0 = spec.shape[0] if rank else None
    batch_ok = rank > 0 and (not isinstance(axis0, int) or axis0 <= 1)
    insert_at = spec.batch_axis()
    can_samples = a == rank + 1 or (a == rank and insert_at is not None)
    dims = ", ".join("?" if not isinstance(d, int) or d < 1 else str(d) for d in spec.shape)
    hint = f"Store it as (N{', ' if rank else ''}{dims}) with axis 0 indexing samples, or choose --data-layout."
    if layout == "batched" or (layout == "auto" and a == rank and batch_ok):
        if a == rank and batch_ok:
            return LayoutChoice(spec.name, shape, "batched")
        raise DataError(f"{where}, input {spec.name!r}: array of shape {list(shape)} cannot be read as batches of one "
                        f"for {spec.describe()} (needs the same rank and a symbolic or size-1 axis 0). {hint}")
    if can_samples:
        return LayoutChoice(spec.name, shape, "samples", None if a == rank + 1 else insert_at)
    raise DataError(f"{where}, input {spec.name!r}: array of shape {list(shape)} fits neither "
                    f"{spec.describe()} (rank {rank}) with axis 0 indexing samples, nor a sample without the batch "
                    f"axis. {hint}")


def _check_array(arr: Any, spec: InputSpec, where: str) -> None:
    if not isinstance(arr, np.ndarray):
        raise DataError(f"{where}: expected a numpy array, got {type(arr).__name__}.")
    if arr.dtype != spec.dtype:
        fix = f"arr.astype(np.{spec.dtype})" if spec.dtype.kind in "biuf" and spec.dtype.isbuiltin else \
            f"arr.astype({spec.dtype})"
        raise DataError(f"{where}: dtype {arr.dtype} but the model expects {spec.dtype}. Convert it (e.g. {fix}) "
                        "when preparing the data.")
    if spec.shape is not None:
        if arr.ndim != len(spec.shape):
            raise DataError(f"{where}: shape {list(arr.shape)} has rank {arr.ndim} but the model expects "
                            f"{spec.describe()} (rank {len(spec.shape)}).")
        for axis, (got, want) in enumerate(zip(arr.shape, spec.shape, strict=True)):
            if isinstance(want, int) and want > 0 and got != want:
                raise DataError(f"{where}: dimension {axis} is {got} but the model fixes it to {want} "
                                f"(shape {list(arr.shape)} vs {spec.describe()}).")
    if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
        bad = "NaN" if np.isnan(arr).any() else "Inf"
        raise DataError(f"{where}: contains {bad}. Calibration data must be finite: fix the preprocessing or drop "
                        "the sample.")


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an .npz, with a message that names the file and the problem (never numpy's pickle advice)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            if not isinstance(npz, np.lib.npyio.NpzFile):
                raise DataError(f"{path}: is a single .npy array, not an .npz archive. Save it with numpy.savez.")
            arrays = {}
            for key in npz.files:
                value = npz[key]
                if not isinstance(value, np.ndarray):  # numpy hands non-.npy members back as raw bytes
                    raise DataError(f"{path}: member {key!r} is not a .npy array; an .npz holds one array per "
                                    "model input (numpy.savez writes it).")
                arrays[key] = value
            return arrays
    except DataError:
        raise
    except ValueError as exc:
        if "pickle" in str(exc).lower():
            raise DataError(f"{path}: holds Python objects (pickled arrays); qgraph never loads pickles. Save "
                            "numeric arrays with numpy.savez.") from None
        raise DataError(f"{path}: not a readable .npz archive of .npy arrays ({exc}). Save it with numpy.savez."
                        ) from None
    except Exception as exc:  # BadZipFile, EOFError, KeyError, OSError: a damaged or foreign file
        raise DataError(f"{path}: not a readable .npz archive of .npy arrays ({type(exc).__name__}: {exc}). "
                        "Save it with numpy.savez.") from None


class NpzSource(DataSource):
    """An ``.npz`` file with one array per graph input; axis 0 indexes samples."""

    def __init__(self, path: Path, samples: int | None = None, layout: DataLayout = "auto") -> None:
        super().__init__(samples, layout)
        self.path = path
        self.description = str(path)
        self.ignored: list[str] = []
        self.arrays = _load_npz(path)
        if not self.arrays:
            raise DataError(f"{path}: the archive holds no arrays; it needs one array per model input.")

    def __len__(self) -> int:
        n = self._count()
        return int(n if self.samples is None else min(n, self.samples))

    def _count(self) -> int:
        counts = {k: (a.shape[0] if a.ndim else 1) for k, a in self.arrays.items()}
        if len(set(counts.values())) > 1:
            raise DataError(f"{self.path}: the model's input arrays disagree on the number of samples (axis 0): "
                            f"{counts}. Give every input the same number of samples.")
        return next(iter(counts.values()), 0)

    def _raw(self) -> Iterator[Feed]:
        for i in range(self._count()):
            yield {k: np.asarray(self._per_sample(a, self._spec(k), i), order="C") for k, a in self.arrays.items()}

    def _validate_upfront(self) -> None:
        # Extra arrays (labels, ids) are allowed beside a complete set of inputs; they are not fed.
        names = {s.name for s in self.inputs or []}
        if names and names <= set(self.arrays):
            self.ignored = sorted(set(self.arrays) - names)
            self.arrays = {k: v for k, v in self.arrays.items() if k in names}
        if self._count() == 0:
            raise DataError(f"{self.path}: the arrays hold 0 samples (axis 0 has size 0). Give at least one sample.")
        # Every sample is in memory already: check all of them now, before any work.
        for i, feed in enumerate(self._raw()):
            self._check_feed(feed, i)


class FolderSource(DataSource):
    """A folder of ``.npz``/``.npy`` files, one sample per file, in file-name order."""

    def __init__(self, path: Path, samples: int | None = None, layout: DataLayout = "auto") -> None:
        super().__init__(samples, layout)
        self.path = path
        self.description = str(path)
        self.files = sorted(p for p in path.iterdir() if p.suffix in (".npz", ".npy"))
        if not self.files:
            raise DataError(f"{path}: no .npz or .npy files in this folder.")

    def __len__(self) -> int:
        return len(self.files) if self.samples is None else min(len(self.files), self.samples)

    def _raw(self) -> Iterator[Feed]:
        for f in self.files:
            if f.suffix == ".npy":
                names = [s.name for s in self.inputs or []]
                if len(names) != 1:
                    raise DataError(f"{f}: a .npy file holds one array but the model has {len(names)} inputs; use "
                                    ".npz files with one array per input name.")
                try:
                    arrays = {names[0]: np.load(f, allow_pickle=False)}
                except Exception as exc:
                    raise DataError(f"{f}: not a readable .npy array ({type(exc).__name__}: {exc}).") from None
            else:
                arrays = _load_npz(f)
            yield {k: self._one(a, k) for k, a in arrays.items()}

    def _one(self, arr: np.ndarray, name: str) -> np.ndarray:
        spec = self._spec(name)
        if spec is not None and spec.shape is not None and arr.ndim == len(spec.shape) - 1:
            axis = spec.batch_axis()
            if axis is not None:
                return np.expand_dims(arr, axis)
        return arr


class CallableSource(DataSource):
    """``module:function`` returning an iterable of feed dicts; called again for each pass over the data."""

    def __init__(self, fn: Callable[[], Iterable[Feed]], description: str, samples: int | None = None) -> None:
        # A generator may never end: without an explicit cap, read at most DEFAULT_MAX_SAMPLES (and say so).
        super().__init__(samples if samples is not None else DEFAULT_MAX_SAMPLES)
        self.fn = fn
        self.description = description

    def _raw(self) -> Iterator[Feed]:
        with _user_code(self.description, "the data function"):
            produced = self.fn()
        if isinstance(produced, dict):
            raise DataError(f"{self.description}: returned one dict; return an iterable (list/generator) of them.")
        if produced is None or not isinstance(produced, Iterable):
            raise DataError(f"{self.description}: returned {type(produced).__name__}, not an iterable of feed "
                            "dicts. Return a list of {input_name: array} dicts or yield them.")
        iterator = iter(produced)
        index = 0
        while True:
            with _user_code(self.description, f"the data generator (after {index} samples)"):
                try:
                    feed = next(iterator)
                except StopIteration:
                    return
            yield feed
            index += 1


@contextlib.contextmanager
def _user_code(where: str, what: str) -> Iterator[None]:
    """Turn anything a user's data code raises (SystemExit included) into a `DataError` naming it."""
    try:
        yield
    except QGraphError:
        raise
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except SystemExit as exc:
        raise DataError(f"{where}: {what} called sys.exit({exc.code!r}). Data code must return or yield feeds."
                        ) from None
    except Exception as exc:
        raise DataError(f"{where}: {what} raised {type(exc).__name__}: {exc}") from exc


def open_data_source(
    spec: str | Path | Callable[[], Iterable[Feed]] | DataSource,
    *,
    samples: int | None = None,
    layout: DataLayout = "auto",
) -> DataSource:
    """Open ``spec`` as a `DataSource` (see module docs for the accepted forms)."""
    if isinstance(spec, DataSource):
        return spec
    if callable(spec):
        return CallableSource(spec, getattr(spec, "__qualname__", "callable"), samples)
    text = str(spec)
    if not text.strip():
        raise DataError("the data source is an empty string: give an .npz file, a folder, or module:function.")
    path = Path(text)
    if path.exists():
        if path.is_dir():
            return FolderSource(path, samples, layout)
        if path.suffix == ".npz":
            return NpzSource(path, samples, layout)
        raise DataError(f"{path}: unsupported data file; give an .npz, a folder of .npz/.npy, or module:function.")
    if ":" in text and not text.endswith((".npz", ".npy")):
        return CallableSource(import_callable(text, DataError, "data source"), text, samples)
    raise DataError(f"data source {text!r} not found: give an existing .npz, a folder, or module:function.")


def import_callable(spec: str, error: type[QGraphError], what: str) -> Callable[..., Any]:
    """Import ``module:function`` (the current directory is importable); ``error`` names ``what`` failed."""
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise error(f"{what} {spec!r}: give it as package.module:function (both parts).")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{what} {spec!r}: cannot import module {module_name!r} ({exc}).") from None
    except SyntaxError as exc:
        raise error(f"{what} {spec!r}: cannot import module {module_name!r}: syntax error at "
                    f"{exc.filename}:{exc.lineno}: {exc.msg}.") from None
    except SystemExit as exc:
        raise error(f"{what} {spec!r}: importing {module_name!r} called sys.exit({exc.code!r}).") from None
    except Exception as exc:
        raise error(f"{what} {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise error(f"{what} {spec!r}: {module_name} has no callable {func_name!r}.")
    return fn  # type: ignore[no-any-return]


class Batches:
    """Consecutive feeds concatenated along axis 0 into batches of ``batch_size`` (the last may be smaller).

    Iterable once per ``iter()`` over ``feeds``; has a length when ``feeds`` has one (progress bars with ETA).
    """

    def __init__(self, feeds: Iterable[Feed], batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.feeds, self.batch_size = feeds, batch_size

    def __len__(self) -> int:
        if not isinstance(self.feeds, Sized):
            raise TypeError("the underlying feeds have no length")
        return -(-len(self.feeds) // self.batch_size)

    def __iter__(self) -> Iterator[Feed]:
        pending: list[Feed] = []
        for feed in self.feeds:
            pending.append(feed)
            if len(pending) == self.batch_size:
                yield _concat(pending)
                pending = []
        if pending:
            yield _concat(pending)


def batched(feeds: Iterable[Feed], batch_size: int) -> Iterable[Feed]:
    """:class:`Batches` of ``feeds``: sized when ``feeds`` is, a plain generator otherwise."""
    batches = Batches(feeds, batch_size)
    return batches if isinstance(feeds, Sized) else iter(batches)


def _concat(feeds: list[Feed]) -> Feed:
    if len(feeds) == 1:
        return feeds[0]
    return {k: np.concatenate([f[k] for f in feeds], axis=0) for k in feeds[0]}
