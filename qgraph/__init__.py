"""qgraph: declarative ONNX graph transformations from a float model to a deployable INT8 model.

Public API (what passes, plug-ins and scripts import)::

    from qgraph import Pipeline, Recipe, Pass, PassConfig, PassResult, PassContext, GraphHandle, register
    from qgraph import PassDetails                         # a pass's typed details (a frozen dataclass)
    from qgraph import NodeSelector, select, load_model, save_model
    from qgraph import OutputParts, find_output_parts      # outputs a final Concat joins, scored part by part
"""

from qgraph._version import __version__
from qgraph.errors import DataError, ModelError, PassError, QGraphError, RecipeError, VerificationError
from qgraph.graph import GraphHandle, GraphIndex
from qgraph.graph.selectors import NodeSelector, Selection, SubgraphRange, select, selected_ids
from qgraph.io.model_io import load_model, save_model
from qgraph.options import PassConfig
from qgraph.pipeline.pass_api import Pass, PassContext, PassResult, Skipped, get_pass, register
from qgraph.pipeline.pass_details import PassDetails
from qgraph.pipeline.recipe import Recipe
from qgraph.pipeline.runner import Pipeline, PipelineEvent, PipelineResult
from qgraph.runtime.output_parts import OutputPart, OutputParts, find_output_parts

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
