"""A shell command run as a job of its session, so that a timeout can give it away.

With ``on_timeout: "detach"`` the command does not run in bash itself but in a subshell that
bash starts as a job of its own (``set -m``: its own process group, SIGINT not ignored) with
its stdout, stderr and a status channel on FIFOs that guestd reads, and bash waits for it
(``wait``, which a trapped SIGINT interrupts). If it ends in time, ``wait`` gives its status
and the session goes on as usual. On the timeout guestd sends SIGINT to bash alone: ``wait``
returns, bash is back at its prompt, and the job keeps running; guestd moves its processes
(frozen, wherever they went) into a leaf cgroup of their own and hands the job, its FIFOs and
its rings to the process table. PROTOCOL.md 10 says what the job keeps of the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from guestd.children import ExitInfo, exit_info
from guestd.children.tree import read_chunk, set_winsize, signal_group

if TYPE_CHECKING:
    from guestd.children.cgroups import RunCgroup

STATUS_MAX = 64  # "pid\nstatus\n": anything longer is not the wrapper's
# StdinFifo.end_input looks whether the command has opened its stdin at these intervals: soon
# at first (the usual command opens it within milliseconds), then doubling up to the cap, so a
# command that never reads its stdin costs a few wake-ups a second, not a hundred.
UNOPENED_FIFO_FIRST_POLL_S = 0.002
UNOPENED_FIFO_MAX_POLL_S = 0.25


class JobFifos:
    """The three FIFOs of one job (stdout, stderr, status) in a 0711 directory, with names
    nobody can guess or list; guestd holds a read end of each and, until bash has opened
    them, a write end too (so no read sees an end of file before the job is there)."""

    def __init__(self, directory: str, ids: tuple[int, int] | None, pty: tuple[int, int] | None = None) -> None:
        """``pty``: (rows, cols) of a terminal for the job's stdin, stdout and stderr."""
        self.paths: dict[str, str] = {}
        self.read: dict[str, int] = {}
        self._hold: list[int] = []
        self.master: int | None = None  # pty mode: the terminal's primary side (read is stdout)
        self.tty = ""  # pty mode: the secondary side's /dev/pts name
        tag = os.urandom(12).hex()
        try:
            if pty is not None:
                self._open_pty(ids, *pty)
            for name in ("status",) if pty is not None else ("stdout", "stderr", "status"):
                path = os.path.join(directory, f"{tag}-{name}")
                os.mkfifo(path, 0o600)
                self.paths[name] = path
                if ids is not None:
                    os.chown(path, *ids)  # bash runs as the workload user
                self.read[name] = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                self._hold.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        except BaseException:
            self.close()
            raise

    def _open_pty(self, ids: tuple[int, int] | None, rows: int, cols: int) -> None:
        """pty mode: the job's stdin, stdout and stderr are the secondary side (by its
        /dev/pts name, owned by the workload user); guestd reads and writes the primary side
        and holds the secondary open until bash has opened it (no EIO before the job is there)."""
        master, secondary = os.openpty()
        self.master = master
        self._hold.append(secondary)
        os.set_blocking(master, False)
        set_winsize(master, rows, cols)
        if ids is not None:
            os.fchown(secondary, *ids)
        # The job's own subshell opens it (bash, a session leader without a terminal, would
        # make it its controlling terminal on open: the job, in another process group, would
        # then stop on its first read, and closing the primary side would hang bash up).
        self.tty = os.ttyname(secondary)
        self.paths["stdout"] = self.paths["stderr"] = self.paths["stdin"] = "/dev/null"
        self.read["stdout"] = master

    def opened(self) -> None:
        """bash has opened them (its ``wait`` returned): drop guestd's write ends and the names."""
        for fd in self._hold:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._hold = []
        for name, path in self.paths.items():
            if name == "status" or self.master is None:  # never /dev/null
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self.paths = {}

    def close(self) -> None:
        self.opened()
        for fd in self.read.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.read = {}


def backing_off(first_s: float, cap_s: float) -> Iterator[float]:
    """first_s, 2 x first_s, 4 x ... up to cap_s, then cap_s for ever."""
    interval = first_s
    while True:
        yield interval
        interval = min(cap_s, interval * 2)


