"""Background processes that outlive the request (and the connection) that started them.

Each process's output is drained into bounded rings (:class:`OutputRing`) as it
arrives, whether or not anyone is attached, so a stalled reader never blocks the
process or other readers. Readers address output by absolute offsets and can
reattach after a dropped connection without gaps or duplicates.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

from guestd.capture import OutputRing
from guestd.proctree import (
    ExitWatch,
    descendants,
    read_chunk,
    reset_oom_score,
    signal_each,
    signal_group,
    try_reap,
)
from guestd.wire.errors import ErrorCode, GuestdError, limit_error


class ExitInfo(TypedDict):
    """How a process ended, as every process reply reports it (nil while it runs)."""

    exit_code: int | None
    signal: int | None


if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.server.daemon import Daemon
    from guestd.wire.types import ProcessInfoRecord, ProcessStartArgs

READ_SIZE = 256 * 1024


def set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _chain(first: Any, second: Any) -> Any:
    if first is None:
        return second

    def both() -> None:
        first()
        second()

    return both


def _take_controlling_tty() -> None:
    # Runs in the child after setsid(): make the pty its controlling terminal, so ^C,
    # ^Z and SIGWINCH work as on a real terminal.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class ManagedProcess:
    def __init__(self, table: ProcessTable, pid_id: str, command: str, ring_bytes: int) -> None:
        self.table = table
        self.id = pid_id
        self.command = command
        self.pid = 0
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.status: int | None = None
        self.rings = {"stdout": OutputRing(ring_bytes), "stderr": OutputRing(ring_bytes)}
        self.pty_fd: int | None = None
        self.stdin_fd: int | None = None
        self._fds: dict[str, int] = {}
        self._exit_watch: ExitWatch | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self.proc: subprocess.Popen[bytes] | None = None

    # -- start ------------------------------------------------------------------------
    def start(self, args: ProcessStartArgs) -> None:
        from guestd.ops.exec import as_user, build_env, check_cwd, command_argv, preexec_failed

        daemon = self.table.daemon
        creds = as_user(daemon.config.policy.workload_ids(), daemon.workload.popen_kwargs())

        argv = command_argv(args["argv"], args["shell"])
        cwd = args["cwd"]
        check_cwd(cwd)
        env = build_env(args["env"], args["env_mode"])
        try:
            if args["pty"]:
                master, slave = os.openpty()
                set_winsize(master, args["rows"], args["cols"])
                if env is None:
                    env = dict(os.environ)
                env.setdefault("TERM", "xterm-256color")
                try:
                    self.proc = subprocess.Popen(
                        argv,
                        stdin=slave,
                        stdout=slave,
                        stderr=slave,
                        cwd=cwd,
                        env=env,
                        start_new_session=True,
                        close_fds=True,
                        **{**creds, "preexec_fn": _chain(creds.get("preexec_fn"), _take_controlling_tty)},
                    )
                finally:
                    os.close(slave)
                os.set_blocking(master, False)
                self.pty_fd = master
                self._fds = {"stdout": master}
            else:
                self.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE if args["stdin"] else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                    **creds,
                )
                assert self.proc.stdout is not None and self.proc.stderr is not None
                self._fds = {"stdout": self.proc.stdout.fileno(), "stderr": self.proc.stderr.fileno()}
                if self.proc.stdin is not None:
                    self.stdin_fd = self.proc.stdin.fileno()
                    os.set_blocking(self.stdin_fd, False)
        except OSError as exc:
            stage = "cwd" if cwd is not None and exc.filename == cwd else "spawn"
            raise GuestdError.from_os_error(exc, stage=stage, argv0=argv[0]) from None
        except (ValueError, TypeError) as exc:
            raise GuestdError(ErrorCode.BAD_REQUEST, f"cannot spawn: {exc}", details={"stage": "spawn"}) from None
        except subprocess.SubprocessError as exc:
            raise preexec_failed(exc) from None
        self.pid = self.proc.pid
        reset_oom_score(self.pid)
        self.table.daemon.reaper.tracked.add(self.pid)
        loop = asyncio.get_running_loop()
        for name, fd in self._fds.items():
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._on_readable, name)
        self._exit_watch = ExitWatch(loop, self.pid, self._check_exit, 0.05)

    # -- output -----------------------------------------------------------------------
    def _on_readable(self, name: str) -> None:
        fd = self._fds.get(name)
        if fd is None:
            return
        data = read_chunk(fd, READ_SIZE)
        if data is None:
            return
        if not data:
            self._close_stream(name)
        else:
            self.rings[name].write(data)
        self._notify()

    def _close_stream(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
        self.rings[name].closed = True
        if name == "stdout" and self.pty_fd is not None:
            self.rings["stderr"].closed = True

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def changed(self, timeout: float | None = None) -> None:
        """Wait until new output arrives or the state changes (or the timeout passes)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass

    # -- exit -------------------------------------------------------------------------
    def _check_exit(self) -> None:
        if self.status is not None:
            return
        st = try_reap(self.pid)
        if st is None:
            return
        self.status = st
        self.ended_at = time.time()
        if self.proc is not None:
            self.proc.returncode = os.waitstatus_to_exitcode(st)
        loop = asyncio.get_running_loop()
        if self._exit_watch is not None:
            self._exit_watch.close()
        self.table.daemon.reaper.tracked.discard(self.pid)
        # Leftover children may keep the pipes open; whatever they write still lands in the rings.
        loop.call_later(0.2, self._finish_streams_if_idle)
        self._notify()

    def _finish_streams_if_idle(self) -> None:
        if self.pty_fd is not None and "stdout" in self._fds:
            # A pty master never reports EOF while other processes hold the slave; drain and stop.
            self._on_readable("stdout")
        self._notify()

    @property
    def running(self) -> bool:
        return self.status is None

    def exit_info(self) -> ExitInfo:
        if self.status is None:
            return {"exit_code": None, "signal": None}
        code = os.waitstatus_to_exitcode(self.status)
        return {"exit_code": code if code >= 0 else None, "signal": -code if code < 0 else None}

    # -- control ----------------------------------------------------------------------
    def send_signal(self, sig: int) -> None:
        if not self.running:
            raise GuestdError(ErrorCode.BAD_REQUEST, f"process {self.id} has exited", details={"process": self.id})
        escaped = descendants(self.pid) if sig == signal.SIGKILL else []
        signal_group(self.pid, sig)
        if sig == signal.SIGKILL:
            signal_each(escaped, signal.SIGKILL)  # children that left the group die too

    async def write_stdin(self, data: bytes) -> int:
        fd = self.pty_fd if self.pty_fd is not None else self.stdin_fd
        if fd is None:
            raise GuestdError(
                ErrorCode.BAD_REQUEST,
                f"process {self.id} has no stdin (start it with stdin or pty)",
                details={"process": self.id},
            )
        from guestd.ops.exec import write_all

        try:
            await asyncio.wait_for(write_all(asyncio.get_running_loop(), fd, data), 30.0)
        except (BrokenPipeError, OSError) as exc:
            raise (
                GuestdError.from_os_error(exc)
                if not isinstance(exc, BrokenPipeError)
                else GuestdError(
                    ErrorCode.BAD_REQUEST, f"process {self.id} closed its stdin", details={"process": self.id}
                )
            ) from None
        except TimeoutError:
            raise GuestdError(ErrorCode.TIMEOUT, "the process did not read its stdin within 30 s") from None
        return len(data)

    def close_stdin(self) -> None:
        if self.pty_fd is not None:
            # A terminal has no half-close: send EOF the way a user would (^D at line start).
            os.write(self.pty_fd, b"\x04")
            return
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
            self.stdin_fd = None

    def resize(self, rows: int, cols: int) -> None:
        if self.pty_fd is None:
            raise GuestdError(ErrorCode.BAD_REQUEST, f"process {self.id} has no pty", details={"process": self.id})
        set_winsize(self.pty_fd, rows, cols)  # the tty layer sends SIGWINCH to the foreground group

    def describe(self) -> ProcessInfoRecord:
        out: ProcessInfoRecord = {
            "id": self.id,
            "pid": self.pid,
            "command": self.command,
            "state": "running" if self.running else "exited",
            "pty": self.pty_fd is not None,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "stdout_offset": self.rings["stdout"].total,
            "stderr_offset": self.rings["stderr"].total,
            "cpu_s": None,
            "rss": None,
            **self.exit_info(),
        }
        if self.running:
            try:
                import psutil

                p = psutil.Process(self.pid)
                with p.oneshot():
                    t = p.cpu_times()
                    out["cpu_s"] = t.user + t.system
                    out["rss"] = p.memory_info().rss
            except Exception:
                pass
        return out

    def release(self) -> None:
        """Drop every fd (after the process is gone or forgotten)."""
        for name in list(self._fds):
            self._close_stream(name)
        if self._exit_watch is not None:
            self._exit_watch.close()
        if self.pty_fd is not None:
            try:
                os.close(self.pty_fd)
            except OSError:
                pass
            self.pty_fd = None
        if self.proc is not None:
            for f in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
        self._notify()


