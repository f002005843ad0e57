"""Maps the repository layout onto the installed package: `qgraph/` → `qgraph`, `passes/` → `qgraph.passes`."""

from setuptools import find_packages, setup

packages = ["qgraph", *(f"qgraph.{p}" for p in find_packages("qgraph"))]
packages += ["qgraph.passes", *(f"qgraph.passes.{p}" for p in find_packages("passes"))]
package_dir = {"qgraph": "qgraph", "qgraph.passes": "passes"}

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"qgraph": ["py.typed"], "qgraph.runtime": ["latency_table.json"]},
)
