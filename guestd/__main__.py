"""``python -m guestd`` and the ``guestd`` console script (pyproject's ``guestd.__main__:main``)."""

import gc
import sys


def main() -> int:
    """guestd: no garbage collection while start-up imports and builds (what it makes lives as
    long as guestd, and serve() freezes it and turns collection back on; the collections were
    ~5% of the instructions from spawn to listening), then the daemon's own main. The console
    script enters here, not at guestd.server.daemon:main, so that it starts the same way."""
    gc.disable()
    from guestd.server.daemon import main as serve_main

    return serve_main()


if __name__ == "__main__":
    sys.exit(main())
