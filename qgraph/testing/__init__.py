"""Test and benchmark support: the shared model corpus (see :mod:`qgraph.testing.models`, which lists it)."""

from __future__ import annotations

from qgraph.testing.models import *  # noqa: F403  (the public names are models.__all__)
from qgraph.testing.models import __all__ as __all__
