"""``python -m eva0_edge``: the ``eva0-edge`` command."""

import sys

from eva0_edge.cli import main

sys.exit(main())
