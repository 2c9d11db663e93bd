"""`python -m tokenmill` runs the command line."""

import sys

from tokenmill.cli import main

sys.exit(main())
