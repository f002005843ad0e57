"""Every file qgraph writes goes through here: one guard for output paths, one atomic writer.

The promise to users: no file but the output they named is ever touched, and an output is either the complete
new file or the old one, never a partial file. So:

- `check_output` runs before any long work: it refuses an empty path, a directory, a device or any other
  non-regular file (``-o /dev/null`` must never be replaced by a regular file), an output that resolves (through
  symlinks and hard links) to one of the command's inputs, and a folder that cannot be written;
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


class Terminated(BaseException):
    """Raised in the main thread when the process receives SIGTERM, so cleanups run as for Ctrl-C."""


def check_output(path: PathLike | None, *, inputs: Iterable[PathLike | None] = (), option: str = "-o") -> Path:
    """Validate an output path before any work; returns it as a `Path`.

    Raises `OutputError` (exit 2) naming ``option`` when the path is empty, is a directory or another
    non-regular file, is one of ``inputs`` (resolved through symlinks; external data files included by the
    caller), or lives in a folder that cannot be created or written.
    """
    if path is None or not str(path).strip():
        raise OutputError(f"{option}: the output path is empty; give a file name such as model.int8.onnx.")
    if str(path) == ".":  # what an empty argument becomes once parsed as a path
        raise OutputError(f"{option} .: the output path is empty or a directory; give a file name such as "
                          "model.int8.onnx.")
    target = Path(path)
    if target.exists() or target.is_symlink():
        if target.is_dir():
            raise OutputError(f"{option} {target}: is a directory; give a file path inside it.")
        if not target.is_file():
            raise OutputError(
                f"{option} {target}: is not a regular file (a device, pipe or socket); qgraph writes outputs "
                "atomically by renaming a new file into place and will not replace it. Give a file path."
            )
    resolved = _resolve(target)
    for given in inputs:
        if given is None or not str(given):
            continue
        if resolved == _resolve(Path(given)) or _same_file(target, Path(given)):
            raise OutputError(
                f"{option} {target}: is also an input of this command ({given}); writing it would destroy the "
                "input. Choose another output path."
            )
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


def check_outputs(outputs: dict[str, PathLike | None], inputs: Iterable[PathLike | None]) -> None:
    """`check_output` for several outputs of one command (option -> path); outputs may not collide either."""
    ins = [i for i in inputs if i is not None and str(i)]
    seen: dict[Path, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        target = check_output(path, inputs=ins, option=option)
        key = _resolve(target)
        if key in seen:
            raise OutputError(f"{option} {target}: is also the path given to {seen[key]}; give distinct outputs.")
        seen[key] = option


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
    tmp = folder / f".qgraph-{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
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
