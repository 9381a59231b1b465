"""Persistent bash sessions: cd, variables, functions, aliases and venvs persist between commands.

How a command runs, without markers in the user's output:
- bash reads guestd's script on its stdin; the user's command travels as an ANSI-C
  quoted string and runs through ``eval`` in the shell itself, with stdin from
  /dev/null (or a file holding the request's input) and the control fd closed;
- when it ends, bash writes ``status NUL cwd NUL export -p NUL`` to a separate
  control pipe (fd 63). Everything the command wrote to stdout/stderr was written
  before that, so it is in the pipes when guestd sees the status: guestd drains
  them and the command's output is complete, with nothing of the next command.
- ``exit``/``logout`` are shell functions that return from the command, so
  ``exit 3`` gives status 3 and keeps the session. The command runs in an ``if``
  condition, so ``set -e`` cannot end the session (and has no effect inside it).
  ``builtin exit``, ``exec``, or a command that ignores SIGINT inside bash itself
  (``trap '' INT; while :; do :; done``) past its timeout end bash: the session is
  restarted with the last cwd and exported variables, and the result says so.
- A timeout sends SIGINT to the session's process group (bash's INT trap returns
  from the command), then ends the command's child processes, and as a last
  resort restarts bash with the last known cwd and exported environment.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Any, Literal

from guestd.capture import OutputCapture, capture_fields
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
from guestd.wire.paths import path_to_wire

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.server.daemon import Daemon
    from guestd.wire.types import ShellInfoRecord, ShellRunArgs, ShellRunReply, ShellRunTimedOut

CTL_FD = 63
READ_SIZE = 256 * 1024
GRACE_S = 1.0

PRELUDE = rf"""
__gd_trap() {{ trap 'return 130 2>/dev/null' INT; }}
__gd_trap
shopt -s expand_aliases
exit() {{ builtin return "${{1:-$?}}"; }}
logout() {{ builtin return "${{1:-$?}}"; }}
__gd_run() {{ eval -- "$__gd_cmd"; }}
__gd_mark() {{
  __gd_trap  # a command may have replaced the INT trap; timeouts rely on it
  builtin printf '%s\0%s\0' "$1" "$PWD" >&{CTL_FD}; builtin export -p >&{CTL_FD}; builtin printf '\0' >&{CTL_FD}
}}
"""


def ansi_c_quote(text: str) -> str:
    """Quote for bash as $'...': every byte that could end or bend the string is escaped."""
    out = ["$'"]
    for b in text.encode("utf-8", "surrogateescape"):
        c = chr(b)
        if c == "'" or c == "\\":
            out.append("\\" + c)
        elif 0x20 <= b < 0x7F:
            out.append(c)
        else:
            out.append(f"\\x{b:02x}")
    out.append("'")
    return "".join(out)


class Session:
    def __init__(self, table: Shells, sid: str, name: str | None, cwd: str | None, env: dict[str, str] | None) -> None:
        self.table = table
        self.id = sid
        self.name = name
        self.cwd = cwd or os.getcwd()
        self.env = env
        self.exports = ""  # last `export -p`, replayed into a restarted bash
        self.proc: subprocess.Popen[bytes] | None = None
        self.ctl_fd = -1
        self.lock = asyncio.Lock()
        self.commands = 0
        self.restarts = 0
        self.stray_bytes = 0  # output written between commands (background jobs); not attributed
        self._ctl = bytearray()
        self._marker: asyncio.Future[tuple[int, str, str]] | None = None
        self._caps: dict[int, OutputCapture] | None = None
        self._last_output = 0.0
        self._fds: dict[int, int] = {}
        self._exited: asyncio.Future[None] | None = None
        self._exit_watch: ExitWatch | None = None
        self.pending_seed: int | None = None  # set by a restore: a new $RANDOM seed for the next command

    async def apply_pending_seed(self) -> None:
        async with self.lock:
            await self._reseed_locked()

    async def _reseed_locked(self) -> None:
        seed, self.pending_seed = self.pending_seed, None
        if seed is None or not self.alive:
            return
        await self._run_locked(
            {
                "id": self.id,
                "command": f"RANDOM={seed}",
                "input": None,
                "timeout_s": 10.0,
                "idle_timeout_s": None,
                "max_output": 1024,
                "capture": "tail",
            },
            count=False,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    @property
    def alive(self) -> bool:
        return self._exited is not None and not self._exited.done()

    # -- process -----------------------------------------------------------------------
    async def start(self, replay_exports: bool = False) -> None:
        from guestd.ops.exec import as_user, check_cwd, preexec_failed

        check_cwd(self.cwd)
        env = dict(os.environ)
        env.update(self.env or {})
        env.pop("BASH_ENV", None)
        env.pop("ENV", None)
        r, w = os.pipe()
        os.set_inheritable(w, True)
        try:
            self.proc = subprocess.Popen(
                ["/bin/bash", "--noprofile", "--norc", "-s"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.cwd,
                env=env,
                start_new_session=True,
                pass_fds=(w,),
                **as_user(self.table.daemon.config.policy.workload_ids(), self.table.daemon.workload.popen_kwargs()),
            )
        except OSError as exc:
            os.close(r)
            raise GuestdError.from_os_error(exc, stage="spawn", argv0="/bin/bash") from None
        except subprocess.SubprocessError as exc:
            os.close(r)
            raise preexec_failed(exc) from None
        finally:
            os.close(w)
        loop = asyncio.get_running_loop()
        reset_oom_score(self.proc.pid)
        self.ctl_fd = r
        os.set_blocking(r, False)
        loop.add_reader(r, self._on_ctl)
        assert self.proc.stdout is not None and self.proc.stderr is not None and self.proc.stdin is not None
        self._fds = {1: self.proc.stdout.fileno(), 2: self.proc.stderr.fileno()}
        for which, fd in self._fds.items():
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._on_output, which)
        os.set_blocking(self.proc.stdin.fileno(), False)
        self.table.daemon.reaper.tracked.add(self.proc.pid)
        self._exited = loop.create_future()
        self._exit_watch = ExitWatch(loop, self.proc.pid, self._on_exit, 0.05)
        # Move the control pipe to its fixed fd, out of the way of user redirections.
        script = f"exec {CTL_FD}>&{w} {w}>&-\n" + PRELUDE
        if replay_exports and self.exports:
            script += self.exports + "\n"  # a restarted session keeps its exported environment
        script += "__gd_mark 0\n"
        self._marker = loop.create_future()
        await self._send(script)
        try:
            await asyncio.wait_for(asyncio.shield(self._marker), 30.0)
        except TimeoutError:
            await self.kill()
            raise GuestdError(ErrorCode.UNAVAILABLE, "bash did not start within 30 s") from None

    async def _send(self, text: str) -> None:
        from guestd.ops.exec import write_all

        assert self.proc is not None and self.proc.stdin is not None
        await write_all(asyncio.get_running_loop(), self.proc.stdin.fileno(), text.encode("utf-8", "surrogateescape"))

    def _on_exit(self) -> None:
        assert self.proc is not None
        st = try_reap(self.proc.pid)
        if st is None:
            return
        self.proc.returncode = os.waitstatus_to_exitcode(st)
        if self._exit_watch is not None:
            self._exit_watch.close()
        self.table.daemon.reaper.tracked.discard(self.proc.pid)
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(None)

    def _on_output(self, which: int) -> None:
        self._read_once(which)

    def _read_once(self, which: int) -> bool:
        """One read from a pipe, routed to the running command's capture (or counted as stray).
        False when nothing is ready or the pipe has ended."""
        fd = self._fds.get(which)
        if fd is None:
            return False
        data = read_chunk(fd, READ_SIZE)
        if data is None:
            return False
        if not data:
            asyncio.get_running_loop().remove_reader(fd)
            del self._fds[which]
            return False
        self._last_output = time.monotonic()
        if self._caps is not None:
            self._caps[which].feed(data)
        else:
            self.stray_bytes += len(data)
        return True

    def _drain_output(self) -> None:
        """Read whatever is in the pipes right now (bounded: at most 64 reads per stream)."""
        for which in list(self._fds):
            for _ in range(64):
                if not self._read_once(which):
                    break

    def _on_ctl(self) -> None:
        try:
            data = os.read(self.ctl_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(self.ctl_fd)
            return
        self._ctl += data
        if self._ctl.count(b"\0") >= 3:
            code, cwd, exports, rest = bytes(self._ctl).split(b"\0", 3)
            self._ctl = bytearray(rest)
            if self._marker is not None and not self._marker.done():
                self._marker.set_result(
                    (
                        int(code or b"0"),
                        os.fsdecode(cwd),  # an os str: any bytes, as cd left them
                        exports.decode("utf-8", "surrogateescape"),
                    )
                )

    async def kill(self) -> None:
        if self.proc is None:
            return
        pid = self.proc.pid
        escaped = descendants(pid)
        signal_group(pid, signal.SIGKILL)
        signal_each(escaped, signal.SIGKILL)
        if self._exited is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._exited), 5.0)
            except TimeoutError:
                pass
        self.release()

    def release(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in list(self._fds.values()):
            loop.remove_reader(fd)
        self._fds = {}
        if self.ctl_fd >= 0:
            loop.remove_reader(self.ctl_fd)
            os.close(self.ctl_fd)
            self.ctl_fd = -1
        if self._exit_watch is not None:
            self._exit_watch.close()
        if self.proc is not None:
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass

    async def restart(self) -> None:
        await self.kill()
        self.restarts += 1
        await self.start(replay_exports=True)

    # -- running -----------------------------------------------------------------------
    async def run(self, args: ShellRunArgs) -> ShellRunReply:
        async with self.lock:
            if not self.alive:
                await self.restart()
            if self.pending_seed is not None:
                await self._reseed_locked()
            return await self._run_locked(args)

    async def _run_locked(self, a: ShellRunArgs, count: bool = True) -> ShellRunReply:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        self._drain_output()  # whatever background jobs wrote since the last command is not ours
        self._caps = {1: OutputCapture(a["max_output"], a["capture"]), 2: OutputCapture(a["max_output"], a["capture"])}
        infile = None
        if a["input"] is not None:
            # 0711 directory: the workload user can open its own (unguessable) file, not list others.
            indir = os.path.join(self.table.daemon.runtime_dir(), "shell-input")
            os.makedirs(indir, mode=0o711, exist_ok=True)
            os.chmod(self.table.daemon.runtime_dir(), 0o711)
            infile = os.path.join(indir, f"in-{os.urandom(12).hex()}")
            fd = os.open(infile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            ids = self.table.daemon.config.policy.workload_ids()
            if ids is not None:
                os.fchown(fd, *ids)  # bash runs as the workload user and must be able to read it
            with os.fdopen(fd, "wb") as f:
                f.write(a["input"])
        src = ansi_c_quote(infile) if infile else "/dev/null"
        self._marker = loop.create_future()
        self._last_output = time.monotonic()
        script = (
            f"__gd_cmd={ansi_c_quote(a['command'])}\n"
            f"if __gd_run < {src} {CTL_FD}>&-; then __gd_mark 0; else __gd_mark $?; fi\n"
        )
        timed_out: ShellRunTimedOut | None = None
        interrupted = False
        restarted = False
        result: tuple[int, str, str] | None = None
        try:
            await self._send(script)
            outcome = await self._wait(a["timeout_s"], a["idle_timeout_s"])
            if outcome in ("wall", "idle"):
                timed_out = outcome
                interrupted = True
                signal_group(self.pid, signal.SIGINT)  # the foreground job, and bash's trap returns
                if await self._wait(GRACE_S, None) != "done":
                    kids = descendants(self.pid)
                    signal_each(kids, signal.SIGTERM)
                    if await self._wait(GRACE_S, None) != "done":
                        signal_each(descendants(self.pid), signal.SIGKILL)
                        if await self._wait(GRACE_S, None) != "done":
                            restarted = True
            elif outcome == "exited":
                restarted = True
            if not restarted:
                assert self._marker is not None
                result = self._marker.result()
        except asyncio.CancelledError:
            # Nobody waits for the result: stop the command, keep the session for the next one.
            signal_group(self.pid, signal.SIGINT)
            raise
        finally:
            self._drain_output()
            caps, self._caps = self._caps, None
            if infile:
                try:
                    os.unlink(infile)
                except OSError:
                    pass
        if restarted:
            await self.restart()
        if count:
            self.commands += 1
        code = result[0] if result else None
        if result:
            self.cwd = result[1]
            self.exports = result[2]
        return {
            "exit_code": code,
            "timed_out": timed_out,
            "interrupted": interrupted,
            "session_restarted": restarted,
            "cwd": path_to_wire(self.cwd),
            **capture_fields(caps[1], caps[2]),
            "duration_s": time.monotonic() - t0,
        }

    async def _wait(self, timeout: float | None, idle: float | None) -> Literal["done", "exited", "wall", "idle"]:
        """'done' (status arrived), 'exited' (bash died), 'wall' or 'idle' (a timeout)."""
        assert self._marker is not None and self._exited is not None
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._marker.done():
                return "done"
            if self._exited.done():
                # The status may still be in the control pipe.
                self._on_ctl()
                return "done" if self._marker.done() else "exited"
            waits = [t for t in (None if deadline is None else deadline - loop.time(),) if t is not None]
            if idle is not None:
                waits.append(self._last_output + idle - time.monotonic())
            left = min(waits) if waits else None
            if left is not None and left <= 0:
                if deadline is not None and loop.time() >= deadline:
                    return "wall"
                return "idle"
            waitset: set[asyncio.Future[Any]] = {self._marker, self._exited}
            await asyncio.wait(waitset, timeout=left, return_when=asyncio.FIRST_COMPLETED)

    def describe(self) -> ShellInfoRecord:
        return {
            "id": self.id,
            "name": self.name,
            "pid": self.pid,
            "cwd": path_to_wire(self.cwd),
            "busy": self.lock.locked(),
            "alive": self.alive,
            "commands": self.commands,
            "restarts": self.restarts,
            "stray_bytes": self.stray_bytes,
        }


class Shells:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.sessions: dict[str, Session] = {}

    def get(self, ref: str) -> Session:
        s = self.sessions.get(ref)
        if s is None:
            for cand in self.sessions.values():
                if cand.name == ref:
                    return cand
            raise GuestdError(ErrorCode.NOT_FOUND, f"no shell session {ref!r}", details={"session": ref})
        return s

    async def create(self, cwd: str | None, env: dict[str, str] | None, name: str | None) -> Session:
        limits = self.daemon.config.limits
        if len(self.sessions) >= limits.max_shells:
            raise limit_error("max_shells", limits.max_shells, f"at most {limits.max_shells} shell sessions")
        s = Session(self, "s" + os.urandom(6).hex(), name, cwd, env)
        self.sessions[s.id] = s
        try:
            await s.start()
        except BaseException:
            self.sessions.pop(s.id, None)
            s.release()
            raise
        return s

    async def close(self, ref: str) -> None:
        s = self.get(ref)
        del self.sessions[s.id]
        await s.kill()

    async def shutdown(self) -> None:
        await asyncio.gather(*(s.kill() for s in self.sessions.values()), return_exceptions=True)
        self.sessions.clear()
