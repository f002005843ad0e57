"""qgraph: declarative ONNX graph transformations from a float model to a deployable INT8 model.

Public API (what passes, plug-ins and scripts import)::

    from qgraph import Pipeline, Recipe, Pass, PassConfig, PassResult, PassContext, GraphHandle, register
    from qgraph import PassDetails                         # a pass's typed details (a frozen dataclass)
    from qgraph import NodeSelector, select, load_model, save_model
    from qgraph import OutputParts, find_output_parts      # outputs a final Concat joins, scored part by part
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from qgraph._version import __version__
from qgraph.errors import DataError, ModelError, PassError, QGraphError, RecipeError, VerificationError

if TYPE_CHECKING:
    from qgraph.graph import GraphHandle, GraphIndex
    from qgraph.graph.selectors import NodeSelector, Selection, SubgraphRange, select, selected_ids
    from qgraph.io.model_io import load_model, save_model
    from qgraph.options import PassConfig
    from qgraph.pipeline.pass_api import Pass, PassContext, PassResult, Skipped, get_pass, register
    from qgraph.pipeline.pass_details import PassDetails
    from qgraph.pipeline.recipe import Recipe
    from qgraph.pipeline.runner import Pipeline, PipelineEvent, PipelineResult
    from qgraph.runtime.output_parts import OutputPart, OutputParts, find_output_parts

# Imported on first use (PEP 562): `qgraph --help` and usage errors must not pay for onnx, onnxruntime, networkx
# and pydantic (about 0.5 s here), and every command imports what it needs itself.
_LAZY: dict[str, str] = {
    "GraphHandle": "qgraph.graph",
    "GraphIndex": "qgraph.graph",
    "NodeSelector": "qgraph.graph.selectors",
    "OutputPart": "qgraph.runtime.output_parts",
    "OutputParts": "qgraph.runtime.output_parts",
    "Pass": "qgraph.pipeline.pass_api",
    "PassConfig": "qgraph.options",
    "PassContext": "qgraph.pipeline.pass_api",
    "PassDetails": "qgraph.pipeline.pass_details",
    "PassResult": "qgraph.pipeline.pass_api",
    "Pipeline": "qgraph.pipeline.runner",
    "PipelineEvent": "qgraph.pipeline.runner",
    "PipelineResult": "qgraph.pipeline.runner",
    "Recipe": "qgraph.pipeline.recipe",
    "Selection": "qgraph.graph.selectors",
    "Skipped": "qgraph.pipeline.pass_api",
    "SubgraphRange": "qgraph.graph.selectors",
    "find_output_parts": "qgraph.runtime.output_parts",
    "get_pass": "qgraph.pipeline.pass_api",
    "load_model": "qgraph.io.model_io",
    "register": "qgraph.pipeline.pass_api",
    "save_model": "qgraph.io.model_io",
    "select": "qgraph.graph.selectors",
    "selected_ids": "qgraph.graph.selectors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qgraph' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "DataError",
    "GraphHandle",
    "GraphIndex",
    "ModelError",
    "NodeSelector",
    "OutputPart",
    "OutputParts",
    "Pass",
    "PassConfig",
    "PassContext",
    "PassDetails",
    "PassError",
    "PassResult",
    "Pipeline",
    "PipelineEvent",
    "PipelineResult",
    "QGraphError",
    "Recipe",
    "RecipeError",
    "Selection",
    "Skipped",
    "SubgraphRange",
    "VerificationError",
    "__version__",
    "find_output_parts",
    "get_pass",
    "load_model",
    "register",
    "save_model",
    "select",
    "selected_ids",
]
