"""How a run ended: ``KilledBy``, ``ExitInfo`` and the run's figures.

``KilledBy`` says why, ``ExitInfo`` holds the exit fields every process reply reports with the
run's figures; the figures of a whole run or of part of one (a shell command, a cell)."""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Literal

from guestd.children.cgroups import RunUsage

if TYPE_CHECKING:  # the generated TypedDicts cost ~15 ms to import: not on guestd's start path
    from guestd.wire.types import RunFigures, RunFiguresFields

# Why a run ended (PROTOCOL.md "Why a run ended"): guestd ended it for a timeout, an idle
# timeout or a cancelled request; the kernel's OOM killer; any other signal (an external kill,
# the client's own signal op, an abort). None: it exited by itself.
KilledBy = Literal["timeout", "idle_timeout", "cancel", "signal", "oom"]


if TYPE_CHECKING:

    class ExitInfo(RunFiguresFields):
        """How a process ended, as every process reply reports it (nil while it runs), with the
        figures of why and what it used (the schema's run_figures group; nil: not known)."""

        exit_code: int | None
        signal: int | None

else:
    ExitInfo = dict  # a TypedDict is a dict at run time


_NO_FIGURES: RunFigures = {
    "killed_by": None,
    "oom_killed": None,
    "cpu_user_s": None,
    "cpu_sys_s": None,
    "max_rss_bytes": None,
}


def exit_info(status: int | None) -> ExitInfo:
    """The exit fields of a wait status alone (no figures: see ``Child.exit_info``)."""
    if status is None:
        return {"exit_code": None, "signal": None, **_NO_FIGURES}
    code = os.waitstatus_to_exitcode(status)
    return {"exit_code": code if code >= 0 else None, "signal": -code if code < 0 else None, **_NO_FIGURES}


def run_figures(info: ExitInfo) -> RunFigures:
    """The figures of an exit info alone (for results that report the exit their own way)."""
    return {
        "killed_by": info["killed_by"],
        "oom_killed": info["oom_killed"],
        "cpu_user_s": info["cpu_user_s"],
        "cpu_sys_s": info["cpu_sys_s"],
        "max_rss_bytes": info["max_rss_bytes"],
    }


def usage_between(
    before: RunUsage | None, after: RunUsage | None, killed_by: KilledBy | None, exit_code: int | None
) -> RunFigures:
    """The figures of part of a long-lived run (one shell command, one cell): what its leaf
    counted between two readings. ``killed_by`` is the caller's (a timeout it fired...);
    without one, an OOM kill counted meanwhile with status 137 (bash's 128 + SIGKILL) is "oom".
    No peak RSS: a process's peak covers its whole life, not a part of it."""

    def delta(a: int | None, b: int | None) -> int | None:
        return None if a is None or b is None else max(0, b - a)

    user = sys_ = oom = None
    if before is not None and after is not None:
        user, sys_ = delta(before.user_usec, after.user_usec), delta(before.system_usec, after.system_usec)
        oom = delta(before.oom_kills, after.oom_kills)
    if killed_by is None and oom and exit_code == 128 + signal.SIGKILL:
        killed_by = "oom"
    return {
        "killed_by": killed_by,
        "oom_killed": None if oom is None else oom > 0,
        "cpu_user_s": None if user is None else user / 1e6,
        "cpu_sys_s": None if sys_ is None else sys_ / 1e6,
        "max_rss_bytes": None,
    }
