"""``python -m sim``: see sim.cli."""

import sys

from .cli import main

sys.exit(main())
