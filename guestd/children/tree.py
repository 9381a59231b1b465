"""Process trees without a cgroup (its group, then descendants that escaped it), watching for
exit, reaping, reading pipes and sizing terminals: the pieces under ``guestd.children``."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (children of children too). Empty if it is gone."""
    import psutil  # lazily: only a timeout or a kill needs it, and idle memory should not pay

    try:
        return psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group_and_descendants(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant of ``pid`` (found first: they may
    have left the group). ``pid`` must be an unreaped child, so its group is still its own."""
    escaped = descendants(pid)
    signal_group(pid, signal.SIGKILL)
    signal_each(escaped, signal.SIGKILL)


def signal_each(procs: list[psutil.Process], sig: int) -> None:
    import psutil

    for p in procs:
        try:
            p.send_signal(sig)  # psutil checks the create time: no PID-reuse mistakes
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


async def kill_tree(
    pgid: int, known: list[psutil.Process], grace_s: float, is_done: asyncio.Event | None = None
) -> None:
    """SIGTERM the group and the known descendants, wait up to ``grace_s``, then SIGKILL.

    ``known`` must be collected before the leader dies: orphans are re-parented
    away and can no longer be found as descendants afterwards.
    """
    import psutil

    signal_group(pgid, signal.SIGTERM)
    signal_each(known, signal.SIGTERM)
    for p in known:
        # A stopped process never handles SIGTERM.
        try:
            p.send_signal(signal.SIGCONT)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    signal_group(pgid, signal.SIGCONT)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while loop.time() < deadline:
        if not alive(known) and (is_done is None or is_done.is_set()) and not _group_exists(pgid):
            return
        await asyncio.sleep(min(0.02, max(0.0, deadline - loop.time())))
    # Sweep once more: survivors may have forked during the grace period.
    survivors = alive(known)
    for p in list(survivors):
        survivors.extend(descendants(p.pid))
    signal_group(pgid, signal.SIGKILL)
    signal_each(survivors, signal.SIGKILL)


def _group_exists(pgid: int) -> bool:
    """True while a live (non-zombie) process is in the group.

    Zombies count for killpg(pgid, 0) until whoever adopted them reaps them, which
    on a host whose init is slow to reap would stretch every kill to the full grace.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    import psutil

    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def try_reap(pid: int) -> int | None:
    """The wait status of ``pid`` if it has exited (reaping it), else None.

    A child someone else already reaped counts as exit status 255.
    """
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return 255 << 8
    return status if done else None


def try_reap_usage(pid: int) -> tuple[int, resource.struct_rusage | None] | None:
    """As ``try_reap``, with the rusage of what was reaped (wait4: the process and the
    children it waited for); None as rusage when someone else reaped it."""
    try:
        done, status, usage = os.wait4(pid, os.WNOHANG)
    except ChildProcessError:
        return 255 << 8, None
    return (status, usage) if done else None


class ExitWatch:
    """Calls ``on_ready`` on the loop when ``pid`` may have exited: once its pidfd is readable,
    or every ``poll_s`` where pidfds are missing (kernels before 5.3). Wake-ups can be spurious:
    the callback reaps with ``try_reap`` and calls ``close()`` once the child is gone."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pid: int,
        on_ready: Callable[[], None],
        poll_s: float,
        pidfd: int | None = None,
    ) -> None:
        self.loop = loop
        self.on_ready = on_ready
        self.poll_s = poll_s
        self.fd: int | None = None
        self.owns_fd = pidfd is None  # a pidfd handed in (from clone3) stays its owner's to close
        self.timer: asyncio.TimerHandle | None = None
        try:
            self.fd = os.pidfd_open(pid) if pidfd is None else pidfd
            loop.add_reader(self.fd, on_ready)
        except OSError:
            self.timer = loop.call_later(poll_s, self._poll)

    def _poll(self) -> None:
        self.timer = self.loop.call_later(self.poll_s, self._poll)
        self.on_ready()  # may close() us, which cancels the timer just set

    def close(self) -> None:
        """Stop watching; idempotent."""
        if self.fd is not None:
            self.loop.remove_reader(self.fd)
            if self.owns_fd:
                os.close(self.fd)
            self.fd = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.on_ready = _nothing  # the owner's bound method: kept, owner and watch would be a cycle


def _nothing() -> None:
    pass


def read_chunk(fd: int, size: int) -> bytes | None:
    """One non-blocking read of a child's pipe or pty: None when nothing is ready yet,
    b"" at end of stream (EOF, or EIO on a pty whose other side is gone)."""
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def set_winsize(fd: int, rows: int, cols: int) -> None:
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def set_if_pending(fut: asyncio.Future[None]) -> None:
    """A callback that completes ``fut`` unless it is done already (cancelled, or woken twice)."""
    if not fut.done():
        fut.set_result(None)


async def wait_fd(loop: asyncio.AbstractEventLoop, fd: int, *, writable: bool = False) -> None:
    """Wait until a non-blocking fd is readable (or writable); the watch is removed however the
    wait ends (a cancelled reader must not leave a callback on the loop)."""
    ready: asyncio.Future[None] = loop.create_future()
    if writable:
        loop.add_writer(fd, set_if_pending, ready)
    else:
        loop.add_reader(fd, set_if_pending, ready)
    try:
        await ready
    finally:
        if writable:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def write_all(loop: asyncio.AbstractEventLoop, fd: int, data: bytes, sent: list[int] | None = None) -> None:
    """Write all of ``data`` to a non-blocking pipe or pty, waiting for room as needed.
    ``sent[0]`` counts the bytes written so far (what went in, should it fail midway)."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
            view = view[n:]
            if sent is not None:
                sent[0] += n
            continue
        except BlockingIOError:
            pass
        await wait_fd(loop, fd, writable=True)
