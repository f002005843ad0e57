"""Fixtures for the diff tests: real light topologies materialized once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import pytest

from qgraph.testing.models import cached_light_model


@pytest.fixture(scope="session")
def light_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], onnx.ModelProto]:
    """``light_model(name)``: the materialized light model ``name`` (built once per session, then loaded)."""
    folder: Path = tmp_path_factory.mktemp("light")

    def get(name: str) -> onnx.ModelProto:
        return onnx.load(str(cached_light_model(name, folder)))

    return get
