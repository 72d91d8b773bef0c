"""`python -m macaron_local` runs the `macaron` command."""

import sys

from macaron_local.cli import main

sys.exit(main())