class StdinFifo:
    """The stdin of a ``stdin_stream`` session command: a FIFO the command opens for reading
    and guestd writes INPUT data into. guestd holds a read end too, so its write end opens at
    once and the command's open never blocks; closing the write end is the command's EOF."""

    def __init__(self, directory: str, ids: tuple[int, int] | None) -> None:
        self.path = os.path.join(directory, f"in-{os.urandom(12).hex()}")
        os.mkfifo(self.path, 0o600)
        self.hold: int | None = None
        self.write: int | None = None
        try:
            if ids is not None:
                os.chown(self.path, *ids)
            self.hold = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self.write = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            self.close()
            raise

    def close_write(self) -> None:
        fd, self.write = self.write, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    async def end_input(self) -> None:
        """The command's EOF (INPUT eof). A reader that opens a FIFO without a writer waits for
        one for ever, so closing the write end before bash has opened the FIFO for the command
        (data and eof sent right behind the request) hung the command until its timeout. guestd's
        own read end goes first; then, while poll says the FIFO has no reader (POLLERR), the
        command has not opened it yet: the write end stays (the bytes written wait in the pipe)
        and is looked at again after a backing-off interval, for as long as the command runs
        (this task goes with it)."""
        fd, self.hold = self.hold, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        intervals = backing_off(UNOPENED_FIFO_FIRST_POLL_S, UNOPENED_FIFO_MAX_POLL_S)
        while self.write is not None:
            poller = select.poll()
            poller.register(self.write, 0)  # POLLERR is always reported
            if not any(events & select.POLLERR for _, events in poller.poll(0)):
                break
            await asyncio.sleep(next(intervals))
        self.close_write()

    def give_write(self) -> int | None:
        """The write end for a detached job's stdin (process.write); the FIFO is closed here."""
        fd, self.write = self.write, None
        self.close()
        return fd

    def close(self) -> None:
        self.close_write()
        fd, self.hold = self.hold, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class PtyInput:
    """INPUT data into a pty-mode command: written to the terminal's primary side (a copy of
    the fd, closed with the job); eof is the terminal's end-of-file character (^D), which
    ends a read at the start of a line as a closed pipe would."""

    def __init__(self, master: int) -> None:
        self.write: int | None = os.dup(master)

    def close_write(self) -> None:
        if self.write is not None:
            with contextlib.suppress(OSError):
                os.write(self.write, b"\x04")

    async def end_input(self) -> None:
        self.close_write()

    def close(self) -> None:
        fd, self.write = self.write, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class ShellJob:
    """A detached shell job as the process table sees a run (``services.AdoptedRun``).

    Its main process is the wrapper subshell (a child of bash, not of guestd): its end is seen
    through a pidfd, its exit status comes from its status FIFO (``128+N`` as signal N, as bash
    reports it); a wrapper killed before it could report counts as killed by SIGKILL."""

    pty: int | None = None

    def __init__(
        self,
        pid: int,
        status_fd: int,
        status_buf: bytes,
        cgroup: RunCgroup | None,
        output_fds: list[int],
        stdin: int | None = None,
    ) -> None:
        self.pid = pid
        self.stdin = stdin  # a stdin_stream command's FIFO: process.write goes on writing into it
        self._output_fds = output_fds  # the stdout/stderr FIFOs' read ends: the table reads them
        self.cgroup = cgroup
        self.status: int | None = None
        self._status_fd: int | None = status_fd
        self._buf = bytearray(status_buf)
        self._callbacks: list[Callable[[], None]] = []
        self._pidfd: int | None = None
        self._lingering: set[RunCgroup] | None = None
        loop = asyncio.get_running_loop()
        loop.add_reader(status_fd, self._on_status)
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # already gone
            loop.call_soon(self._ended)
            return
        loop.add_reader(self._pidfd, self._ended)

    @property
    def running(self) -> bool:
        return self.status is None

    def exit_info(self) -> ExitInfo:
        """Exit fields from the wrapper's status; no figures (the job shares the session's leaf
        until it is detached, so per-run accounting does not apply)."""
        return exit_info(self.status)

    def _on_status(self) -> None:
        if self._status_fd is None:
            return
        data = read_chunk(self._status_fd, STATUS_MAX)
        if data is None:
            return
        if not data:
            asyncio.get_running_loop().remove_reader(self._status_fd)
            os.close(self._status_fd)
            self._status_fd = None
            return
        if len(self._buf) < STATUS_MAX:
            self._buf += data[: STATUS_MAX - len(self._buf)]

    def _ended(self) -> None:
        if self.status is not None:
            return
        self._on_status()  # the last line may have arrived with the end
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
        lines = bytes(self._buf).split(b"\n")
        code = int(lines[1]) if len(lines) > 2 and lines[1].isdigit() else None
        if code is None:
            self.status = signal.SIGKILL  # a wait status: killed by SIGKILL
        elif 128 < code <= 128 + 64:
            self.status = code - 128
        else:
            self.status = (code & 0xFF) << 8
        for cb in self._callbacks:
            cb()

    def watch(self, on_exit: Callable[[], None] | None = None, poll_s: float = 0.05) -> None:
        if on_exit is not None:
            self._callbacks.append(on_exit)

    def signal(self, sig: int) -> None:
        """To the job's process group while it runs; KILL ends its whole leaf."""
        if sig == signal.SIGKILL and self.cgroup is not None:
            self.cgroup.kill()
        elif self.running:
            signal_group(self.pid, sig)
        elif self.cgroup is not None:
            self.cgroup.signal_all(sig)

    def close_fd(self, name: str) -> None:
        if name == "stdin" and self.stdin is not None:
            fd, self.stdin = self.stdin, None
            with contextlib.suppress(OSError):
                os.close(fd)

    def keep_lingering(self, lingering: set[RunCgroup]) -> None:
        self._lingering = lingering

    def release(self) -> None:
        self.close_fd("stdin")
        loop = asyncio.get_running_loop()
        for attr in ("_status_fd", "_pidfd"):
            fd = getattr(self, attr)
            if fd is not None:
                loop.remove_reader(fd)
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, None)
        for fd in self._output_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._output_fds = []
        cg, self.cgroup = self.cgroup, None
        if cg is not None:
            cg.close_fd()
            if not cg.remove() and self._lingering is not None:
                self._lingering.add(cg)  # guestd.children removes it once its processes are gone
