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
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from guestd.children import ExitInfo, exit_info
from guestd.children.tree import read_chunk, set_winsize, signal_group
from guestd.output.capture import OutputRing

if TYPE_CHECKING:
    from guestd.children.cgroups import RunCgroup

STATUS_MAX = 64  # "pid\nstatus\n": anything longer is not the wrapper's
# A job's status FIFO as read for its pid: the workload can write into it as well; past this
# much, it has only kept its own job from being signalled or resized.
STATUS_SCAN_MAX = 4096


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


class RunningJob:
    """The job of the command running now (on_timeout detach, or pty): its FIFOs, its output
    from byte 0 in rings (what a detached job hands over), and its status FIFO's first bytes,
    which name its pid."""

    def __init__(self, fifos: JobFifos, ring_bytes: int, bash_pid: int) -> None:
        self.fifos = fifos
        self.rings = {1: OutputRing(ring_bytes), 2: OutputRing(ring_bytes)}
        self.bash_pid = bash_pid
        self._status = bytearray()
        self._pid: int | None = None

    def output_fd(self, which: int) -> int | None:
        return self.fifos.read.get("stdout" if which == 1 else "stderr")

    def read_status(self) -> None:
        fd = self.fifos.read.get("status")
        if fd is None:
            return
        data = read_chunk(fd, STATUS_SCAN_MAX)
        if data and len(self._status) < STATUS_SCAN_MAX:
            self._status += data[: STATUS_SCAN_MAX - len(self._status)]
        if self._pid is None and data:
            self._pid = self._find_pid()

    def pid(self) -> int | None:
        """The job's pid (its process group), once its status FIFO has named it."""
        if self._pid is None:
            self.read_status()
        return self._pid

    def _find_pid(self) -> int | None:
        """The first pid in the status FIFO that is a child of the session's bash leading its
        own process group. The workload can write into that FIFO too (through
        /proc/<bash>/fd/9 while bash holds it), and guestd (root) signals the pid's group and
        moves its processes: a pid is never taken on the FIFO's word alone. Checked while the
        job runs (it writes its pid first), and kept: its group may outlive it."""
        for line in bytes(self._status).split(b"\n")[:-1]:
            if line.isdigit() and leads_a_group_under(int(line), self.bash_pid):
                return int(line)
        return None

    def status_from_pid(self) -> bytes:
        """The status FIFO's bytes from the job's own pid line on (what the workload wrote
        before it is not the job's)."""
        buf = bytes(self._status)
        if self._pid is not None:
            line = f"{self._pid}\n".encode()
            at = buf.find(b"\n" + line)
            buf = buf if buf.startswith(line) or at < 0 else buf[at + 1 :]
        return buf[:STATUS_MAX]


def leads_a_group_under(pid: int, parent: int) -> bool:
    """``pid`` is a child of ``parent`` and the leader of its own process group."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 2 :].split()  # state ppid pgrp ...: after the comm, which may hold anything
    return len(fields) > 2 and fields[1] == str(parent).encode() and fields[2] == str(pid).encode()


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
