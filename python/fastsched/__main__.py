"""``python -m fastsched``: the ``fastsched`` command."""

import sys

from fastsched.entrypoints.cli import main

sys.exit(main())
