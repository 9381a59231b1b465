"""Persistent bash sessions: cd, variables, functions, aliases and venvs persist between commands.

What guestd writes into bash and how a command's end is read back (the library, the command
script, the marker on the status socket): script.py. Here, the session's bash and its commands:
- A command runs in phases (``Session._run_locked``): prepare (the captures, the job of an
  on_timeout "detach" or pty command, the stdin: stdin.py), the script (script.py, pure),
  wait (the marker, bash's end, a timeout or the request gone), settle (interrupt, detach or
  restart), and the result.
- ``builtin exit``, ``exec``, or a command that ignores SIGINT inside bash itself
  (``trap '' INT; while :; do :; done``) past its timeout end bash: the session is
  restarted with the last cwd and exported variables, and the result says so.
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
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from guestd.children import PIPE, Child
from guestd.children.options import build_env, check_cwd, parse_signal
from guestd.children.tree import descendants, set_winsize, signal_each, signal_group, write_all
from guestd.output.capture import OutputCapture, give_away_spills
from guestd.output.spill import Spill, abandon, finish, open_spills
from guestd.services import to_the_end
from guestd.shells.command import Command, Outcome, reply
from guestd.shells.control import StatusChannel, socket_pair
from guestd.shells.job import JobFifos, RunningJob, ShellJob
from guestd.shells.output import ShellOutput
from guestd.shells.script import CTL_FD, LIBRARY, Marker, check_command, command_script, start_script
from guestd.shells.stdin import CommandInput, StdinFifo
from guestd.shells.syntax import check_syntax
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.paths import path_to_wire

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.children.cgroups import RunCgroup
    from guestd.services import Request, Services
    from guestd.wire.types import ShellInfoRecord, ShellRunArgs, ShellRunReply

GRACE_S = 1.0
START_S = 30.0  # for bash to read its start script, and again to be ready
DETACH_RING_BYTES = 1024 * 1024  # per stream, as process.start's default ring_bytes


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


class Session:
    def __init__(
        self, services: Services, sid: str, name: str | None, cwd: str | None, env: dict[str, str] | None
    ) -> None:
        self.services = services
        self.id = sid
        self.name = name
        self.cwd = cwd or os.getcwd()
        self.env = env
        self.exports = ""  # last `export -p`, replayed into a restarted bash
        self.child: Child | None = None
        self.status: StatusChannel | None = None  # guestd's end of bash's status channel
        self.output = ShellOutput()
        self.lock = asyncio.Lock()
        self.commands = 0
        self.restarts = 0
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
        services = self.services
        check_cwd(self.cwd)
        env = build_env(self.env, "merge", services.config.policy.workload_ids()) or dict(os.environ)
        env.pop("BASH_ENV", None)
        env.pop("ENV", None)
        lib = library_dir(services.runtime_dir())
        # The status channel is a Unix socket that tells guestd who wrote each byte
        # (SO_PASSCRED): only bash's own writes count, not those of processes it started.
        ours, theirs = socket_pair()
        try:
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
        self.status = StatusChannel(ours, child.pid)
        assert child.stdout is not None and child.stderr is not None
        self.output.attach(child.stdout, child.stderr)
        child.watch(poll_s=0.05)  # `alive` reads the child; waits watch child.exited
        # A restarted session keeps its exported environment.
        script = start_script(lib, self.status.expect(), self.exports if replay_exports else "")
        try:
            await asyncio.wait_for(self._send(script), START_S)
            not_started = await self._ready(START_S)
        except TimeoutError:
            not_started = f"bash did not read its start script within {START_S:g} s"
        except OSError as exc:
            not_started = f"bash did not read its start script: {exc}"
        except BaseException:  # cancelled: the session is not made, so neither is its bash
            await asyncio.shield(self.kill())
            raise
        if not_started is not None:
            await self.kill()
            raise GuestdError(ErrorCode.UNAVAILABLE, not_started)

    async def _ready(self, timeout: float) -> str | None:
        """Wait for bash's first marker: None once it came, else why bash is not ready. Ends
        early when no marker can come (bash's end of the status channel is gone, or bash is)."""
        status, child = self.status, self.child
        assert status is not None and child is not None
        marker = status.marker
        waits: set[asyncio.Future[Any]] = {marker, status.writer_gone, child.exited}
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if marker.done():
            return None
        dropped = f" ({status.forged_bytes} status bytes not from bash were dropped)" if status.forged_bytes else ""
        if child.exited.done():
            return f"bash ended (status {child.status}) before it was ready" + dropped
        if status.writer_gone.done():  # bash never had its end, or has just ended
            return "bash did not start: its end of the status channel was closed before it was ready" + dropped
        return f"bash did not start within {timeout:g} s" + dropped

    def _marker(self) -> asyncio.Future[Marker]:
        assert self.status is not None
        return self.status.marker

    async def _send(self, text: str) -> None:
        assert self.child is not None and self.child.stdin is not None
        await write_all(asyncio.get_running_loop(), self.child.stdin, text.encode("utf-8", "surrogateescape"))

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
        self.output.detach()
        if self.status is not None:
            self.status.close()  # kept: a command still waiting on it sees bash's end
        if self.child is not None:
            self.child.release()

    async def restart(self) -> None:
        await self.kill()
        self.restarts += 1
        await self.start(replay_exports=True)

    # -- the job of a detach or pty command ------------------------------------------------
    def _start_job(self, pty: tuple[int, int] | None = None) -> RunningJob:
        services = self.services
        d = os.path.join(services.runtime_dir(), "shell-job")
        os.makedirs(d, mode=0o711, exist_ok=True)  # traversable, not listable: names are secrets
        os.chmod(d, 0o711)
        os.chmod(services.runtime_dir(), 0o711)
        fifos = JobFifos(d, services.config.policy.workload_ids(), pty=pty)
        job = RunningJob(fifos, min(DETACH_RING_BYTES, services.config.limits.max_ring_bytes), self.pid)
        self.output.attach_job(job)
        return job

    def _stop_job(self, give_away: bool) -> JobFifos | None:
        """Stop reading the job's FIFOs; closed now, or kept for the process table."""
        job = self.output.detach_job()
        if job is None:
            return None
        if give_away:
            job.fifos.opened()
            return job.fifos
        job.fifos.close()
        return None

    def _job_pid(self) -> int | None:
        job = self.output.job
        return job.pid() if job is not None else None

    async def _detach_job(self, command: str, stdin: StdinFifo | None) -> str | None:
        """bash is back at its prompt and the job runs on: move its processes (frozen, wherever
        they went) to a leaf of their own and give it to the process table."""
        services = self.services
        self.output.drain()
        job = self.output.job
        pid = self._job_pid()
        adopter = services.adopter
        if job is None or pid is None or adopter is None or self.child is None:
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
        self.output.drain()  # output up to the hand-over is the reply's too
        fifos = self._stop_job(give_away=True)
        assert fifos is not None
        out, err, status = fifos.read["stdout"], fifos.read["stderr"], fifos.read["status"]
        given = stdin.give_write() if stdin else None
        adopted = ShellJob(pid, status, job.status_from_pid(), leaf, [out, err], given)
        adopted.keep_lingering(services.children.lingering)
        rings = {"stdout": job.rings[1], "stderr": job.rings[2]}
        caps = self.output.caps
        spills = give_away_spills(caps[1], caps[2]) if caps is not None else None
        return adopter.adopt(command, adopted, {"stdout": out, "stderr": err}, rings, spills)

    def resize(self, rows: int, cols: int) -> None:
        """shell.resize: the running pty command's terminal size; its process group gets
        SIGWINCH (the terminal is no controlling terminal, so the kernel sends none)."""
        job = self.output.job
        if job is None or job.fifos.master is None:
            raise GuestdError(
                ErrorCode.BAD_REQUEST, f"no pty command runs in shell session {self.id}", details={"session": self.id}
            )
        set_winsize(job.fifos.master, rows, cols)
        job.read_status()
        pid = job.pid()
        if pid is not None:
            signal_group(pid, signal.SIGWINCH)

    def _signal_job(self, value: Any) -> None:
        """pty mode, an INPUT signal: to the job's process group (the program in the
        foreground of the command; the session's bash is in a group of its own)."""
        sig = parse_signal(value)
        job = self.output.job
        if job is None:
            return
        job.read_status()  # the pid line may still be in the FIFO
        pid = job.pid()
        if sig is not None and pid is not None:
            signal_group(pid, sig)

    # -- running -----------------------------------------------------------------------
    async def run(self, args: ShellRunArgs, ctx: Request | None = None) -> ShellRunReply:
        if args["pty"] and (args["input"] is not None or args["stdin_stream"] or args["on_timeout"] == "detach"):
            raise GuestdError(
                ErrorCode.BAD_REQUEST,
                "pty: input comes from INPUT frames (no input or stdin_stream) and on_timeout is kill",
                details={"field": "pty"},
            )
        check_command(args["command"])
        if args["check_syntax"]:
            await check_syntax(self.services, args["command"])
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
            spills = await open_spills(self.services, "shell") if args["spill"] else None
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
        """One command, in phases: prepare (captures, job, stdin), the script (pure), wait and
        settle (a timeout interrupts or detaches; bash's end restarts it), the result."""
        started = time.monotonic()
        run = self._prepare(a, ctx, spills)
        assert self.status is not None
        job = run.job.fifos if run.job is not None else None
        script = command_script(
            a["command"],
            self.status.expect(),
            stdin=run.stdin.source,
            merge_stderr=a["merge_stderr"],
            job_paths=job.paths if job is not None else None,
            tty=job.tty if job is not None and job.master is not None else None,  # in the job's subshell (job.py)
        )
        try:
            await self._wait_and_settle(run, script)
        finally:
            caps = await self._end_command(run)
        return await self._result(run, caps, count, started)

    def _prepare(self, a: ShellRunArgs, ctx: Request | None, spills: tuple[Spill, Spill] | None) -> Command:
        """The captures, the job (on_timeout "detach", pty) and the stdin of a command."""
        child = self.child
        assert child is not None
        detach = self._detach_applies(a)
        self.output.drain()  # whatever background jobs wrote since the last command is not ours
        # What runs in the session now (bash, jobs of earlier commands): a timeout or cancel of
        # this command ends everything else in the session's cgroup, wherever it went.
        self._before = set(child.cgroup.pids()) if child.cgroup is not None else set()
        usage_before = child.usage_now()
        caps = {1: OutputCapture(a["max_output"], a["capture"]), 2: OutputCapture(a["max_output"], a["capture"])}
        if spills is not None:
            caps[1].spill, caps[2].spill = spills
        job = self._start_job((a["rows"], a["cols"]) if a["pty"] else None) if detach or a["pty"] else None
        try:
            fifos = job.fifos if job is not None else None
            stdin = CommandInput.prepare(self.services, a["input"], a["stdin_stream"], ctx, fifos, self._signal_job)
        except BaseException:
            self._stop_job(give_away=False)
            raise
        self.output.begin(caps, ctx if a["stream"] and ctx is not None else None)
        return Command(a, ctx, detach, job, stdin, child, usage_before)

    def _detach_applies(self, a: ShellRunArgs) -> bool:
        """on_timeout "detach" with a timeout to apply it at; a full process table is a limit
        error now, not at the timeout."""
        adopter = self.services.adopter
        timeout = a["timeout_s"] is not None or a["idle_timeout_s"] is not None
        if a["pty"] or a["on_timeout"] != "detach" or not timeout or adopter is None:
            return False
        adopter.check()
        return True

    async def _wait_and_settle(self, run: Command, script: str) -> None:
        """Send the script, wait for the command's end, and settle what it left."""
        # The script goes in while the deadline runs: a bash that does not read (stopped by a
        # job, busy) must not hold the session past the command's timeout.
        send = asyncio.ensure_future(self._send(script))
        try:
            run.outcome = await self._wait(run.args["timeout_s"], run.args["idle_timeout_s"])
            await self._settle(run, run.outcome)
            if not send.done() or send.cancelled() or send.exception() is not None:
                run.restarted = True  # bash got part of the script at most: it cannot be trusted in step
            if not run.restarted:
                run.marker = self._marker().result()
        finally:
            if not send.done():
                send.cancel()
            send.add_done_callback(_consume)

    async def _settle(self, run: Command, outcome: Outcome) -> None:
        """A timed-out detach command goes on in the background; a timeout or a cancel
        interrupts the command (bash restarts if it does not come back); bash's end restarts."""
        child = run.ran_in
        if outcome in ("wall", "idle") and run.detach and run.job is not None and await self._release_bash():
            run.timed_out = outcome
            run.detached = await self._detach_job(run.args["command"], run.stdin.fifo)
        elif outcome in ("wall", "idle", "cancel"):
            if outcome != "cancel":
                run.timed_out = outcome
            run.interrupted = True
            run.restarted = not await self._interrupt()
            if not run.restarted and child.cgroup is not None:
                await self._kill_command_processes(child.cgroup)
            elif run.job is not None and child.cgroup is None:
                # No leaf to empty: the job's own group (a terminal job is not in bash's)
                # ends now, not after its output has reached a client that may never read.
                pid = self._job_pid()
                if pid is not None:
                    signal_group(pid, signal.SIGKILL)
        elif outcome == "exited":
            run.restarted = True
            run.bash_status = child.status

    async def _end_command(self, run: Command) -> dict[int, OutputCapture]:
        """The command has ended (or goes on detached): its stdin, the rest of its output, its
        job's FIFOs. Returns its captures."""
        run.stdin.close(keep_fifo=run.detached is not None)
        with contextlib.suppress(Exception):
            await asyncio.shield(self.output.drain_stream())  # within the client's credit
        self.output.stop_streaming()
        self.output.drain()
        if run.detached is None and run.job is not None:
            pid = self._job_pid()
            self._stop_job(give_away=False)
            if pid is not None and run.interrupted and run.ran_in.cgroup is None:
                signal_group(pid, signal.SIGKILL)  # no leaf to empty: the job's own group
        return self.output.end()

    async def _result(self, run: Command, caps: dict[int, OutputCapture], count: bool, started: float) -> ShellRunReply:
        usage_after = run.ran_in.usage_now()
        if run.restarted and not self.closed:
            await self.restart()
        if count:
            self.commands += 1
        if run.marker is not None:
            self.cwd, self.exports = run.marker.cwd, run.marker.exports
        return await reply(run, caps, path_to_wire(self.cwd), time.monotonic() - started, usage_after)

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
        await self.services.run_in_io(cg.kill_except, self._before | {self.pid})

    async def _wait(self, timeout: float | None, idle: float | None, cancellable: bool = True) -> Outcome:
        """'done' (status arrived), 'exited' (bash died), 'wall' or 'idle' (a timeout), or
        'cancel' (the request went away)."""
        marker, status = self._marker(), self.status
        assert self.child is not None and status is not None
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
                    status.on_readable()
                    return "done" if marker.done() else "exited"
                if cancel is not None and cancel.is_set():
                    return "cancel"
                waits = [t for t in (None if deadline is None else deadline - loop.time(),) if t is not None]
                if idle is not None:
                    waits.append(self.output.last_output + idle - time.monotonic())
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
            "stray_bytes": self.output.stray_bytes,
        }


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a result nobody waits for any more; never "exception never retrieved"