class ProcessTable:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.procs: dict[str, ManagedProcess] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def get(self, pid_id: str) -> ManagedProcess:
        p = self.procs.get(pid_id)
        if p is None:
            raise GuestdError(ErrorCode.NOT_FOUND, f"no process {pid_id!r}", details={"process": pid_id})
        return p

    def start(self, args: ProcessStartArgs, on_start: Callable[[ManagedProcess], None] | None = None) -> ManagedProcess:
        limits = self.daemon.config.limits
        self._expire()
        running = sum(1 for p in self.procs.values() if p.running)
        if running >= limits.max_processes:
            raise limit_error("max_processes", limits.max_processes, f"at most {limits.max_processes} live processes")
        if len(self.procs) >= limits.max_kept_processes:
            self._evict_oldest_finished()
            if len(self.procs) >= limits.max_kept_processes:
                raise limit_error(
                    "max_kept_processes", limits.max_kept_processes, "too many kept processes; forget some"
                )
        command = args["shell"] if args["shell"] is not None else " ".join(args["argv"] or [])
        mp = ManagedProcess(self, "p" + os.urandom(6).hex(), command, args["ring_bytes"])
        mp.start(args)
        self.procs[mp.id] = mp
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return mp

    def forget(self, pid_id: str) -> None:
        p = self.get(pid_id)
        if p.running:
            raise GuestdError(
                ErrorCode.BAD_REQUEST,
                f"process {pid_id} is still running; signal it first",
                details={"process": pid_id},
            )
        del self.procs[pid_id]
        p.release()

    def _evict_oldest_finished(self) -> None:
        done = sorted((p for p in self.procs.values() if not p.running), key=lambda p: p.ended_at or 0)
        if done:
            self.forget(done[0].id)

    def _expire(self) -> None:
        keep = self.daemon.config.process_retention_s
        now = time.time()
        for p in list(self.procs.values()):
            if not p.running and p.ended_at is not None and now - p.ended_at > keep:
                self.forget(p.id)

    async def _sweep(self) -> None:
        while self.procs:
            await asyncio.sleep(min(60.0, max(1.0, self.daemon.config.process_retention_s / 4)))
            self._expire()

    async def shutdown(self) -> None:
        """guestd is stopping: end every process tree it started (escaped descendants too)."""
        trees = {p.id: descendants(p.pid) for p in self.procs.values() if p.running}
        for p in self.procs.values():
            if p.running:
                signal_group(p.pid, signal.SIGTERM)
                signal_each(trees[p.id], signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        while any(p.running for p in self.procs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in self.procs.values():
            if p.id in trees:
                signal_group(p.pid, signal.SIGKILL)
                signal_each(trees[p.id], signal.SIGKILL)
            p.release()
