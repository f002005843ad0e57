"""``python -m qgraph``: the same as the ``qgraph`` command."""

from qgraph.cli import main

if __name__ == "__main__":
    main()
