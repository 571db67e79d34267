"""`python -m djax ...` runs the command line."""

import sys

from djax.cli import main

sys.exit(main())
