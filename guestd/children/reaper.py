"""guestd as child subreaper: orphans of the workload are re-parented to us and reaped.

Exec waits for its own children through pidfds; this sweep reaps everything
else (``cmd &`` left behind by a finished exec, grandchildren of killed trees)
so that zombies never pile up, whether or not the image's init reaps.
"""

from __future__ import annotations

import asyncio
import logging
import os

from guestd.libc import become_subreaper

log = logging.getLogger("guestd.reaper")


class Reaper:
    def __init__(self) -> None:
        self.tracked: set[int] = set()  # pids someone else will reap (exec's own children)
        self.enabled = False

    def enable(self) -> bool:
        try:
            become_subreaper()
        except (OSError, AttributeError) as exc:
            log.warning("cannot become child subreaper: %s", exc)
            return False
        self.enabled = True
        return True

    async def run_periodic(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.sweep()

    def sweep(self) -> None:
        """Reap every waitable child that nobody tracks."""
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid == 0:
                return
            if info.si_pid in self.tracked:
                return  # its owner reaps it; the owner's exit path sweeps again
            try:
                os.waitpid(info.si_pid, os.WNOHANG)
            except ChildProcessError:
                return
