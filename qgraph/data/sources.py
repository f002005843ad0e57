"""The data sources: an .npz, a folder of .npz/.npy files, a ``module:function``, or in memory (a list of feed dicts,
a dict of arrays stacked on axis 0, a function); validated before any work."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qgraph.errors import DataError
from qgraph.io.inputs import array_file_problem, input_file_problem

from .inputs import (
    DEFAULT_MAX_SAMPLES,
    DataLayout,
    Feed,
    InputSpec,
    LayoutChoice,
    check_array,
    decide_layout,
    model_inputs,
)
from .user_code import import_callable, user_code


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
        #: Samples the source holds whatever the cap, when known without reading them (None: a data function).
        self.available: int | None = None

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
                check_array(feed[name], spec, f"{where}, input {name!r}")

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


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an .npz, with a message that names the file and the problem (never numpy's pickle advice)."""
    problem = array_file_problem(path, ".npz")
    if problem is not None:
        raise DataError(f"{path}: {problem}.")
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

    def __init__(self, path: Path | None, samples: int | None = None, layout: DataLayout = "auto",
                 arrays: Mapping[Any, Any] | None = None) -> None:
        super().__init__(samples, layout)
        self.path = path  # None: ``arrays`` held in memory (`in_memory`)
        self.ignored: list[str] = []
        if path is not None:
            self.description = str(path)
            self.arrays = _load_npz(path)
        else:
            given = dict(arrays or {})
            self.description = f"arrays in memory ({', '.join(map(str, list(given)[:4]))})"
            bad = [k for k in given if not isinstance(k, str)]
            if bad:
                raise DataError(f"calibration arrays in memory: key {bad[0]!r} is not an input name; give "
                                "{input_name: array stacked on axis 0}.")
            self.arrays = {k: np.asarray(v) for k, v in given.items()}
        if not self.arrays:
            what = "the archive holds no arrays; it needs" if path is not None else "the mapping is empty; give"
            raise DataError(f"{self.description}: {what} one array per model input.")

    @classmethod
    def in_memory(cls, arrays: Mapping[Any, Any], samples: int | None = None,
                  layout: DataLayout = "auto") -> NpzSource:
        """The same source over ``{input name: array}`` held in memory (axis 0 indexes samples, as in an .npz)."""
        return cls(None, samples, layout, arrays)

    def __len__(self) -> int:
        n = self._count()
        return int(n if self.samples is None else min(n, self.samples))

    def _count(self) -> int:
        counts = {k: (a.shape[0] if a.ndim else 1) for k, a in self.arrays.items()}
        if len(set(counts.values())) > 1:
            raise DataError(f"{self.description}: the model's input arrays disagree on the number of samples (axis 0): "
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
        self.available = self._count()
        if self.available == 0:
            raise DataError(f"{self.description}: the arrays hold 0 samples (axis 0 has size 0). "
                            "Give at least one sample.")
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
        self.available = len(self.files)

    def __len__(self) -> int:
        return len(self.files) if self.samples is None else min(len(self.files), self.samples)

    def _raw(self) -> Iterator[Feed]:
        for f in self.files:
            if f.suffix == ".npy":
                names = [s.name for s in self.inputs or []]
                if len(names) != 1:
                    raise DataError(f"{f}: a .npy file holds one array but the model has {len(names)} inputs; use "
                                    ".npz files with one array per input name.")
                problem = array_file_problem(f, ".npy")
                if problem is not None:
                    raise DataError(f"{f}: {problem}.")
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
        with user_code(self.description, "the data function"):
            produced = self.fn()
        if isinstance(produced, dict):
            raise DataError(f"{self.description}: returned one dict; return an iterable (list/generator) of them.")
        if produced is None or not isinstance(produced, Iterable):
            raise DataError(f"{self.description}: returned {type(produced).__name__}, not an iterable of feed "
                            "dicts. Return a list of {input_name: array} dicts or yield them.")
        iterator = iter(produced)
        index = 0
        while True:
            with user_code(self.description, f"the data generator (after {index} samples)"):
                try:
                    feed = next(iterator)
                except StopIteration:
                    return
            yield feed
            index += 1


class FeedList(CallableSource):
    """A list of feed dicts held in memory: every sample is checked before any work, as an .npz's are."""

    def __init__(self, feeds: list[Feed], samples: int | None = None) -> None:
        super().__init__(lambda: feeds, f"{len(feeds)} feed dict(s) in memory", samples)
        self.samples = samples  # every sample, as from an .npz (no generator's default cap)
        self.available = len(feeds)
        self.feeds = feeds

    def __len__(self) -> int:
        return len(self.feeds) if self.samples is None else min(len(self.feeds), self.samples)

    def _validate_upfront(self) -> None:
        for i, feed in enumerate(self._raw()):
            self._check_feed(feed, i)


class FixedInputs(DataSource):
    """``source`` with the inputs a pass fixed to constants (``specialize_inputs``) taken out of every sample.

    A sample whose value of a fixed input differs from the fixed value does not belong to the specialized model:
    it is an error naming the sample, never silently calibrated."""

    def __init__(self, source: DataSource, fixed: dict[str, np.ndarray]) -> None:
        super().__init__(source.samples, source.layout)
        self.source, self.fixed = source, fixed
        self.description = source.description
        # The wrapped source checks samples against the model it was bound to (the one that still takes the fixed
        # inputs); this one checks what it yields only once bound to the specialized model.
        self.inputs = None
        self.layouts = source.layouts

    def _raw(self) -> Iterator[Feed]:
        for i, feed in enumerate(self.source):
            for name, value in self.fixed.items():
                got = feed.get(name)
                if got is not None and not np.array_equal(np.asarray(got).reshape(-1)[:1], value.reshape(-1)[:1]):
                    raise DataError(f"{self.description}, sample {i}: input {name} is {np.asarray(got).tolist()!r} "
                                    f"but the recipe fixed it to {value.tolist()!r} (specialize_inputs); give data "
                                    "for that value only.")
            yield {k: v for k, v in feed.items() if k not in self.fixed}

    def notes(self) -> list[str]:
        """The wrapped source's notes plus the inputs taken out."""
        return [*self.source.notes(), f"inputs fixed by the recipe and dropped from the data: {sorted(self.fixed)}"]


class _SizedFixedInputs(FixedInputs):
    """`FixedInputs` over a source that knows its length."""

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]


