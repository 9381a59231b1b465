"""``Child``, the handle of one started run.

Its exit watch and reap, its exit fields and figures, signals, and ``end`` (TERM, grace, then
``cgroup.kill`` of the whole run)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
from collections.abc import Callable
from typing import Any, Protocol

from guestd.children.cgroups import RunCgroup, RunUsage
from guestd.children.records import ExitInfo, KilledBy, exit_info
from guestd.children.tree import (
    ExitWatch,
    descendants,
    kill_group_and_descendants,
    kill_tree,
    signal_each,
    signal_group,
    try_reap_usage,
)

# GUESTD_RUN_USAGE=0: no reading of the run's cgroup at exit (bench/observability.py measures
# what that reading costs an exec; figures then come from wait4 alone).
_RUN_USAGE = os.environ.get("GUESTD_RUN_USAGE", "1") != "0"


class Owner(Protocol):
    """What a run tells the component that spawned it (``Children``): it was reaped, it is over."""

    def reaped(self, child: Child) -> None: ...

    def retire(self, child: Child) -> None: ...


class Child:
    """One started run: its main process, its pipes (guestd's ends), its leaf cgroup."""

    def __init__(
        self,
        owner: Owner,
        kind: str,
        pid: int,
        pidfd: int | None,
        cgroup: RunCgroup | None,
        fds: dict[str, int],
        popen: subprocess.Popen[bytes] | None,
    ) -> None:
        self.owner = owner
        self.kind = kind
        self.pid = pid
        self.cgroup = cgroup
        self.stdin = fds.get("stdin")
        self.stdout = fds.get("stdout")
        self.stderr = fds.get("stderr")
        self.pty = fds.get("pty")
        self.status: int | None = None
        self._pidfd = pidfd
        self._popen = popen  # fallback spawn only: told the exit status so it never waits
        self._exit_watch: ExitWatch | None = None
        self._exit_callbacks: list[Callable[[], None]] = []
        self.exited: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ending: asyncio.Task[None] | None = None
        self._known: list[Any] = []  # descendants seen before the leader died (no-cgroup mode)
        self.ended_by: KilledBy | None = None  # why guestd ended the run, when it did (first reason)
        self.rusage: resource.struct_rusage | None = None  # wait4: the main process + what it waited for
        self.leaf_at_exit: RunUsage | None = None  # the leaf's counters when the main process was reaped

    # -- exit ---------------------------------------------------------------------------
    def watch(self, on_exit: Callable[[], None] | None = None, poll_s: float = 0.05) -> None:
        """Start the exit watch (once); ``on_exit`` runs on the loop after the reap."""
        if on_exit is not None:
            self._exit_callbacks.append(on_exit)
        if self._exit_watch is None and self.status is None:
            # Reaped now when it has exited already (a short command often has by the time its
            # spawn is collected): no watch is added to the loop and taken off again. Else the
            # watch: a pidfd stays readable once the process has exited, so an exit between the
            # two is seen at once.
            self._on_exit_ready()
            if self.status is None:
                loop = asyncio.get_running_loop()
                self._exit_watch = ExitWatch(loop, self.pid, self._on_exit_ready, poll_s, pidfd=self._pidfd)

    def _on_exit_ready(self) -> None:
        if self.status is not None:
            return
        reaped = try_reap_usage(self.pid)
        if reaped is None:
            return
        status, self.rusage = reaped
        if self.cgroup is not None and _RUN_USAGE:
            self.leaf_at_exit = self.cgroup.usage()
        self.status = status
        if self._popen is not None:
            self._popen.returncode = os.waitstatus_to_exitcode(status)
        if self._exit_watch is not None:
            self._exit_watch.close()
        self.owner.reaped(self)
        if not self.exited.done():
            self.exited.set_result(None)
        # Once only, and dropped: a callback holds its owner (an exec run), which holds this
        # Child; kept, every run would be a reference cycle left for the garbage collector.
        callbacks, self._exit_callbacks = self._exit_callbacks, []
        for cb in callbacks:
            cb()

    @property
    def running(self) -> bool:
        return self.status is None

    def exit_info(self) -> ExitInfo:
        """Exit status, why the run ended, and what it used (all nil while it runs).

        CPU: the leaf's cpu.stat when the main process was reaped (every process of the run,
        orphans included, up to that moment), else wait4's rusage (the main process and the
        children it waited for). ``max_rss_bytes``: the leaf's memory.peak (every process of
        the run, page cache included), nil without per-run memory accounting. Not wait4's
        ru_maxrss: exec records the high-water mark of the memory it leaves, and a child spawned
        like vfork (or forked) leaves guestd's, so `true` reported 37 MB here."""
        info = exit_info(self.status)
        if self.status is None:
            return info
        ru, leaf = self.rusage, self.leaf_at_exit
        user = sys_ = None
        if leaf is not None and leaf.user_usec is not None and leaf.system_usec is not None:
            user, sys_ = leaf.user_usec / 1e6, leaf.system_usec / 1e6
        elif ru is not None:
            user, sys_ = ru.ru_utime, ru.ru_stime
        oom = None if leaf is None or leaf.oom_kills is None else leaf.oom_kills > 0
        info["oom_killed"] = oom
        info["cpu_user_s"] = user
        info["cpu_sys_s"] = sys_
        info["max_rss_bytes"] = leaf.peak_bytes if leaf is not None else None
        info["killed_by"] = self.ended_by or _death_cause(info["signal"], oom)
        return info

    def usage_now(self) -> RunUsage | None:
        """The leaf's counters now (None without a leaf): for figures of part of a run."""
        return self.cgroup.usage() if self.cgroup is not None else None

    def note_end(self, reason: KilledBy) -> None:
        """guestd is about to end the run for ``reason`` (kept when it is the first one)."""
        if self.ended_by is None and self.status is None:
            self.ended_by = reason

    # -- signals and ending ---------------------------------------------------------------
    def signal(self, sig: int) -> None:
        """``sig`` to the run's process group (its session leader's group); once the leader is
        reaped its pid may be reused, so then to what is left in the run's cgroup instead."""
        if sig == signal.SIGKILL:
            self.kill_now()
        elif self.running:
            signal_group(self.pid, sig)
        elif self.cgroup is not None:
            self.cgroup.signal_all(sig)

    def kill_now(self) -> None:
        """SIGKILL the whole run at once: the leaf cgroup, or the group plus known descendants."""
        if self.cgroup is not None:
            self.cgroup.kill()
            return
        if self.running:
            kill_group_and_descendants(self.pid)
        signal_each(self._known, signal.SIGKILL)  # psutil handles: no pid-reuse mistakes

    def end(self, grace_s: float, reason: KilledBy | None = None) -> asyncio.Task[None]:
        """TERM (and CONT) everything in the run, wait up to ``grace_s`` for it to be gone,
        then kill what is left. Idempotent: the same task for every caller. ``reason``: why
        (reported as the run's ``killed_by``)."""
        if reason is not None:
            self.note_end(reason)
        if self._ending is None:
            if self.cgroup is None:
                self._known = descendants(self.pid) if self.running else []
                self._ending = asyncio.get_running_loop().create_task(
                    kill_tree(self.pid, self._known, grace_s, _event_of(self.exited))
                )
            else:
                self._ending = asyncio.get_running_loop().create_task(self._end_cgroup(self.cgroup, grace_s))
        return self._ending

    async def _end_cgroup(self, cg: RunCgroup, grace_s: float) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGCONT):  # a stopped process never handles TERM
            if self.running:  # once reaped, the leader's pid (and group id) may be reused
                signal_group(self.pid, sig)
            cg.signal_all(sig)
        deadline = loop.time() + grace_s
        while cg.populated() and loop.time() < deadline:
            await asyncio.sleep(min(0.02, max(0.0, deadline - loop.time())))
        if cg.populated():
            cg.kill()
        for _ in range(250):  # SIGKILLed processes leave within milliseconds; bounded anyway
            if not cg.populated():
                break
            await asyncio.sleep(0.02)

    # -- release --------------------------------------------------------------------------
    def close_fd(self, name: str) -> None:
        fd = getattr(self, name)
        if fd is not None:
            setattr(self, name, None)
            with contextlib.suppress(OSError):
                os.close(fd)

    def release(self) -> None:
        """Close guestd's ends of the pipes and the exit watch. The leaf goes once it is empty."""
        for name in ("stdin", "stdout", "stderr", "pty"):
            self.close_fd(name)
        if self._exit_watch is not None:
            self._exit_watch.close()
        self._exit_callbacks = []  # no exit is reported any more (and no cycle through them is kept)
        if self._pidfd is not None:  # released while running: the orphan sweep reaps it
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None
        self.owner.retire(self)


def _death_cause(sig: int | None, oom: bool | None) -> KilledBy | None:
    """Why a run guestd did not end itself ended: the OOM killer when it killed one of the run's
    processes and the main process died of SIGKILL, any other signal, else nothing."""
    if sig is None:
        return None
    return "oom" if oom and sig == signal.SIGKILL else "signal"


def _event_of(fut: asyncio.Future[None]) -> asyncio.Event:
    ev = asyncio.Event()
    if fut.done():
        ev.set()
    else:
        fut.add_done_callback(lambda _f: ev.set())
    return ev
