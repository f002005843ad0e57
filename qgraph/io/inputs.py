"""What qgraph reads: regular files only, and never more bytes than a limit.

A named pipe (FIFO) given as a recipe, model or data file blocks the read forever; a character device (``/dev/zero``
or a copy of its node) reports size 0 and yields bytes without end, so a size cap on ``st_size`` never triggers. Every
input file goes through `input_file_problem` before it is opened, and small text inputs are read with
`read_bounded`, which counts the bytes actually read.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

PathLike = str | os.PathLike[str]


def input_file_problem(path: PathLike) -> str | None:
    """Why ``path`` cannot be read as an input file (a symlink loop, a broken symlink, a FIFO, a device, a socket),
    as the end of a sentence starting with the path; None for a regular file, a folder or a missing path (the
    caller says "not found" in its own words)."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symlink loop (the link points back to itself); point it at the real file"
        if p.is_symlink():
            return f"is a broken symlink (to {os.readlink(p)}, which does not exist)"
        if exc.errno == errno.ENAMETOOLONG:
            return "is a path too long for the file system"
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISFIFO(mode):
        kind = "a named pipe (FIFO)"
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        kind = "a device"
    elif stat.S_ISSOCK(mode):
        kind = "a socket"
    else:
        kind = "not a regular file"
    return (f"is {kind}, not a regular file: qgraph reads inputs from regular files only (a pipe can block forever, "
            "a device never ends); save the content to a file and give that")


def read_bounded(path: PathLike, limit: int) -> bytes | None:
    """The bytes of ``path`` when there are at most ``limit`` of them, else None; counts what is actually read
    (never trusts ``st_size``)."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data if len(data) <= limit else None


#: The first bytes of the array files numpy writes: ``.npy`` and ``.npz`` (a zip archive; empty or not).
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")


def array_file_problem(path: PathLike, kind: str) -> str | None:
    """Why ``path`` is not an array file of ``kind`` (``.npz`` or ``.npy``) as numpy writes them: not a regular file,
    or content of another kind (text named ``.npz`` is not "pickled arrays"); None when its first bytes fit."""
    problem = input_file_problem(path)
    if problem is not None:
        return problem
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(_NPY_MAGIC):
        return None if kind == ".npy" else "is a single .npy array, not an .npz archive; save it with numpy.savez"
    if head.startswith(_ZIP_MAGIC):
        return None if kind == ".npz" else "is an .npz archive, not a .npy array; save it with numpy.save"
    what = "empty" if not head else "text" if all(32 <= b < 127 or b in b"\t\r\n" for b in head) else "something else"
    writer = "numpy.savez" if kind == ".npz" else "numpy.save"
    return f"is not a {kind} file (its content is {what}); save the arrays with {writer}"
