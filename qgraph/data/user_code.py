"""User code qgraph calls (a data function, a metric): imported by ``module:function`` or ``file.py:function``, and
every failure, ``sys.exit`` included, turned into a typed error naming it."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qgraph.errors import DataError, QGraphError


@contextlib.contextmanager
def user_code(where: str, what: str, error: type[QGraphError] = DataError,
              should: str = "Data code must return or yield feeds.") -> Iterator[None]:
    """Turn anything a user's code (a data function, a metric) raises, SystemExit included, into ``error``
    naming it: ``sys.exit(0)`` in a metric must not end the command with exit 0 and no verdict."""
    try:
        yield
    except QGraphError:
        raise
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except SystemExit as exc:
        raise error(f"{where}: {what} called sys.exit({exc.code!r}). {should}") from None
    except Exception as exc:
        raise error(f"{where}: {what} raised {type(exc).__name__}: {exc}. {should}") from exc


def _load_file(path_text: str) -> Any:
    """Import a Python file as a module (its folder importable, so it can import its neighbours)."""
    path = Path(path_text).resolve()
    if not path.is_file():
        raise ImportError(f"no such file: {path_text}")
    name = "qgraph_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path_text}")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_callable(spec: str, error: type[QGraphError], what: str) -> Callable[..., Any]:
    """Import ``module:function`` or ``path/to/file.py:function`` (the current directory is importable);
    ``error`` names ``what`` failed."""
    module_name, _, func_name = spec.rpartition(":") if spec.count(":") > 1 else spec.partition(":")
    if not module_name or not func_name:
        raise error(f"{what} {spec!r}: give it as package.module:function or path/to/file.py:function.")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = _load_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
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