def without_fixed_inputs(source: DataSource, fixed: dict[str, np.ndarray]) -> FixedInputs:
    """``source`` without the inputs in ``fixed`` (sized when ``source`` is)."""
    cls = _SizedFixedInputs if hasattr(source, "__len__") else FixedInputs
    return cls(source, fixed)


#: What a data argument may be: a path (.npz, folder), ``module:function``, a function returning feed dicts, a
#: `DataSource`, a list of feed dicts, or ``{input name: array}`` stacked on axis 0.
DataSpec = str | Path | Callable[[], Iterable[Feed]] | DataSource | Sequence[Feed] | Mapping[str, Any]


def open_data_source(
    spec: DataSpec,
    *,
    samples: int | None = None,
    layout: DataLayout = "auto",
) -> DataSource:
    """Open ``spec`` as a `DataSource` (see module docs for the accepted forms)."""
    if isinstance(spec, DataSource):
        return spec
    if callable(spec):
        return CallableSource(spec, getattr(spec, "__qualname__", "callable"), samples)
    if isinstance(spec, Mapping):
        return NpzSource.in_memory(spec, samples, layout)
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        return FeedList(list(spec), samples)
    if not isinstance(spec, (str, Path)):
        once = " (an iterator is read once; passes read the data several times)" if isinstance(spec, Iterator) else ""
        raise DataError(f"calibration data of type {type(spec).__name__}{once}: give an .npz path, a folder, "
                        "module:function, a list of {input_name: array} dicts, a dict of arrays stacked on axis 0, "
                        "or a function returning an iterable of feed dicts.")
    text = str(spec)
    if not text.strip():
        raise DataError("the data source is an empty string: give an .npz file, a folder, or module:function.")
    path = Path(text)
    problem = input_file_problem(path)
    if problem is not None:
        raise DataError(f"data {path}: {problem}.")
    if path.exists():
        if path.is_dir():
            return FolderSource(path, samples, layout)
        if path.suffix == ".npz":
            return NpzSource(path, samples, layout)
        raise DataError(f"{path}: unsupported data file; give an .npz, a folder of .npz/.npy, or module:function.")
    if ":" in text and not text.endswith((".npz", ".npy")):
        return CallableSource(import_callable(text, DataError, "data source"), text, samples)
    raise DataError(f"data source {text!r} not found: give an existing .npz, a folder, or module:function.")
