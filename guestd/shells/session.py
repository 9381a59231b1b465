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
import contextlib
import functools
import os
import signal
import socket
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from guestd.capture import OutputCapture, OutputRing, capture_fields_off_loop
from guestd.children import DEVNULL, PIPE, Child, KilledBy, exit_info, usage_between
from guestd.children.options import build_env, check_cwd, parse_signal
from guestd.children.tree import descendants, read_chunk, set_winsize, signal_each, signal_group, write_all
from guestd.services import derive, reseed_each, to_the_end
from guestd.shells.job import STATUS_MAX, JobFifos, PtyInput, ShellJob, StdinFifo
from guestd.spill import Spill, abandon, finish, give_away_spills, open_spills
from guestd.wire.errors import ErrorCode, GuestdError, limit_error
from guestd.wire.paths import path_to_wire

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.children.cgroups import RunCgroup
    from guestd.services import Request, Services
    from guestd.wire.types import ShellInfoRecord, ShellRunArgs, ShellRunReply, ShellRunTimedOut

CTL_FD = 63
_CREDS_SPACE = socket.CMSG_SPACE(struct.calcsize("iII"))  # struct ucred: pid, uid, gid
READ_SIZE = 256 * 1024
_STREAM_FIELDS = {1: {"ev": "stdout"}, 2: {"ev": "stderr"}}
GRACE_S = 1.0
# A command guestd interrupted: why, as a run's killed_by
_KILLED_BY: dict[str, KilledBy] = {"wall": "timeout", "idle": "idle_timeout", "cancel": "cancel"}
MAX_CTL_BYTES = 16 * 1024 * 1024  # a marker carries `export -p`; more than this is not one
DETACH_RING_BYTES = 1024 * 1024  # per stream, as process.start's default ring_bytes
# A job's status FIFO as read for its pid: the workload can write into it as well; past this
# much, it has only kept its own job from being signalled or resized.
STATUS_SCAN_MAX = 4096

# Sourced as a file named "bash" (see the module head). Line 1 must stay the eval.
# Line 1 of the library: the eval of a plain command, and the job of an on_timeout "detach"
# command (job.py). Not `builtin eval`: set -e would end bash.
_LINE1 = (
    '__gd_run() { eval -- "$__gd_cmd"; }; '
    "__gd_job() { builtin set -m; { ( builtin trap : INT TERM HUP QUIT; builtin printf '%s\\n' \"$BASHPID\" >&9; "
    '( builtin unset -f exit logout; eval -- "$__gd_cmd" ) 9>&-; __gd_s=$?; '
    'builtin printf \'%s\\n\' "$__gd_s" >&9; builtin exit "$__gd_s" ) & } '
    '>"$1" 2>"$2" 9>"$3" <"$4"; builtin set +m; '
    # Interrupted (on_timeout detach): the job leaves bash's job table, so bash never reports
    # its end ("Killed") into a later command's stderr. __gd_mark restores the usual trap.
    "builtin trap 'builtin disown -- \"$!\" 2>/dev/null; return 130 2>/dev/null' INT; "
    'builtin wait "$!"; }\n'
)
LIBRARY = (
    _LINE1
    + rf"""__gd_trap() {{ builtin trap 'return 130 2>/dev/null' INT; }}
__gd_trap
shopt -s expand_aliases
exit() {{ builtin return "${{1:-$?}}"; }}
logout() {{ builtin return "${{1:-$?}}"; }}
__gd_mark() {{
  __gd_trap  # a command may have replaced the INT trap; timeouts rely on it
  builtin printf '%s\0%s\0%s\0' "$2" "$1" "$PWD" >&{CTL_FD}
  builtin export -p >&{CTL_FD}; builtin printf '\0' >&{CTL_FD}
}}
builtin readonly -f __gd_run __gd_job __gd_trap __gd_mark
"""
)


_written: set[str] = set()  # library directories this guestd has written: no re-read per session


