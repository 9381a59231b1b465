"""Persistent bash sessions: cd, variables, functions, aliases and venvs persist between commands.

How a command runs, without markers in the user's output:
- bash reads guestd's script on its stdin; the user's command travels as an ANSI-C
  quoted string and runs through ``eval`` in the shell itself, with stdin from
  /dev/null (or a file holding the request's input) and the control fd closed;
- when it ends, bash writes ``nonce NUL status NUL cwd NUL export -p NUL`` to a separate
  status socket (fd 63, a Unix socket with SO_PASSCRED): bytes written by any process but
  bash itself (a job of the command, which inherits bash's copies of its fds) are discarded,
  and so are bytes without the nonce, which is fresh for every command. guestd's functions
  are read-only. Everything the command wrote to stdout/stderr was written before the
  marker, so guestd drains the pipes and the output is complete, with nothing of the next
  command. (A command can still reprogram bash itself, e.g. with a DEBUG trap, and with it
  what later commands of its session do: PROTOCOL.md 10.)
- ``exit``/``logout`` are shell functions that return from the command, so
  ``exit 3`` gives status 3 and keeps the session (under ``set -o posix`` the builtin
  comes first and ends bash: bash's exit status is then the command's).
- guestd's lines do not depend on what commands set: expansions are quoted (IFS) and its
  functions are called with a backslash (no alias applies) and are read-only.
- The command runs in an ``if`` condition, so ``set -e`` cannot end the session (and has
  no effect inside it). ``builtin exit``, ``exec``, or a command that ignores SIGINT inside bash itself
  (``trap '' INT; while :; do :; done``) past its timeout end bash: the session is
  restarted with the last cwd and exported variables, and the result says so.
- guestd's functions are defined by sourcing a file named ``bash``, and the command's
  ``eval`` sits on that file's line 1: error messages and ``$LINENO`` read as they do
  with ``bash -c`` (``bash: line 1: nosuchcmd: command not found``).
- A timeout, or a cancelled request, sends SIGINT to the session's process group (bash's
  INT trap returns from the command), then kills every process of the session's cgroup
  that the command started (all but bash and what was running when the command began),
  setsid and double forks included, and as a last resort restarts bash with the last known
  cwd and exported environment. The session takes its next command only after that: a
  cancelled command never completes the next one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import time
from typing import TYPE_CHECKING, Any, Literal

from guestd.capture import OutputCapture, capture_fields
from guestd.children import PIPE, Child, KilledBy, exit_info, usage_between
from guestd.children.options import check_cwd
from guestd.children.tree import descendants, read_chunk, signal_each, signal_group, write_all
from guestd.services import derive, reseed_each
from guestd.wire.errors import ErrorCode, GuestdError, limit_error
from guestd.wire.paths import path_to_wire

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.children.cgroups import RunCgroup
    from guestd.services import Services
    from guestd.wire.types import ShellInfoRecord, ShellRunArgs, ShellRunReply, ShellRunTimedOut

CTL_FD = 63
_CREDS_SPACE = socket.CMSG_SPACE(struct.calcsize("iII"))  # struct ucred: pid, uid, gid
READ_SIZE = 256 * 1024
GRACE_S = 1.0
# A command guestd interrupted: why, as a run's killed_by
_KILLED_BY: dict[str, KilledBy] = {"wall": "timeout", "idle": "idle_timeout", "cancel": "cancel"}
MAX_CTL_BYTES = 16 * 1024 * 1024  # a marker carries `export -p`; more than this is not one

# Sourced as a file named "bash" (see the module head). Line 1 must stay the eval.
LIBRARY = rf"""__gd_run() {{ eval -- "$__gd_cmd"; }}  # not `builtin eval`: set -e would end bash
__gd_trap() {{ builtin trap 'return 130 2>/dev/null' INT; }}
__gd_trap
shopt -s expand_aliases
exit() {{ builtin return "${{1:-$?}}"; }}
logout() {{ builtin return "${{1:-$?}}"; }}
__gd_mark() {{
  __gd_trap  # a command may have replaced the INT trap; timeouts rely on it
  builtin printf '%s\0%s\0%s\0' "$2" "$1" "$PWD" >&{CTL_FD}
  builtin export -p >&{CTL_FD}; builtin printf '\0' >&{CTL_FD}
}}
builtin readonly -f __gd_run __gd_trap __gd_mark
"""


_written: set[str] = set()  # library directories this guestd has written: no re-read per session


def library_dir(runtime_dir: str) -> str:
    """A directory holding the library as ``bash``, readable by the workload user."""
    d = os.path.join(runtime_dir, "shell-lib")
    if d in _written:
        return d
    path = os.path.join(d, "bash")
    try:
        with open(path) as f:
            if f.read() == LIBRARY:
                _written.add(d)
                return d
    except OSError:
        pass
    os.makedirs(d, mode=0o755, exist_ok=True)
    os.chmod(d, 0o755)
    os.chmod(runtime_dir, 0o711)  # traversable, not listable
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(LIBRARY)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    _written.add(d)
    return d


def _sender_pid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= 12:
            return int(struct.unpack("iII", data[:12])[0])
    return None


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
        self.child: Child | None = None
        self.ctl: socket.socket | None = None  # guestd's end of the status channel
        self.lock = asyncio.Lock()
        self.commands = 0
        self.restarts = 0
        self.stray_bytes = 0  # output written between commands (background jobs); not attributed
        self.forged_bytes = 0  # control-pipe bytes without the expected nonce: discarded
        self._ctl = bytearray()
        self._nonce: bytes | None = None  # the marker guestd waits for now
        self._marker: asyncio.Future[tuple[int, str, str]] | None = None
        self._caps: dict[int, OutputCapture] | None = None
        self._last_output = 0.0
        self._fds: dict[int, int] = {}
        self.pending_seed: int | None = None  # set by a restore: a new $RANDOM seed for the next command
        self._cancel_event: asyncio.Event | None = None  # set when the running command's request is gone
        self._before: set[int] = set()  # pids in the session's cgroup when the running command began
        self.closed = False  # shell.close or shutdown: a run in progress must not restart bash

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
        return self.child.pid if self.child is not None else 0

    @property
    def alive(self) -> bool:
        return self.child is not None and self.child.running

    # -- process -----------------------------------------------------------------------
    async def start(self, replay_exports: bool = False) -> None:
        services = self.table.services
        check_cwd(self.cwd)
        env = dict(os.environ)
        env.update(self.env or {})
        env.pop("BASH_ENV", None)
        env.pop("ENV", None)
        lib = library_dir(services.runtime_dir())
        # The status channel is a Unix socket that tells guestd who wrote each byte
        # (SO_PASSCRED): only bash's own writes count, not those of processes it started.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            ours.setblocking(False)
            child = await services.children.spawn(
                ["/bin/bash", "--noprofile", "--norc", "-s"],
                kind="shell",
                env=env,
                cwd=self.cwd,
                stdin=PIPE,
                extra_fds={CTL_FD: theirs.fileno()},
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.child = child
        loop = asyncio.get_running_loop()
        self.ctl = ours
        self._ctl = bytearray()
        loop.add_reader(ours.fileno(), self._on_ctl)
        assert child.stdout is not None and child.stderr is not None
        self._fds = {1: child.stdout, 2: child.stderr}
        for which, fd in self._fds.items():
            loop.add_reader(fd, self._on_output, which)
        child.watch(poll_s=0.05)  # `alive` reads the child; waits watch child.exited
        # Source the library as "bash" from its own directory (see the module head), then
        # go back to the session's directory and leave OLDPWD as it was.
        q = ansi_c_quote
        script = (
            f'__gd_o=${{OLDPWD-}}; builtin cd -- {q(lib)} && PATH= builtin . bash; builtin cd -- "$OLDPWD"\n'
            'if [ -n "$__gd_o" ]; then OLDPWD=$__gd_o; else builtin unset OLDPWD; fi; builtin unset __gd_o\n'
        )
        if replay_exports and self.exports:
            script += self.exports + "\n"  # a restarted session keeps its exported environment
        nonce = self._expect()
        script += f"\\__gd_mark 0 '{nonce}'\n"
        try:
            await asyncio.wait_for(self._send(script), 30.0)
            await asyncio.wait_for(asyncio.shield(self._marker_future()), 30.0)
        except (TimeoutError, OSError):
            await self.kill()
            raise GuestdError(ErrorCode.UNAVAILABLE, "bash did not start within 30 s") from None
        except BaseException:  # cancelled: the session is not made, so neither is its bash
            await asyncio.shield(self.kill())
            raise

    def _expect(self) -> str:
        """A fresh nonce for the next marker, and a fresh future for it."""
        nonce = os.urandom(16).hex()
        self._nonce = nonce.encode()
        self._marker = asyncio.get_running_loop().create_future()
        self._on_ctl_data()  # bytes that arrived before (none of them can carry the new nonce)
        return nonce

    def _marker_future(self) -> asyncio.Future[tuple[int, str, str]]:
        assert self._marker is not None
        return self._marker

    async def _send(self, text: str) -> None:
        assert self.child is not None and self.child.stdin is not None
        await write_all(asyncio.get_running_loop(), self.child.stdin, text.encode("utf-8", "surrogateescape"))

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
        if self.ctl is None:
            return
        try:
            data, ancillary, _flags, _addr = self.ctl.recvmsg(65536, _CREDS_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancillary = b"", []
        if not data:
            asyncio.get_running_loop().remove_reader(self.ctl.fileno())
            return
        if _sender_pid(ancillary) != self.pid:
            self.forged_bytes += len(data)  # a process the command started, not bash
            return
        self._ctl += data
        self._on_ctl_data()

    def _on_ctl_data(self) -> None:
        """Find the marker with the expected nonce; everything before it is not ours to believe."""
        nonce = self._nonce
        if nonce is None or self._marker is None or self._marker.done():
            self.forged_bytes += len(self._ctl)
            self._ctl = bytearray()
            return
        token = nonce + b"\0"
        at = self._ctl.find(token)
        if at < 0:
            keep = len(token) - 1  # the token may be cut between two reads
            if len(self._ctl) > keep:
                self.forged_bytes += len(self._ctl) - keep
                del self._ctl[:-keep]
            return
        if at:
            self.forged_bytes += at
            del self._ctl[:at]
        fields = bytes(self._ctl[len(token) :]).split(b"\0", 3)
        if len(fields) < 4:
            if len(self._ctl) > MAX_CTL_BYTES:
                self.forged_bytes += len(self._ctl)
                self._ctl = bytearray()  # never completes: the command's timeout ends it
            return
        code, cwd, exports, rest = fields
        self._ctl = bytearray(rest)
        self._nonce = None
        try:
            status = int(code or b"0")
        except ValueError:
            status = 1
        self._marker.set_result(
            (
                status,
                os.fsdecode(cwd),  # an os str: any bytes, as cd left them
                exports.decode("utf-8", "surrogateescape"),
            )
        )

    async def kill(self) -> None:
        """End bash and everything of the session, then drop its fds."""
        child = self.child
        if child is None:
            return
        child.kill_now()
        try:
            await asyncio.wait_for(asyncio.shield(child.exited), 5.0)
        except TimeoutError:
            pass
        self.release()

    def release(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in list(self._fds.values()):
            loop.remove_reader(fd)
        self._fds = {}
        if self.ctl is not None:
            loop.remove_reader(self.ctl.fileno())
            self.ctl.close()
            self.ctl = None
        if self.child is not None:
            self.child.release()

    async def restart(self) -> None:
        await self.kill()
        self.restarts += 1
        await self.start(replay_exports=True)

    # -- running -----------------------------------------------------------------------
    async def run(self, args: ShellRunArgs) -> ShellRunReply:
        # The command runs in a task of its own that holds the session until the command has
        # really ended: a cancelled request interrupts it (as a timeout does) and the session
        # takes its next command only after that.
        cancel = asyncio.Event()
        task = asyncio.ensure_future(self._run_serialized(args, cancel))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            cancel.set()
            task.add_done_callback(_consume)
            raise

    async def _run_serialized(self, args: ShellRunArgs, cancel: asyncio.Event) -> ShellRunReply:
        async with self.lock:
            if cancel.is_set():
                raise asyncio.CancelledError  # cancelled while waiting for the session: never ran
            if self.closed:
                raise GuestdError(
                    ErrorCode.NOT_FOUND, f"shell session {self.id} was closed", details={"session": self.id}
                )
            if not self.alive:
                await self.restart()
            if self.pending_seed is not None:
                await self._reseed_locked()
            self._cancel_event = cancel
            try:
                return await self._run_locked(args)
            finally:
                self._cancel_event = None

    async def _run_locked(self, a: ShellRunArgs, count: bool = True) -> ShellRunReply:
        t0 = time.monotonic()
        self._drain_output()  # whatever background jobs wrote since the last command is not ours
        self._caps = {1: OutputCapture(a["max_output"], a["capture"]), 2: OutputCapture(a["max_output"], a["capture"])}
        infile = None
        if a["input"] is not None:
            # 0711 directory: the workload user can open its own (unguessable) file, not list others.
            indir = os.path.join(self.table.services.runtime_dir(), "shell-input")
            os.makedirs(indir, mode=0o711, exist_ok=True)
            os.chmod(self.table.services.runtime_dir(), 0o711)
            infile = os.path.join(indir, f"in-{os.urandom(12).hex()}")
            fd = os.open(infile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            ids = self.table.services.config.policy.workload_ids()
            if ids is not None:
                os.fchown(fd, *ids)  # bash runs as the workload user and must be able to read it
            with os.fdopen(fd, "wb") as f:
                f.write(a["input"])
        src = ansi_c_quote(infile) if infile else "/dev/null"
        self._last_output = time.monotonic()
        assert self.child is not None
        # What runs in the session now (bash, jobs of earlier commands): a timeout or cancel of
        # this command ends everything else in the session's cgroup, wherever it went.
        self._before = set(self.child.cgroup.pids()) if self.child.cgroup is not None else set()
        usage_before, ran_in = self.child.usage_now(), self.child
        nonce = self._expect()
        # What earlier commands set must not bend this line: every expansion is quoted (IFS),
        # guestd's functions are called as \name (no alias applies; they are read-only).
        script = (
            f"__gd_cmd={ansi_c_quote(a['command'])}\n"
            f"if \\__gd_run < {src} {CTL_FD}>&-; then \\__gd_mark 0 '{nonce}'; "
            f"else \\__gd_mark \"$?\" '{nonce}'; fi\n"
        )
        timed_out: ShellRunTimedOut | None = None
        interrupted = False
        restarted = False
        result: tuple[int, str, str] | None = None
        outcome = None
        bash_status: int | None = None
        # The script goes in while the deadline runs: a bash that does not read (stopped by a
        # job, busy) must not hold the session past the command's timeout.
        send = asyncio.ensure_future(self._send(script))
        try:
            outcome = await self._wait(a["timeout_s"], a["idle_timeout_s"])
            if outcome in ("wall", "idle", "cancel"):
                if outcome != "cancel":
                    timed_out = outcome
                interrupted = True
                restarted = not await self._interrupt()
                if not restarted and self.child.cgroup is not None:
                    await self._kill_command_processes(self.child.cgroup)
            elif outcome == "exited":
                restarted = True
                bash_status = self.child.status
            if not send.done() or send.cancelled() or send.exception() is not None:
                restarted = True  # bash got part of the script at most: it cannot be trusted in step
            if not restarted:
                result = self._marker_future().result()
        finally:
            if not send.done():
                send.cancel()
            send.add_done_callback(_consume)
            self._drain_output()
            caps, self._caps = self._caps, None
            if infile:
                try:
                    os.unlink(infile)
                except OSError:
                    pass
        usage_after = ran_in.usage_now()
        if restarted and not self.closed:
            await self.restart()
        if count:
            self.commands += 1
        code = result[0] if result else None
        if outcome == "exited" and bash_status is not None:
            # bash itself ended during the command (`builtin exit 3`, `exec prog`, or `exit 3`
            # under `set -o posix`, where the builtin comes before guestd's function): its
            # exit status is the command's, as with `bash -c`.
            code = exit_info(bash_status)["exit_code"]
        why: KilledBy | None = _KILLED_BY.get(outcome or "")
        if outcome == "exited":
            why = ran_in.exit_info()["killed_by"]
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
            **usage_between(usage_before, usage_after, why, code),
        }

    async def _interrupt(self) -> bool:
        """Stop the running command, escalating; True when bash is back at its prompt."""
        child = self.child
        assert child is not None
        signal_group(self.pid, signal.SIGINT)  # the foreground job, and bash's trap returns
        signal_group(self.pid, signal.SIGCONT)  # a bash (or job) the workload stopped must wake for it
        if await self._wait(GRACE_S, None, cancellable=False) == "done":
            return True
        # What the command started, wherever it went (session jobs of earlier commands stay).
        if child.cgroup is not None:
            await self._kill_command_processes(child.cgroup)
        else:
            signal_each(descendants(self.pid), signal.SIGTERM)
            if await self._wait(GRACE_S, None, cancellable=False) == "done":
                return True
            signal_each(descendants(self.pid), signal.SIGKILL)
        return await self._wait(GRACE_S, None, cancellable=False) == "done"

    async def _kill_command_processes(self, cg: RunCgroup) -> None:
        """Freeze, kill, thaw (it waits for the freeze): off the event loop."""
        await self.table.services.run_in_io(cg.kill_except, self._before | {self.pid})

    async def _wait(
        self, timeout: float | None, idle: float | None, cancellable: bool = True
    ) -> Literal["done", "exited", "wall", "idle", "cancel"]:
        """'done' (status arrived), 'exited' (bash died), 'wall' or 'idle' (a timeout), or
        'cancel' (the request went away)."""
        marker = self._marker_future()
        assert self.child is not None
        exited = self.child.exited
        cancel = self._cancel_event if cancellable else None
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        cancel_wait: asyncio.Task[Any] | None = None
        try:
            while True:
                if marker.done():
                    return "done"
                if exited.done():
                    # The status may still be in the control pipe.
                    self._on_ctl()
                    return "done" if marker.done() else "exited"
                if cancel is not None and cancel.is_set():
                    return "cancel"
                waits = [t for t in (None if deadline is None else deadline - loop.time(),) if t is not None]
                if idle is not None:
                    waits.append(self._last_output + idle - time.monotonic())
                left = min(waits) if waits else None
                if left is not None and left <= 0:
                    if deadline is not None and loop.time() >= deadline:
                        return "wall"
                    return "idle"
                waitset: set[asyncio.Future[Any]] = {marker, exited}
                if cancel is not None:
                    if cancel_wait is None:
                        cancel_wait = asyncio.ensure_future(cancel.wait())
                    waitset.add(cancel_wait)
                await asyncio.wait(waitset, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if cancel_wait is not None:
                cancel_wait.cancel()

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


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a result nobody waits for any more; never "exception never retrieved"


class Shells:
    def __init__(self, services: Services) -> None:
        self.services = services
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
        if name is not None:
            for other in self.sessions.values():
                if other.name == name:
                    raise GuestdError(
                        ErrorCode.EXISTS,
                        f"a shell session named {name!r} exists: {other.id}",
                        details={"session": other.id, "field": "name"},
                    )
        limits = self.services.config.limits
        if len(self.sessions) >= limits.max_shells:
            raise limit_error("max_shells", limits.max_shells, f"at most {limits.max_shells} shell sessions")
        s = Session(self, "s" + os.urandom(6).hex(), name, cwd, env)
        self.sessions[s.id] = s
        try:
            await s.start()  # ends its bash itself when it fails or is cancelled
        except BaseException:
            self.sessions.pop(s.id, None)
            raise
        return s

    async def close(self, ref: str) -> None:
        s = self.get(ref)
        del self.sessions[s.id]
        s.closed = True
        await s.kill()

    async def shutdown(self) -> None:
        for s in self.sessions.values():
            s.closed = True
        await asyncio.gather(*(s.kill() for s in self.sessions.values()), return_exceptions=True)
        self.sessions.clear()

    def busy(self) -> dict[str, list[str]]:
        return {"busy_shells": [s.id for s in self.sessions.values() if s.lock.locked()]}

    async def reseed(self, entropy: bytes) -> dict[str, list[str]]:
        """After a restore: a new $RANDOM seed in every session (busy ones before their next command)."""

        def give(s: Session) -> None:
            s.pending_seed = int.from_bytes(derive(entropy, "sh:" + s.id, 4), "big") & 0x7FFF_FFFF

        done, pending, errors = await reseed_each(list(self.sessions.values()), give)
        return {"shells_reseeded": done, "shells_pending": pending, "reseed_errors": errors}
