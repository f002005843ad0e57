"""Calibration and evaluation data sources, validated against the model before any work.

Three forms, chosen by what the user gives:

- ``data.npz``: one array per graph input, axis 0 indexes samples. An array whose rank equals the input's rank
  is sliced ``arr[i:i+1]`` (axis 0 is the batch axis); one with an extra leading axis is sliced ``arr[i]``.
- ``folder/``: every ``*.npz`` (one array per input) or ``*.npy`` (single-input models) file is one sample,
  in file-name order, sliced the same way.
- ``package.module:function``: a Python callable returning an iterable of feed dicts. Preprocessing is the
  callable's job; qgraph does not guess.

Every source yields feed dicts ``{input_name: array}`` (one sample each, or the callable's own batches), can be
iterated more than once (histogram calibration reads the data twice) and is checked for names, dtypes, ranks,
static dimensions and non-finite values with a `DataError` that says which sample, which input, and the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qgraph.errors import DataError, QGraphError

Feed = dict[str, np.ndarray]


@dataclass(frozen=True)
class InputSpec:
    """A graph input as the data must match it: name, numpy dtype, shape (None/str for dynamic dims)."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int | str | None, ...]

    def describe(self) -> str:
        """``name: float32[N,3,224,224]``."""
        dims = ",".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name}: {self.dtype}[{dims}]"


def model_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    """The graph inputs that are fed at run time (initializers excluded)."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)) if tt.elem_type else np.dtype("f4")
        shape: tuple[int | str | None, ...] = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        )
        specs.append(InputSpec(vi.name, dtype, shape))
    return specs


class DataSource:
    """Base of the data sources: iterate feed dicts, validate against the model, fingerprint the content."""

    description: str = "data"

    def __init__(self, samples: int | None = None) -> None:
        self.samples = samples
        self.inputs: list[InputSpec] | None = None

    def bind(self, model: onnx.ModelProto) -> DataSource:
        """Validate against ``model``'s inputs (names, dtypes, ranks, static dims) and remember them."""
        self.inputs = model_inputs(model)
        self._validate_upfront()
        return self

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
            arr = feed[name]
            if not isinstance(arr, np.ndarray):
                raise DataError(f"{where}, input {name!r}: expected a numpy array, got {type(arr).__name__}.")
            if arr.dtype != spec.dtype:
                raise DataError(
                    f"{where}, input {name!r}: dtype {arr.dtype} but the model expects {spec.dtype}. "
                    f"Convert it (e.g. arr.astype(np.{spec.dtype})) when preparing the data."
                )
            if arr.ndim != len(spec.shape):
                raise DataError(
                    f"{where}, input {name!r}: shape {list(arr.shape)} has rank {arr.ndim} but the model "
                    f"expects {spec.describe()} (rank {len(spec.shape)})."
                )
            for axis, (got, want) in enumerate(zip(arr.shape, spec.shape, strict=True)):
                if isinstance(want, int) and want > 0 and got != want:
                    raise DataError(
                        f"{where}, input {name!r}: dimension {axis} is {got} but the model fixes it to {want} "
                        f"(shape {list(arr.shape)} vs {spec.describe()})."
                    )
            if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
                bad = "NaN" if np.isnan(arr).any() else "Inf"
                raise DataError(
                    f"{where}, input {name!r}: contains {bad}. Calibration data must be finite: fix the "
                    "preprocessing or drop the sample."
                )

    def _per_sample(self, arr: np.ndarray, name: str, i: int) -> np.ndarray:
        """Slice sample ``i`` from a stacked array, keeping the batch axis the model expects."""
        rank = self._rank(name)
        if rank is None or arr.ndim == rank:
            return np.asarray(arr[i : i + 1])
        if arr.ndim == rank + 1:
            return np.asarray(arr[i])
        raise DataError(
            f"{self.description}, input {name!r}: array of shape {list(arr.shape)} fits neither the input's "
            f"rank {rank} (axis 0 = batch) nor rank {rank + 1} (axis 0 = samples)."
        )

    def _rank(self, name: str) -> int | None:
        for s in self.inputs or []:
            if s.name == name:
                return len(s.shape)
        return None


