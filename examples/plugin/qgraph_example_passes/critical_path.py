"""``critical_path``: the longest chain of dependent nodes, from the networkx view (an analysis; changes nothing)."""

from __future__ import annotations

from collections import Counter

import networkx
from pydantic import Field

from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassResult


class CriticalPathConfig(PassConfig):
    """Options of `CriticalPath`."""

    show: int = Field(default=10, ge=0, description="How many node names of the path to list in the details.")


class CriticalPath(Pass[CriticalPathConfig]):
    """Report the longest dependency chain of the top graph: its length, its op mix and its first nodes (a
    graph whose latency cannot shrink below this many sequential kernels)."""

    name = "critical_path"
    config_class = CriticalPathConfig
    preserves_float = True

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        """Analyse ``graph.nx`` (built once, O(N)); the result's details carry the path."""
        nodes = graph.index.nodes
        path = networkx.dag_longest_path(graph.nx) if len(nodes) else []
        names = [nodes[i].name for i in path]
        res = PassResult(matched=len(path))
        res.details = {
            "length": len(path),
            "nodes": len(nodes),
            "ops": dict(Counter(nodes[i].op for i in path).most_common()),
            "path": names[: self.config.show],
        }
        ops = ", ".join(f"{op} x{n}" for op, n in Counter(nodes[i].op for i in path).most_common(3))
        # a decision, so the run summary shows it: notes and details go to the report only
        res.decide(f"critical path: {len(path)} of {len(nodes)} nodes run one after another ({ops}; starts at "
                   f"{names[0] if names else '-'})")
        return res
