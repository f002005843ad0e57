"""The real-weight corpus (benchmarks/real_models.py) as a fixture: loaded by path, caching into a temp folder."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def rm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """benchmarks/real_models.py loaded by path, caching into a per-module temp folder."""
    mp = pytest.MonkeyPatch()
    mp.setenv("QGRAPH_BENCH_CACHE", str(tmp_path_factory.mktemp("bench-cache")))
    spec = importlib.util.spec_from_file_location("real_models", BENCH / "real_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_models"] = module
    spec.loader.exec_module(module)
    yield module
    mp.undo()
