"""The qgraph version (its own module, so engine modules can import it without importing the package)."""

__version__ = "0.1.0"
