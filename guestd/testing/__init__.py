"""A local guestd for tests and examples: start a real daemon on a private Unix socket, speak
raw frames to it (``rawwire``), or boot the baked image under QEMU (``qemu``).

Support code, not part of the daemon: nothing under guestd/ imports it outside this package,
and it needs nothing beyond guestd's own dependencies (pytest is never imported here).
"""

from guestd.testing.local import (
    NO_DAC,
    REPO,
    Guestd,
    StartGuestd,
    fsize_limit,
    limits_config,
    live_procs_with,
    scratch_guestd,
    start_guestd,
    unique_sleep,
    workload_python,
    workspace_guestd,
)

__all__ = [
    "NO_DAC",
    "REPO",
    "Guestd",
    "StartGuestd",
    "fsize_limit",
    "limits_config",
    "live_procs_with",
    "scratch_guestd",
    "start_guestd",
    "unique_sleep",
    "workload_python",
    "workspace_guestd",
]
