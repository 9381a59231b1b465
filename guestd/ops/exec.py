"""exec capability: run a process to completion with bounded capture and real timeouts.

Spawn path: ``subprocess.Popen`` (vfork + exec in CPython) instead of the loop's
subprocess machinery, because uvloop's fork-based spawn measured 2.5x slower
here. Pipes are read with ``add_reader`` + ``os.read`` and the exit is observed
through a pidfd, so no SIGCHLD handler or child watcher thread is involved.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Any

from guestd.capture import OutputCapture, capture_fields
from guestd.proctree import (
    ExitWatch,
    descendants,
    kill_tree,
    read_chunk,
    reset_oom_score,
    signal_group,
    try_reap,
)
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.server.connection import RequestContext
    from guestd.server.daemon import Daemon
    from guestd.wire.types import ExecArgs, ExecReply, ExecTimedOut

READ_SIZE = 256 * 1024
_STREAM_FIELDS = {1: {"ev": "stdout"}, 2: {"ev": "stderr"}}


def parse_signal(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value if 0 < value < signal.NSIG else None
    if not isinstance(value, str):
        return None
    name = value.upper()
    if name.isdigit():
        return parse_signal(int(name))
    if not name.startswith("SIG"):
        name = "SIG" + name
    sig = getattr(signal, name, None)
    return int(sig) if isinstance(sig, signal.Signals) else None


def build_env(env: dict[str, str] | None, mode: str) -> dict[str, str] | None:
    """None means "inherit guestd's environment" (cheapest: Popen encodes nothing)."""
    if mode == "replace":
        return dict(env or {})
    if not env:
        return None
    merged = dict(os.environ)
    merged.update(env)
    return merged


def check_cwd(cwd: str | None) -> None:
    """A missing or non-directory cwd is a could-not-start error with stage "cwd"."""
    if cwd is None:
        return
    try:
        st = os.stat(cwd)
    except OSError as exc:
        raise GuestdError.from_os_error(exc, stage="cwd", cwd=cwd) from None
    except ValueError as exc:
        raise GuestdError(ErrorCode.BAD_REQUEST, f"bad cwd: {exc}", details={"stage": "cwd"}) from None
    if not os.path.isdir(cwd) or not st:
        raise GuestdError(
            ErrorCode.NOT_A_DIRECTORY,
            f"cwd is not a directory: {cwd}",
            errno=errno.ENOTDIR,
            details={"stage": "cwd", "cwd": cwd},
        )


def as_user(ids: tuple[int, int] | None, cgroup: dict[str, Any] | None = None) -> dict[str, Any]:
    """Popen arguments for a workload process: the workload user (policy.workload_user, when
    guestd is root) and the workload cgroup (a preexec that joins it)."""
    join = (cgroup or {}).get("preexec_fn")
    if ids is None:
        return {"preexec_fn": join} if join is not None else {}
    if join is None:
        return {"user": ids[0], "group": ids[1], "extra_groups": []}
    uid, gid = ids

    # Popen drops privileges *before* preexec_fn runs, and only root may move a process into
    # the workload cgroup: so join first, then become the workload user, in that order.
    def join_then_drop() -> None:
        join()
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)

    return {"preexec_fn": join_then_drop}


def preexec_failed(exc: subprocess.SubprocessError) -> GuestdError:
    """The child could not be set up before exec (workload cgroup join, privilege drop)."""
    return GuestdError(
        ErrorCode.UNAVAILABLE,
        f"could not set up the child (workload cgroup / workload user): {exc}",
        details={"stage": "spawn"},
    )


def command_argv(argv: list[str] | None, shell: str | None) -> list[str]:
    """The argv to run: ``argv``, or ``shell`` under /bin/sh -c (the schema admits exactly one)."""
    if argv is not None:
        return argv
    assert shell is not None
    return ["/bin/sh", "-c", shell]


def spawn(
    args: ExecArgs, stdin_pipe: bool, ids: tuple[int, int] | None = None, cgroup: dict[str, Any] | None = None
) -> subprocess.Popen[bytes]:
    """Start the process in its own session (so its group can be killed as a unit).

    Raises GuestdError with ``details.stage`` = ``cwd`` or ``spawn`` when it could not start.
    """
    argv = command_argv(args["argv"], args["shell"])
    cwd = args["cwd"]
    check_cwd(cwd)
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=build_env(args["env"], args["env_mode"]),
            start_new_session=True,
            close_fds=True,
            **as_user(ids, cgroup),
        )
    except OSError as exc:
        stage = "cwd" if cwd is not None and exc.filename == cwd else "spawn"
        raise GuestdError.from_os_error(exc, stage=stage, argv0=argv[0]) from None
    except (ValueError, TypeError) as exc:  # e.g. NUL bytes in argv or env
        raise GuestdError(ErrorCode.BAD_REQUEST, f"cannot spawn: {exc}", details={"stage": "spawn"}) from None
    except subprocess.SubprocessError as exc:
        raise preexec_failed(exc) from None
    return proc


class ExecRun:
    """One running exec: pipes, exit, timeouts, streaming credit."""

    def __init__(
        self, ctx: RequestContext, args: ExecArgs, proc: subprocess.Popen[bytes], daemon: Daemon, t0: float
    ) -> None:
        self.ctx = ctx
        self.reaper = daemon.reaper
        self.args = args
        self.proc = proc
        self.pid = proc.pid
        self.loop = asyncio.get_running_loop()
        self.t0 = t0  # taken before the spawn: duration_s includes starting the process
        self.stream = bool(args["stream"])
        mode = args["capture"]
        self.caps = {1: OutputCapture(args["max_output"], mode), 2: OutputCapture(args["max_output"], mode)}
        assert proc.stdout is not None and proc.stderr is not None
        self.fds: dict[int, int] = {1: proc.stdout.fileno(), 2: proc.stderr.fileno()}
        self.open_fds: set[int] = set()
        self.reading = False
        self.exited = asyncio.Event()
        self.pipes_done = asyncio.Event()
        self.status: int | None = None
        self.timed_out: ExecTimedOut | None = None
        self.last_output = self.t0
        self.kill_task: asyncio.Task[None] | None = None
        self.resume_task: asyncio.Task[None] | None = None
        self.exit_watch: ExitWatch | None = None
        self.handles: list[asyncio.TimerHandle] = []

    # -- wiring ---------------------------------------------------------------------
    def start(self) -> None:
        for which, fd in self.fds.items():
            # Pipes keep the default 64 KiB: F_SETPIPE_SZ to 1 MiB measured +45 us per exec,
            # more than it saves for the short commands agents mostly run.
            os.set_blocking(fd, False)
            self.open_fds.add(which)
        self._resume_reading()
        self.exit_watch = ExitWatch(self.loop, self.pid, self._on_exit_ready, 0.01)
        self._on_exit_ready()  # it may already be gone
        if self.args["timeout_s"] is not None:
            self.handles.append(self.loop.call_later(self.args["timeout_s"], self._fire_timeout, "wall"))
        if self.args["idle_timeout_s"] is not None:
            self.handles.append(self.loop.call_later(self.args["idle_timeout_s"], self._check_idle))

    def _resume_reading(self) -> None:
        if self.reading:
            return
        self.reading = True
        for which in self.open_fds:
            self.loop.add_reader(self.fds[which], self._on_readable, which)

    def _pause_reading(self) -> None:
        if not self.reading:
            return
        self.reading = False
        for which in self.open_fds:
            self.loop.remove_reader(self.fds[which])

    def _on_readable(self, which: int) -> None:
        size = READ_SIZE
        if self.stream:
            # Read no more than one frame within the client's credit can carry, so no
            # event ever exceeds the client's max_frame or its window.
            size = min(size, self.ctx.data_room(_STREAM_FIELDS[which]))
            if size <= 0:
                self._wait_for_client()
                return
        data = read_chunk(self.fds[which], size)
        if data is None:
            return
        if not data:
            self._close_pipe(which)
            return
        self.last_output = time.monotonic()
        if not self.stream:
            self.caps[which].feed(data)
            return
        self.caps[which].total += len(data)  # streamed, not kept: only counted
        self.ctx.push_data(_STREAM_FIELDS[which], data)
        if self.ctx.data_room(_STREAM_FIELDS[which]) <= 0 or self.ctx.conn.write_paused:
            self._wait_for_client()

    def _wait_for_client(self) -> None:
        # The client is behind: stop reading so the process blocks on its pipe,
        # instead of buffering without bound here.
        self._pause_reading()
        if self.resume_task is None or self.resume_task.done():
            self.resume_task = self.loop.create_task(self._resume_when_ready())

    async def _resume_when_ready(self) -> None:
        await self.ctx.wait_credit()
        await self.ctx.conn.drain()
        self._resume_reading()

    def _close_pipe(self, which: int) -> None:
        if which in self.open_fds:
            self.open_fds.discard(which)
            if self.reading:
                self.loop.remove_reader(self.fds[which])
        if not self.open_fds:
            self.pipes_done.set()

    def _on_exit_ready(self) -> None:
        if self.status is not None:
            return
        status = try_reap(self.pid)
        if status is None:
            return
        self.status = status
        self.proc.returncode = os.waitstatus_to_exitcode(status)  # so Popen never waits again
        self.reaper.tracked.discard(self.pid)
        if self.reaper.enabled:
            self.reaper.sweep()  # a sweep may have stopped at us while we were unreaped
        if self.exit_watch is not None:
            self.exit_watch.close()
        self.exited.set()

    def _check_idle(self) -> None:
        idle = self.args["idle_timeout_s"]
        assert idle is not None  # only scheduled when there is one
        quiet = time.monotonic() - self.last_output
        if quiet >= idle:
            self._fire_timeout("idle")
        else:
            self.handles.append(self.loop.call_later(idle - quiet, self._check_idle))

    def _fire_timeout(self, which: ExecTimedOut) -> None:
        if self.timed_out is not None or self.status is not None:
            return
        self.timed_out = which
        self.kill()

    def kill(self) -> None:
        if self.kill_task is None:
            known = descendants(self.pid)
            self.kill_task = self.loop.create_task(kill_tree(self.pid, known, self.args["kill_grace_s"], self.exited))

    def signal(self, sig: int) -> None:
        signal_group(self.pid, sig)

    # -- completion -------------------------------------------------------------------
    async def wait(self) -> ExecReply:
        await self.exited.wait()
        if self.kill_task is not None:
            await self.kill_task  # a timed-out tree is gone before we answer
        if not self.pipes_done.is_set():
            # Leftover children may hold the pipes open (``daemon &``); do not wait for them
            # forever. Killed trees close their pipes within the kill grace.
            linger = self.args["linger_s"]
            if self.kill_task is not None:
                linger += self.args["kill_grace_s"]
            try:
                await asyncio.wait_for(self.pipes_done.wait(), linger)
            except TimeoutError:
                pass
        # Whatever is still readable right now belongs to the result.
        for which in list(self.open_fds):
            if self.stream:
                await self._drain_to_client(which)
            else:
                self._drain_now(which)
        return self.result()

    def _drain_now(self, which: int) -> None:
        fd = self.fds[which]
        for _ in range(64):
            data = read_chunk(fd, READ_SIZE)
            if not data:
                return
            self.caps[which].feed(data)

    async def _drain_to_client(self, which: int) -> None:
        fd, fields = self.fds[which], _STREAM_FIELDS[which]
        for _ in range(64):
            room = self.ctx.data_room(fields)
            if room <= 0:
                if not self.ctx.active:
                    return
                await self.ctx.wait_credit()
                continue
            data = read_chunk(fd, min(READ_SIZE, room))
            if not data:
                return
            self.caps[which].total += len(data)
            self.ctx.push_data(fields, data)

    def result(self) -> ExecReply:
        status = self.status if self.status is not None else 0
        exit_code = os.waitstatus_to_exitcode(status)
        return {
            "exit_code": exit_code if exit_code >= 0 else None,
            "signal": -exit_code if exit_code < 0 else None,
            "timed_out": self.timed_out,
            **capture_fields(self.caps[1], self.caps[2], streamed=self.stream),
            "duration_s": time.monotonic() - self.t0,
            "pid": self.pid,
        }

    def close(self) -> None:
        for h in self.handles:
            h.cancel()
        self._pause_reading()
        if self.exit_watch is not None:
            self.exit_watch.close()
        if self.resume_task is not None:
            self.resume_task.cancel()
        for f in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass


def _set_if_pending(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def write_all(loop: asyncio.AbstractEventLoop, fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
            view = view[n:]
            continue
        except BlockingIOError:
            pass
        fut: asyncio.Future[None] = loop.create_future()
        loop.add_writer(fd, _set_if_pending, fut)
        try:
            await fut
        finally:
            loop.remove_writer(fd)


async def _feed_stdin(run: ExecRun, data: bytes | None) -> None:
    """Write fixed stdin bytes, or relay INPUT frames; always close stdin at the end."""
    proc, ctx, loop = run.proc, run.ctx, run.loop
    assert proc.stdin is not None
    fd = proc.stdin.fileno()
    os.set_blocking(fd, False)
    try:
        if data is not None:
            await write_all(loop, fd, data)
            return
        while True:
            body = await ctx.input.get()
            chunk = body.get("data")
            if isinstance(chunk, bytes) and chunk:
                await write_all(loop, fd, chunk)
                ctx.ack_input(len(chunk))
            if body.get("eof"):
                return
    except (BrokenPipeError, ConnectionResetError):
        pass  # the process closed its stdin; nothing more to deliver
    finally:
        ctx.stop_taking_data()  # signals still arrive (they never pass through here)
        try:
            proc.stdin.close()
        except OSError:
            pass


def _apply_signal(run: ExecRun, value: Any) -> None:
    sig = parse_signal(value)
    if sig is not None:
        run.signal(sig)


def register(daemon: Daemon) -> None:
    async def op_exec(ctx: RequestContext, args: ExecArgs) -> ExecReply:
        stdin_pipe = args["stdin"] is not None or args["stdin_stream"]
        t0 = time.monotonic()
        proc = spawn(args, stdin_pipe, daemon.config.policy.workload_ids(), daemon.workload.popen_kwargs())
        reset_oom_score(proc.pid)
        daemon.reaper.tracked.add(proc.pid)
        run = ExecRun(ctx, args, proc, daemon, t0)
        helpers: list[asyncio.Task[None]] = []
        try:
            run.start()
            if run.stream:
                ctx.post_event({"ev": "started", "pid": run.pid})
            # Signals apply at once in every stdin mode, also after eof and behind unread stdin.
            ctx.handle_signals(lambda value: _apply_signal(run, value))
            if args["stdin_stream"]:
                helpers.append(run.loop.create_task(_feed_stdin(run, None)))
            else:
                ctx.stop_taking_data()  # INPUT data and eof mean nothing without stdin_stream
                if args["stdin"] is not None:
                    helpers.append(run.loop.create_task(_feed_stdin(run, args["stdin"])))
            return await run.wait()
        except asyncio.CancelledError:
            # Cancelled request or dropped connection: the work must really stop.
            if run.status is None:
                run.kill()
            if run.kill_task is not None:
                await asyncio.shield(run.kill_task)
            raise
        finally:
            for t in helpers:
                t.cancel()
            run.close()
            if run.status is None:
                # Still not reaped (e.g. cancelled during the grace): let the reaper have it.
                daemon.reaper.tracked.discard(run.pid)
                run.loop.create_task(_reap_later(run.pid))

    daemon.dispatcher.add("exec", op_exec)


async def _reap_later(pid: int) -> None:
    for _ in range(600):
        if try_reap(pid) is not None:
            return
        await asyncio.sleep(0.1)
