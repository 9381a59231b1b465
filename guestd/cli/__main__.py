"""``python -m guestd.cli``: guestctl without the console script (the baked image uses it)."""

import sys

from guestd.cli import main

sys.exit(main())