class NpzSource(DataSource):
    """An ``.npz`` file with one array per graph input; axis 0 indexes samples."""

    def __init__(self, path: Path, samples: int | None = None) -> None:
        super().__init__(samples)
        self.path = path
        self.description = str(path)
        self.ignored: list[str] = []
        try:
            with np.load(path, allow_pickle=False) as npz:
                self.arrays = {k: npz[k] for k in npz.files}
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: cannot read as .npz ({exc}). Save it with numpy.savez.") from exc
        counts = {k: a.shape[0] if a.ndim else 0 for k, a in self.arrays.items()}
        if len(set(counts.values())) > 1:
            raise DataError(f"{path}: arrays disagree on the number of samples (axis 0): {counts}.")

    def __len__(self) -> int:
        n = next(iter(self.arrays.values())).shape[0] if self.arrays else 0
        return int(n if self.samples is None else min(n, self.samples))

    def _raw(self) -> Iterator[Feed]:
        n = next(iter(self.arrays.values())).shape[0] if self.arrays else 0
        for i in range(n):
            yield {k: np.ascontiguousarray(self._per_sample(a, k, i)) for k, a in self.arrays.items()}

    def _validate_upfront(self) -> None:
        # Extra arrays (labels, ids) are allowed beside a complete set of inputs; they are not fed.
        names = {s.name for s in self.inputs or []}
        if names and names <= set(self.arrays):
            self.ignored = sorted(set(self.arrays) - names)
            self.arrays = {k: v for k, v in self.arrays.items() if k in names}
        # Every sample is in memory already: check all of them now, before any work.
        for i, feed in enumerate(self._raw()):
            self._check_feed(feed, i)


class FolderSource(DataSource):
    """A folder of ``.npz``/``.npy`` files, one sample per file, in file-name order."""

    def __init__(self, path: Path, samples: int | None = None) -> None:
        super().__init__(samples)
        self.path = path
        self.description = str(path)
        self.files = sorted(p for p in path.iterdir() if p.suffix in (".npz", ".npy"))
        if not self.files:
            raise DataError(f"{path}: no .npz or .npy files in this folder.")

    def __len__(self) -> int:
        return len(self.files) if self.samples is None else min(len(self.files), self.samples)

    def _raw(self) -> Iterator[Feed]:
        for f in self.files:
            try:
                if f.suffix == ".npy":
                    names = [s.name for s in self.inputs or []]
                    if len(names) != 1:
                        raise DataError(
                            f"{f}: a .npy file holds one array but the model has {len(names)} inputs; "
                            "use .npz files with one array per input name."
                        )
                    arrays = {names[0]: np.load(f, allow_pickle=False)}
                else:
                    with np.load(f, allow_pickle=False) as npz:
                        arrays = {k: npz[k] for k in npz.files}
            except (OSError, ValueError) as exc:
                raise DataError(f"{f}: cannot read ({exc}).") from exc
            yield {k: self._one(a, k) for k, a in arrays.items()}

    def _one(self, arr: np.ndarray, name: str) -> np.ndarray:
        rank = self._rank(name)
        if rank is not None and arr.ndim == rank - 1:
            return np.asarray(arr[None])
        return arr


class CallableSource(DataSource):
    """``module:function`` returning an iterable of feed dicts; called again for each pass over the data."""

    def __init__(self, fn: Callable[[], Iterable[Feed]], description: str, samples: int | None = None) -> None:
        super().__init__(samples)
        self.fn = fn
        self.description = description

    def _raw(self) -> Iterator[Feed]:
        try:
            produced = self.fn()
        except Exception as exc:
            raise DataError(f"{self.description}: the data function raised {type(exc).__name__}: {exc}") from exc
        if isinstance(produced, dict):
            raise DataError(f"{self.description}: returned one dict; return an iterable (list/generator) of them.")
        yield from produced


def open_data_source(
    spec: str | Path | Callable[[], Iterable[Feed]] | DataSource,
    *,
    samples: int | None = None,
) -> DataSource:
    """Open ``spec`` as a `DataSource` (see module docs for the accepted forms)."""
    if isinstance(spec, DataSource):
        return spec
    if callable(spec):
        return CallableSource(spec, getattr(spec, "__qualname__", "callable"), samples)
    text = str(spec)
    path = Path(text)
    if path.exists():
        if path.is_dir():
            return FolderSource(path, samples)
        if path.suffix == ".npz":
            return NpzSource(path, samples)
        raise DataError(f"{path}: unsupported data file; give an .npz, a folder of .npz/.npy, or module:function.")
    if ":" in text and not text.endswith((".npz", ".npy")):
        return CallableSource(import_callable(text, DataError, "data source"), text, samples)
    raise DataError(f"data source {text!r} not found: give an existing .npz, a folder, or module:function.")


def import_callable(spec: str, error: type[QGraphError], what: str) -> Callable[..., Any]:
    """Import ``module:function`` (the current directory is importable); ``error`` names ``what`` failed."""
    module_name, _, func_name = spec.partition(":")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{what} {spec!r}: cannot import module {module_name!r} ({exc}).") from exc
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
