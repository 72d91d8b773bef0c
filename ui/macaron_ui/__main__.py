"""`python -m macaron_ui` opens the chat app."""

import sys

from macaron_ui.main import main

sys.exit(main())
