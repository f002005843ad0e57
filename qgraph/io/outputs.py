"""Every file qgraph writes goes through here: one guard for output paths, one atomic writer.

The promise to users: no file but the output they named is ever touched, and an output is either the complete
new file or the old one, never a partial file. So:

- `check_output` runs before any long work: it refuses an empty path, a directory, a device or any other
  non-regular file (``-o /dev/null`` must never be replaced by a regular file), an output that is (by inode,
  through symlinks and hard links) any file an input reads: the input itself, a model's external-data files,
  every file below a data folder (`files_read`), and a folder that cannot be written;
- `write_atomic` writes to a temporary file in the target's folder and renames it into place; the temporary file
  is created with the usual permissions (the umask applies, as for any file the user writes) and removed on any
  failure, including SIGINT and SIGTERM (the CLI turns SIGTERM into `Terminated`).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

from qgraph.errors import OutputError, WriteError

PathLike = str | os.PathLike[str]


#: Bytes of the output's name kept in its temporary file's name (the rest: prefix, pid, random part, suffix).
_TEMP_NAME_BYTES = 120


class Terminated(BaseException):
    """Raised in the main thread when the process receives SIGTERM, so cleanups run as for Ctrl-C."""


def check_output(path: PathLike | None, *, inputs: Iterable[PathLike | None] = (), option: str = "-o",
                 model: bool = False) -> Path:
    """Validate an output path before any work; returns it as a `Path`.

    Raises `OutputError` (exit 2) naming ``option`` when the path is empty, is a directory or another
    non-regular file, is any file one of ``inputs`` reads (`files_read`: a model's external data, a data folder's
    files; compared by inode), or lives in a folder that cannot be created or written. ``model``: the output is a
    model, which may be written with its weights in ``<name>.data`` beside it: that file is checked too.
    """
    if path is None or not str(path).strip():
        raise OutputError(f"{option}: the output path is empty; give a file name such as model.int8.onnx.")
    if str(path) == ".":  # what an empty argument becomes once parsed as a path
        raise OutputError(f"{option} .: the output path is empty or a directory; give a file name such as "
                          "model.int8.onnx.")
    target = Path(path)
    _check_name_lengths(target, option)
    if target.exists() or target.is_symlink():
        if target.is_dir():
            raise OutputError(f"{option} {target}: is a directory; give a file path inside it.")
        if not target.is_file():
            raise OutputError(
                f"{option} {target}: is not a regular file (a device, pipe or socket); qgraph writes outputs "
                "atomically by renaming a new file into place and will not replace it. Give a file path."
            )
    _refuse_inputs(target, [i for i in inputs if i is not None and str(i)], option, model)
    folder = _folder(target)
    probe_folder = folder
    while not probe_folder.exists():  # the folder will be created: its nearest existing parent must be writable
        probe_folder = probe_folder.parent
    if not probe_folder.is_dir():
        raise OutputError(f"{option} {target}: {probe_folder} is not a directory.")
    if not os.access(probe_folder, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {target}: the folder {probe_folder} is not writable (permission denied or a "
                          "read-only file system). Choose a writable location.")
    return target


def check_outputs(outputs: dict[str, PathLike | None], inputs: Iterable[PathLike | None],
                  models: Iterable[str] = ()) -> None:
    """`check_output` for several outputs of one command (option -> path); outputs may not collide either.
    ``models``: the options whose output is a model (see ``model`` in `check_output`)."""
    ins = [i for i in inputs if i is not None and str(i)]
    model_options = set(models)
    seen: dict[Path, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        target = check_output(path, inputs=ins, option=option, model=option in model_options)
        key = _resolve(target)
        if key in seen:
            raise OutputError(f"{option} {target}: is also the path given to {seen[key]}; give distinct outputs.")
        seen[key] = option


def _check_name_lengths(target: Path, option: str) -> None:
    """`OutputError` for a name or path the file system refuses (``File name too long``), found before any work;
    the temporary names `temporary_file` uses are kept short whatever the output's name."""
    folder = _folder(target)
    probe = folder
    while not os.path.isdir(probe) and probe != probe.parent:  # isdir: False, never an error, on a long path
        probe = probe.parent
    try:
        name_max = os.pathconf(probe, "PC_NAME_MAX")
        path_max = os.pathconf(probe, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    # (a model over 2 GB also writes <name>.data: that name's length is the writer's to report, as it is rare)
    length = len(os.fsencode(target.name))
    if length > name_max:
        raise OutputError(f"{option} {str(target)[:80]}...: the file name is {length} bytes; this file system "
                          f"allows {name_max}. Give a shorter name.")
    full = len(os.fsencode(os.path.abspath(target)))
    if full >= path_max:
        raise OutputError(f"{option} {str(target)[:80]}...: the path is {full} bytes; this system allows "
                          f"{path_max - 1}. Give a shorter path.")


def files_read(given: PathLike) -> Iterator[Path]:
    """Every file reading the input ``given`` touches: the path itself; for a folder (of data files), every file
    below it; for an ONNX model, each external-data file it names (read from the graph without the weights)."""
    path = Path(given)
    yield path
    if path.is_dir():
        for n, sub in enumerate(path.rglob("*")):
            if n > _MAX_FOLDER_FILES:  # a data folder this large is not a data folder: the files compared so far
                return
            yield sub
    elif _may_be_model(path):
        for location in _external_locations(path):
            yield path.parent / location


#: Files of an input folder compared with an output (a bound, so a path such as ``/`` as data cannot stall).
_MAX_FOLDER_FILES = 100_000
#: Suffixes of the inputs that are never ONNX models (recipes, data, code): not parsed for external data.
_NOT_MODELS = (".yaml", ".yml", ".npz", ".npy", ".py", ".json", ".txt", ".csv")


def _may_be_model(path: Path) -> bool:
    try:
        return path.suffix.lower() not in _NOT_MODELS and path.is_file()
    except OSError:
        return False


def _external_locations(path: Path) -> list[str]:
    """The external-data locations of a model file; none when it is not a readable model (its loader says why)."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # not ONNX, truncated, unreadable: the command's own loading reports it
        return []
    return sorted({e.value for t in _get_all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL
                   for e in t.external_data if e.key == "location" and e.value})


def _refuse_inputs(target: Path, inputs: list[PathLike], option: str, model: bool) -> None:
    """`OutputError` when writing ``target`` (and, for a model, ``<target>.data``) would replace a file an input
    reads. Only an output that exists can be an input's file, so inputs are expanded only then."""
    written = [target, target.with_name(target.name + ".data")] if model else [target]
    existing = [w for w in written if w.exists() or w.is_symlink()]
    for given in inputs:
        if _resolve(target) == _resolve(Path(given)):
            raise OutputError(f"{option} {target}: is also an input of this command ({given}); writing it would "
                              "destroy the input. Choose another output path.")
        if not existing:
            continue
        for read in files_read(given):
            for w in existing:
                if _resolve(w) == _resolve(read) or _same_file(w, read):
                    what = "" if read == Path(given) else f", which reads {read}"
                    also = "" if w == target else f" (the model's weights would go to {w})"
                    raise OutputError(
                        f"{option} {target}: writing it{also} would overwrite a file an input of this command reads "
                        f"({given}{what}); the input would be destroyed. Choose another output path.")


def write_atomic(path: PathLike, content: str | bytes | Callable[[IO[bytes]], None]) -> Path:
    """Write ``content`` (text, bytes, or a function writing to a binary file) to ``path`` atomically."""
    target = Path(path)
    folder = _folder(target)
    _make_folder(folder, target)
    if target.exists() and not target.is_file():
        raise OutputError(f"{target}: is not a regular file; qgraph will not replace it.")
    with temporary_file(folder, target.name) as tmp:
        try:
            with open(tmp, "wb") as f:
                if isinstance(content, str):
                    f.write(content.encode("utf-8"))
                elif isinstance(content, bytes):
                    f.write(content)
                else:
                    content(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError as exc:
            raise WriteError(f"cannot write {target}: {exc.strerror or exc}. Nothing was written.") from exc
    return target


@contextlib.contextmanager
def temporary_file(folder: Path, name: str) -> Iterator[Path]:
    """A fresh hidden path in ``folder`` (created empty with the umask's permissions), removed on exit unless
    it was renamed away."""
    short = os.fsencode(name)[:_TEMP_NAME_BYTES].decode("utf-8", "ignore")  # any output name leaves room for the rest
    tmp = folder / f".qgraph-{short}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise WriteError(f"cannot write in {folder}: {exc.strerror or exc}. Nothing was written.") from exc
    os.close(fd)
    try:
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _make_folder(folder: Path, target: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WriteError(f"cannot create the folder of {target}: {exc.strerror or exc}.") from exc


def _folder(target: Path) -> Path:
    return target.parent if str(target.parent) else Path(".")


def _resolve(p: Path) -> Path:
    try:
        return p.resolve()
    except (OSError, RuntimeError):  # a symlink loop: compare as written
        return p.absolute()


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False
