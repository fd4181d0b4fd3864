"""``python -m cockpit``: the command line."""

import sys

from cockpit.cli import main

sys.exit(main())
