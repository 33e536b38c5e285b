"""`python -m moemesh ...` is the `moemesh` command."""

import sys

from moemesh.cli import main

sys.exit(main())
