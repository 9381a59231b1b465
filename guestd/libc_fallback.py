"""guestd/libc.py's calls through ctypes, for a process without the clone3 extension loaded."""

from __future__ import annotations

import ctypes

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)  # symbols of this process, libc included
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def mallopt(param: int, value: int) -> bool | None:
    try:
        call = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return None
    return bool(call(param, value))
