"""A pass from a third-party package, found through the `qgraph.passes` entry-point group."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx

from qgraph import Recipe, pass_api
from qgraph.compare import make_session, run

PLUGIN = '''
import onnx_graphsurgeon as gs
from qgraph import GraphHandle, Pass, PassConfig, PassContext, PassResult


class NegToMulConfig(PassConfig):
    """Options."""

    factor: float = -1.0


class NegToMul(Pass[NegToMulConfig]):
    """Rewrite Neg(x) as Mul(x, factor)."""

    name = "plugin_neg_to_mul"
    config_class = NegToMulConfig

    def run(self, graph: GraphHandle, ctx: PassContext) -> PassResult:
        import numpy as np
        res = PassResult()
        for node in graph.graph.nodes:
            if node.op == "Neg":
                k = gs.Constant(node.name + "/k", np.array(self.config.factor, np.float32))
                node.op = "Mul"
                node.inputs.append(k)
                res.matched += 1
                res.rewritten += 1
        return res
'''


def test_entry_point_plugin_is_usable_from_yaml(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    site = tmp_path / "site"
    (site / "qgraph_plugin_demo").mkdir(parents=True)
    (site / "qgraph_plugin_demo" / "__init__.py").write_text(PLUGIN)
    dist = site / "qgraph_plugin_demo-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: qgraph-plugin-demo\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[qgraph.passes]\nplugin_neg_to_mul = qgraph_plugin_demo:NegToMul\n"
    )
    monkeypatch.syspath_prepend(str(site))
    try:
        assert "plugin_neg_to_mul" in pass_api.rediscover()
        recipe = Recipe.from_text("name: plug\npasses:\n  - pass: plugin_neg_to_mul\n    factor: -1.0\n")
        model = onnx.parser.parse_model(
            '<ir_version: 8, opset_import: ["" : 17]> g (float[3] x) => (float[3] y) { y = Neg(x) }'
        )
        result = recipe.pipeline().run(model, verify=True)
        assert [n.op_type for n in result.model.graph.node] == ["Mul"]
        x = np.array([1.0, -2.0, 3.5], np.float32)
        np.testing.assert_array_equal(run(make_session(result.model), {"x": x})["y"], -x)
    finally:
        pass_api._REGISTRY.pop("plugin_neg_to_mul", None)
        sys.modules.pop("qgraph_plugin_demo", None)
