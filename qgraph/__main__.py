"""``python -m qgraph``: the same as the ``qgraph`` command, exit code included."""

import sys

from qgraph.cli import main

if __name__ == "__main__":
    sys.exit(main())
