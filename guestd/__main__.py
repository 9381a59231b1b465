import gc
import sys

# No garbage collection while start-up imports and builds: what it makes lives as long as guestd,
# and serve() freezes it and turns collection back on. The collections were ~5% of the
# instructions from spawn to listening (start to first reply).
gc.disable()

from guestd.server.daemon import main  # noqa: E402

sys.exit(main())
