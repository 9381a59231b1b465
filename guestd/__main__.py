import sys

from guestd.server.daemon import main

sys.exit(main())