def library_dir(runtime_dir: str) -> str:
    """A directory holding the library as ``bash``, readable by the workload user. Named by
    the library's hash: guestds of other versions sharing the runtime dir never swap it."""
    import hashlib

    d = os.path.join(runtime_dir, "shell-lib-" + hashlib.sha256(LIBRARY.encode()).hexdigest()[:16])
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
        # on_timeout "detach": the running command's job (FIFOs, rings from byte 0, status bytes)
        self._job: JobFifos | None = None
        self._job_rings: dict[int, OutputRing] = {}
        self._job_status = bytearray()
        self._job_pid_seen: int | None = None
        self._stream: Request | None = None  # stream mode: the running command's request
        self._paused: asyncio.Task[None] | None = None  # reading paused for a streaming client

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
                "report_changes": False,
                "on_timeout": "kill",
                "merge_stderr": False,
                "check_syntax": False,
                "stream": False,
                "stdin_stream": False,
                "pty": False,
                "rows": 24,
                "cols": 80,
                "keep": False,
                "spill": False,
                "strip_ansi": False,
                "collapse_cr": False,
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
        env = build_env(self.env, "merge", services.config.policy.workload_ids()) or dict(os.environ)
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
        False when nothing is ready, the pipe has ended, or a streaming client is out of credit."""
        fd = self._fds.get(which)
        if fd is None:
            return False
        size = self._read_size(which)
        if size <= 0:
            return False
        data = read_chunk(fd, size)
        if data is None:
            return False
        if not data:
            asyncio.get_running_loop().remove_reader(fd)
            del self._fds[which]
            return False
        self._last_output = time.monotonic()
        if self._caps is not None:
            self._take(which, data)
        else:
            self.stray_bytes += len(data)
        return True

    def _read_size(self, which: int) -> int:
        """READ_SIZE, or in stream mode no more than one event within the client's credit can
        carry (0: out of credit; reading pauses until the client grants more)."""
        ctx = self._stream
        if ctx is None or self._caps is None:
            return READ_SIZE
        room = min(READ_SIZE, ctx.data_room(_STREAM_FIELDS[which])) if ctx.active else READ_SIZE
        if room <= 0:
            self._wait_for_client(ctx)
        return room

    def _take(self, which: int, data: bytes) -> None:
        assert self._caps is not None
        ctx = self._stream
        if ctx is None or not ctx.active:
            self._caps[which].feed(data)
            return
        self._caps[which].total += len(data)  # streamed, not kept: only counted
        ctx.push_data(_STREAM_FIELDS[which], data)
        if ctx.data_room(_STREAM_FIELDS[which]) <= 0 or ctx.write_paused:
            self._wait_for_client(ctx)

    def _output_fds(self) -> list[tuple[int, Callable[[], object]]]:
        out: list[tuple[int, Callable[[], object]]] = [
            (fd, functools.partial(self._on_output, which)) for which, fd in self._fds.items()
        ]
        if self._job is not None:
            for which, name in ((1, "stdout"), (2, "stderr")):
                if name in self._job.read:
                    out.append((self._job.read[name], functools.partial(self._read_job, which)))
        return out

    def _wait_for_client(self, ctx: Request) -> None:
        """The streaming client is behind: stop reading, so the command blocks on its pipe
        instead of guestd buffering without bound; read on once it grants credit."""
        if self._paused is not None:
            return
        loop = asyncio.get_running_loop()
        for fd, _cb in self._output_fds():
            loop.remove_reader(fd)

        async def resume() -> None:
            await ctx.wait_credit()
            await ctx.drain()
            if self._paused is asyncio.current_task():
                self._paused = None
                self._read_again()

        self._paused = loop.create_task(resume())

    def _resume_reading(self) -> None:
        task, self._paused = self._paused, None
        if task is None:
            return
        task.cancel()
        self._read_again()

    def _read_again(self) -> None:
        loop = asyncio.get_running_loop()
        for fd, cb in self._output_fds():
            loop.add_reader(fd, cb)

    async def _drain_stream(self) -> None:
        """Stream mode, the command has ended: what is still in the pipes (at most their
        buffers) goes to the client within its credit, waiting for credit while it is there."""
        ctx = self._stream
        if ctx is None:
            return
        self._resume_reading()
        sources = [(w, self._read_once) for w in (1, 2)] + [(w, self._read_job) for w in (1, 2)]
        for which, read in sources:
            for _ in range(64):
                if ctx.active and ctx.data_room(_STREAM_FIELDS[which]) <= 0:
                    await ctx.wait_credit()
                    self._resume_reading()
                    continue
                if not read(which):
                    break
        self._resume_reading()

    def _drain_output(self) -> None:
        """Read whatever is in the pipes right now (bounded: at most 64 reads per stream)."""
        for which in list(self._fds):
            for _ in range(64):
                if not self._read_once(which):
                    break
        for which in (1, 2):
            for _ in range(64):
                if not self._read_job(which):
                    break
        self._read_job_status()

    def _read_job(self, which: int) -> bool:
        """One read from the job's stdout/stderr FIFO: to the capture and to the ring."""
        job = self._job
        fd = job.read.get("stdout" if which == 1 else "stderr") if job is not None else None
        if fd is None:
            return False
        size = self._read_size(which)
        if size <= 0:
            return False
        data = read_chunk(fd, size)
        if not data:
            return False  # the end is seen at close(): guestd holds a write end until then
        self._last_output = time.monotonic()
        self._job_rings[which].write(data)
        if self._caps is not None:
            self._take(which, data)
        return True

    def _read_job_status(self) -> None:
        job = self._job
        fd = job.read.get("status") if job is not None else None
        if fd is None:
            return
        data = read_chunk(fd, STATUS_SCAN_MAX)
        if data and len(self._job_status) < STATUS_SCAN_MAX:
            self._job_status += data[: STATUS_SCAN_MAX - len(self._job_status)]
        if self._job_pid_seen is None and data:
            self._job_pid_seen = self._find_job_pid()

    def _start_job(self, pty: tuple[int, int] | None = None) -> JobFifos:
        services = self.table.services
        d = os.path.join(services.runtime_dir(), "shell-job")
        os.makedirs(d, mode=0o711, exist_ok=True)  # traversable, not listable: names are secrets
        os.chmod(d, 0o711)
        os.chmod(services.runtime_dir(), 0o711)
        job = JobFifos(d, services.config.policy.workload_ids(), pty=pty)
        self._job = job
        size = min(DETACH_RING_BYTES, services.config.limits.max_ring_bytes)
        self._job_rings = {1: OutputRing(size), 2: OutputRing(size)}
        self._job_status = bytearray()
        self._job_pid_seen = None
        loop = asyncio.get_running_loop()
        loop.add_reader(job.read["stdout"], self._read_job, 1)
        if "stderr" in job.read:
            loop.add_reader(job.read["stderr"], self._read_job, 2)
        loop.add_reader(job.read["status"], self._read_job_status)
        return job

    def _stop_job(self, give_away: bool) -> JobFifos | None:
        """Stop reading the job's FIFOs; closed now, or kept for the process table."""
        job, self._job = self._job, None
        if job is None:
            return None
        loop = asyncio.get_running_loop()
        for fd in job.read.values():
            loop.remove_reader(fd)
        if give_away:
            job.opened()
            return job
        job.close()
        return None

    def _job_pid(self) -> int | None:
        """The running job's pid (its process group), once its status FIFO has named it."""
        if self._job_pid_seen is None and self._job is not None:
            self._read_job_status()
        return self._job_pid_seen

    def _find_job_pid(self) -> int | None:
        """The first pid in the status FIFO that is a child of the session's bash leading its
        own process group. The workload can write into that FIFO too (through
        /proc/<bash>/fd/9 while bash holds it), and guestd (root) signals the pid's group and
        moves its processes: a pid is never taken on the FIFO's word alone. Checked while the
        job runs (it writes its pid first), and kept: its group may outlive it."""
        for line in bytes(self._job_status).split(b"\n")[:-1]:
            if line.isdigit() and _leads_a_group_under(int(line), self.pid):
                return int(line)
        return None

    def _job_status_from_pid(self) -> bytes:
        """The status FIFO's bytes from the job's own pid line on (what the workload wrote
        before it is not the job's)."""
        buf = bytes(self._job_status)
        if self._job_pid_seen is not None:
            line = f"{self._job_pid_seen}\n".encode()
            at = buf.find(b"\n" + line)
            buf = buf if buf.startswith(line) or at < 0 else buf[at + 1 :]
        return buf[:STATUS_MAX]

    async def _detach_job(self, command: str, stdin: StdinFifo | None) -> str | None:
        """bash is back at its prompt and the job runs on: move its processes (frozen, wherever
        they went) to a leaf of their own and give it to the process table."""
        services = self.table.services
        self._drain_output()
        pid = self._job_pid()
        adopter = services.adopter
        if pid is None or adopter is None or self.child is None:
            return None
        leaf = None
        cg = self.child.cgroup
        if cg is not None:
            leaf = services.workload.new_run("proc", os.urandom(6).hex())
            if leaf is not None:
                await services.run_in_io(cg.move_except, self._before | {self.pid}, leaf)
                # Known to guestd.children from now on (after the move: the sweep removes empty
                # leaves): guestd's stop ends it, the sweep removes it once its job is gone.
                services.children.lingering.add(leaf)
        self._drain_output()  # output up to the hand-over is the reply's too
        fifos = self._stop_job(give_away=True)
        assert fifos is not None
        out, err, status = fifos.read["stdout"], fifos.read["stderr"], fifos.read["status"]
        given = stdin.give_write() if stdin else None
        job = ShellJob(pid, status, self._job_status_from_pid(), leaf, [out, err], given)
        job.keep_lingering(services.children.lingering)
        rings = {"stdout": self._job_rings[1], "stderr": self._job_rings[2]}
        spills = give_away_spills(self._caps[1], self._caps[2]) if self._caps is not None else None
        return adopter.adopt(command, job, {"stdout": out, "stderr": err}, rings, spills)

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
        """End bash and everything of the session, then drop its fds: all of it, also when the
        request that asked is cancelled while bash is slow to die (asleep in the kernel)."""
        await to_the_end(self._kill())

    async def _kill(self) -> None:
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
    async def run(self, args: ShellRunArgs, ctx: Request | None = None) -> ShellRunReply:
        if args["pty"] and (args["input"] is not None or args["stdin_stream"] or args["on_timeout"] == "detach"):
            raise GuestdError(
                ErrorCode.BAD_REQUEST,
                "pty: input comes from INPUT frames (no input or stdin_stream) and on_timeout is kill",
                details={"field": "pty"},
            )
        if args["spill"] and args["stream"]:
            raise GuestdError(ErrorCode.BAD_REQUEST, "spill: not with stream", details={"field": "spill"})
        if args["check_syntax"]:
            await check_syntax(self.table.services, args["command"])
        # The command runs in a task of its own that holds the session until the command has
        # really ended: a cancelled request interrupts it (as a timeout does) and the session
        # takes its next command only after that.
        cancel = asyncio.Event()
        task = asyncio.ensure_future(self._run_serialized(args, cancel, ctx))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            cancel.set()
            task.add_done_callback(_consume)
            raise

    async def _run_serialized(self, args: ShellRunArgs, cancel: asyncio.Event, ctx: Request | None) -> ShellRunReply:
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
            spills = await open_spills(self.table.services, "shell") if args["spill"] else None
            try:
                reply = await self._run_locked(args, ctx=ctx, spills=spills)
                spills, kept = None, spills
                return await finish(reply, kept)  # type: ignore[no-any-return]
            finally:
                abandon(spills)
                self._cancel_event = None

    async def _run_locked(
        self, a: ShellRunArgs, count: bool = True, ctx: Request | None = None, spills: tuple[Spill, Spill] | None = None
    ) -> ShellRunReply:
        t0 = time.monotonic()
        adopter = self.table.services.adopter
        pty = a["pty"]
        detach = (
            not pty
            and a["on_timeout"] == "detach"
            and (a["timeout_s"] is not None or a["idle_timeout_s"] is not None)
            and adopter is not None
        )
        if detach:
            assert adopter is not None
            adopter.check()  # a full process table is a limit error now, not at the timeout
        self._drain_output()  # whatever background jobs wrote since the last command is not ours
        self._caps = {1: OutputCapture(a["max_output"], a["capture"]), 2: OutputCapture(a["max_output"], a["capture"])}
        if spills is not None:
            self._caps[1].spill, self._caps[2].spill = spills
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
        stdin: StdinFifo | None = None
        feeder: asyncio.Task[None] | None = None
        assert self.child is not None
        job = self._start_job((a["rows"], a["cols"]) if pty else None) if detach or pty else None
        pty_input: PtyInput | None = None
        if job is not None and job.master is not None:
            # pty: stdin, stdout and stderr are the terminal (one stream, as a terminal shows
            # it: stdout); INPUT data is typed into it, INPUT signals go to the job's group.
            pty_input = PtyInput(job.master)
            src = "/dev/null"
            if ctx is not None:
                feeder = asyncio.get_running_loop().create_task(_feed_stdin(ctx, pty_input))
                ctx.handle_signals(self._signal_job)
        elif a["stdin_stream"] and ctx is not None:
            indir = os.path.join(self.table.services.runtime_dir(), "shell-input")
            os.makedirs(indir, mode=0o711, exist_ok=True)
            os.chmod(self.table.services.runtime_dir(), 0o711)
            stdin = StdinFifo(indir, self.table.services.config.policy.workload_ids())
            feeder = asyncio.get_running_loop().create_task(_feed_stdin(ctx, stdin))
            src = ansi_c_quote(stdin.path)
        else:
            if ctx is not None:
                ctx.stop_taking_data()  # INPUT data and eof mean nothing without stdin_stream
            src = ansi_c_quote(infile) if infile else "/dev/null"
        self._stream = ctx if a["stream"] and ctx is not None else None
        self._last_output = time.monotonic()
        # What runs in the session now (bash, jobs of earlier commands): a timeout or cancel of
        # this command ends everything else in the session's cgroup, wherever it went.
        self._before = set(self.child.cgroup.pids()) if self.child.cgroup is not None else set()
        usage_before, ran_in = self.child.usage_now(), self.child
        nonce = self._expect()
        # What earlier commands set must not bend this line: every expansion is quoted (IFS),
        # guestd's functions are called as \name (no alias applies; they are read-only).
        merge = a["merge_stderr"]
        if job is None:
            run = f"\\__gd_run < {src} {CTL_FD}>&-" + (" 2>&1" if merge else "")
        else:
            q = ansi_c_quote
            paths = job.paths
            err = paths["stdout"] if merge else paths["stderr"]  # opened twice: one FIFO, write order
            run = f"\\__gd_job {q(paths['stdout'])} {q(err)} {q(paths['status'])} {src} {CTL_FD}>&-"
        command = a["command"]
        if job is not None and job.master is not None:  # in the job's subshell only (job.py)
            tty = ansi_c_quote(job.tty)
            term = "[[ ${TERM:-dumb} != dumb ]] || builtin export TERM=xterm-256color"
            command = f"{term}; {{\n{command}\n}} <{tty} >{tty} 2>&1"
        script = (
            f"__gd_cmd={ansi_c_quote(command)}\n"
            f"if {run}; then \\__gd_mark 0 '{nonce}'; "
            f"else \\__gd_mark \"$?\" '{nonce}'; fi\n"
        )
        timed_out: ShellRunTimedOut | None = None
        interrupted = False
        restarted = False
        result: tuple[int, str, str] | None = None
        outcome = None
        bash_status: int | None = None
        detached: str | None = None
        # The script goes in while the deadline runs: a bash that does not read (stopped by a
        # job, busy) must not hold the session past the command's timeout.
        send = asyncio.ensure_future(self._send(script))
        try:
            outcome = await self._wait(a["timeout_s"], a["idle_timeout_s"])
            if outcome in ("wall", "idle") and detach and job is not None and await self._release_bash():
                timed_out = outcome
                detached = await self._detach_job(a["command"], stdin)
            elif outcome in ("wall", "idle", "cancel"):
                if outcome != "cancel":
                    timed_out = outcome
                interrupted = True
                restarted = not await self._interrupt()
                if not restarted and self.child.cgroup is not None:
                    await self._kill_command_processes(self.child.cgroup)
                elif job is not None and self.child.cgroup is None:
                    # No leaf to empty: the job's own group (a terminal job is not in bash's)
                    # ends now, not after its output has reached a client that may never read.
                    pid = self._job_pid()
                    if pid is not None:
                        signal_group(pid, signal.SIGKILL)
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
            if feeder is not None:
                feeder.cancel()
            if ctx is not None:
                ctx.stop_taking_data()
            if stdin is not None and detached is None:
                stdin.close()
            if pty_input is not None:
                pty_input.close()
            with contextlib.suppress(Exception):
                await asyncio.shield(self._drain_stream())  # within the client's credit
            self._stream = None
            self._resume_reading()
            self._drain_output()
            if detached is None and job is not None:
                pid = self._job_pid()
                self._stop_job(give_away=False)
                if pid is not None and interrupted and self.child.cgroup is None:
                    signal_group(pid, signal.SIGKILL)  # no leaf to empty: the job's own group
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
        code = result[0] if result and detached is None else None  # a detached job still runs
        if outcome == "exited" and bash_status is not None:
            # bash itself ended during the command (`builtin exit 3`, `exec prog`, or `exit 3`
            # under `set -o posix`, where the builtin comes before guestd's function): its
            # exit status is the command's, as with `bash -c`.
            code = exit_info(bash_status)["exit_code"]
        why: KilledBy | None = _KILLED_BY.get(outcome or "")
        if outcome == "exited":
            why = ran_in.exit_info()["killed_by"]
        if detached is not None:
            why = None  # not ended: it goes on as a background process
        if result:
            self.cwd = result[1]
            self.exports = result[2]
        return {
            "exit_code": code,
            "timed_out": timed_out,
            "interrupted": interrupted,
            "session_restarted": restarted,
            "cwd": path_to_wire(self.cwd),
            **await capture_fields_off_loop(  # shaping may take a worker thread
                caps[1],
                caps[2],
                streamed=a["stream"] and ctx is not None,
                strip_ansi=a["strip_ansi"],
                collapse_cr=a["collapse_cr"],
            ),  # "changes": the handler adds it
            "duration_s": time.monotonic() - t0,
            "detached": detached,
            **usage_between(usage_before, usage_after, why, code),  # type: ignore[typeddict-item]  # "changes": the handler adds it
        }

    def resize(self, rows: int, cols: int) -> None:
        """shell.resize: the running pty command's terminal size; its process group gets
        SIGWINCH (the terminal is no controlling terminal, so the kernel sends none)."""
        job = self._job
        if job is None or job.master is None:
            raise GuestdError(
                ErrorCode.BAD_REQUEST, f"no pty command runs in shell session {self.id}", details={"session": self.id}
            )
        set_winsize(job.master, rows, cols)
        self._read_job_status()
        pid = self._job_pid()
        if pid is not None:
            signal_group(pid, signal.SIGWINCH)

    def _signal_job(self, value: Any) -> None:
        """pty mode, an INPUT signal: to the job's process group (the program in the
        foreground of the command; the session's bash is in a group of its own)."""
        sig = parse_signal(value)
        self._read_job_status()  # the pid line may still be in the FIFO
        pid = self._job_pid()
        if sig is not None and pid is not None and self._job is not None:
            signal_group(pid, sig)

    async def _release_bash(self) -> bool:
        """on_timeout "detach": SIGINT to bash alone (its job has a process group of its own):
        its ``wait`` returns and it is back at its prompt, the job runs on. False when bash did
        not come back (the usual interrupt then ends the command)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGINT)
            os.kill(self.pid, signal.SIGCONT)
        return await self._wait(GRACE_S, None, cancellable=False) == "done"

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


SYNTAX_TIMEOUT_S = 10.0
SYNTAX_MESSAGE_MAX = 64 * 1024


async def check_syntax(services: Services, command: str) -> None:
    """``bash -n`` on the command text in a run of its own (never the session's bash, which
    would run it): a syntax error is ``bad_request`` with bash's message (details.stage
    ``syntax``). extglob is on, so a pattern the session may allow is not rejected; aliases
    of the session are not known to it (PROTOCOL.md 10)."""
    child = await services.children.spawn(
        ["bash", "--noprofile", "--norc", "-O", "extglob", "-n"], kind="exec", stdin=PIPE, stdout=DEVNULL
    )
    loop = asyncio.get_running_loop()
    message = bytearray()
    ended = loop.create_future()
    fd = child.stderr
    assert fd is not None and child.stdin is not None

    def on_err() -> None:
        data = read_chunk(fd, 65536)
        if data is None:
            return
        if not data:
            loop.remove_reader(fd)
            if not ended.done():
                ended.set_result(None)
            return
        message.extend(data[: max(0, SYNTAX_MESSAGE_MAX - len(message))])

    loop.add_reader(fd, on_err)
    child.watch(poll_s=0.01)
    try:
        async with asyncio.timeout(SYNTAX_TIMEOUT_S):
            await write_all(loop, child.stdin, command.encode("utf-8", "surrogateescape"))
            child.close_fd("stdin")
            await ended
            await child.exited
    except TimeoutError:
        raise GuestdError(
            ErrorCode.TIMEOUT,
            f"bash -n did not finish within {SYNTAX_TIMEOUT_S:g} s",
            details={"stage": "syntax"},
        ) from None
    finally:
        loop.remove_reader(fd)
        if child.running:
            child.kill_now()
        child.release()
    code = exit_info(child.status)["exit_code"]
    if code != 0:
        text = bytes(message).decode("utf-8", "replace")
        first = text.split("\n", 1)[0]
        raise GuestdError(
            ErrorCode.BAD_REQUEST,
            f"syntax error: {first}" if first else "bash -n rejected the command",
            details={"stage": "syntax", "message": text, "field": "command"},
        )


async def _feed_stdin(ctx: Request, stdin: StdinFifo | PtyInput) -> None:
    """INPUT data into a stdin_stream command's FIFO, acknowledged once written (the window is
    exec's); eof closes it."""
    loop = asyncio.get_running_loop()
    try:
        while stdin.write is not None:
            body = await ctx.input.get()
            chunk = body.get("data")
            if isinstance(chunk, bytes) and chunk and stdin.write is not None:
                await write_all(loop, stdin.write, chunk)
                ctx.ack_input(len(chunk))
            if body.get("eof"):
                await stdin.end_input()
                return
    except OSError:
        pass  # the command closed its stdin: nothing more to deliver


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


def _leads_a_group_under(pid: int, parent: int) -> bool:
    """``pid`` is a child of ``parent`` and the leader of its own process group."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 2 :].split()  # state ppid pgrp ...: after the comm, which may hold anything
    return len(fields) > 2 and fields[1] == str(parent).encode() and fields[2] == str(pid).encode()
