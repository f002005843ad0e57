"""Fixtures of the hostile-input suite; the harness itself is `hostile_support`."""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile_support import Workspace  # type: ignore[import-not-found]


@pytest.fixture
def ws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Workspace:
    """A fresh workspace with model.onnx, prep.yaml, int8.yaml and data.npz."""
    return Workspace(tmp_path, capsys)
