"""Entry point of a code-context kernel process: ``python -m guestd.kernel -f CONNECTION_FILE``.

Runs inside the kernel, before ipykernel starts:
- asks the Linux kernel to SIGKILL this process when guestd (its parent) dies, so
  a crashed guestd never leaves orphan kernels behind (start-up reaping covers the rest);
- then hands over to ipykernel's normal launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    expected = os.environ.pop("GUESTD_PARENT_PID", "")
    if expected and os.getppid() != int(expected):
        sys.exit(1)  # guestd died before the prctl took effect: nobody owns us
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()


if __name__ == "__main__":
    main()
