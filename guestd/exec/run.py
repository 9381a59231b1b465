"""One exec run: pipes, exit, timeouts, streaming credit, stdin.

The process is a run of ``guestd.children`` (its own leaf cgroup, the workload user, clone3
like vfork, in a spawn thread) instead of the loop's subprocess machinery, whose fork-based
spawn measured 2.5x slower here. Pipes are read by the output pump (``guestd.output.pump``:
``add_reader`` + ``os.read``, under a streaming client's credit) and the exit is observed
through a pidfd, so no SIGCHLD handler or child watcher thread is involved.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any

from guestd.children import Child, KilledBy, run_figures
from guestd.children.options import parse_signal
from guestd.children.tree import write_all
from guestd.output.capture import OutputCapture, OutputRing, capture_fields_off_loop, give_away_spills
from guestd.output.pump import OutputPump

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.services import Adopter, Request
    from guestd.wire.types import ExecArgs, ExecReply, ExecTimedOut

DETACH_RING_BYTES = 1024 * 1024  # per stream, as process.start's default ring_bytes


class ExecRun:
    """One running exec: pipes, exit, timeouts, streaming credit."""

    def __init__(
        self, ctx: Request, args: ExecArgs, child: Child, t0: float, adopter: Adopter | None = None, ring_cap: int = 0
    ) -> None:
        self.ctx = ctx
        self.args = args
        self.child = child
        self.pid = child.pid
        self.loop = asyncio.get_running_loop()
        self.t0 = t0  # taken before the spawn: duration_s includes starting the process
        self.stream = bool(args["stream"])
        mode = args["capture"]
        self.caps = {1: OutputCapture(args["max_output"], mode), 2: OutputCapture(args["max_output"], mode)}
        self.output = OutputPump()
        self.output.last_output = t0
        self.output.route(self.caps, ctx if self.stream else None)
        self.timed_out: ExecTimedOut | None = None
        self.kill_task: asyncio.Task[None] | None = None
        self.handles: list[asyncio.TimerHandle] = []
        # on_timeout "detach": the output also goes to rings from byte 0, so the background
        # process the command becomes has all of it (within the ring) at continuous offsets.
        self.adopter = adopter if args["on_timeout"] == "detach" else None
        size = min(DETACH_RING_BYTES, ring_cap) if ring_cap > 0 else DETACH_RING_BYTES
        self.rings = {1: OutputRing(size), 2: OutputRing(size)} if self.adopter is not None else None
        self.detached: str | None = None
        # The main process's exit or its detach, whichever comes first: one future set from
        # the exit callback, instead of a task and asyncio.wait per exec.
        self.settled: asyncio.Future[None] = self.loop.create_future()

    # -- wiring ---------------------------------------------------------------------
    def start(self) -> None:
        # Pipes keep the default 64 KiB: F_SETPIPE_SZ to 1 MiB measured +45 us per exec,
        # more than it saves for the short commands agents mostly run.
        child, rings = self.child, self.rings
        assert child.stdout is not None
        child.watch(self._settle, poll_s=0.01)
        if not child.running:
            self._settle()
        # A command that has exited already (most short ones, by the time their spawn is
        # collected) has its output read here and now, to its end unless something it left
        # behind holds the pipes. Not when streaming: the started event goes out first.
        read_now = not child.running and not self.stream
        self.output.add("stdout", child.stdout, 1, (rings[1],) if rings is not None else (), read_now=read_now)
        if child.stderr is not None:  # none with merge_stderr: both streams in stdout's pipe
            self.output.add("stderr", child.stderr, 2, (rings[2],) if rings is not None else (), read_now=read_now)
        if self.args["timeout_s"] is not None:
            self.handles.append(self.loop.call_later(self.args["timeout_s"], self._fire_timeout, "wall"))
        if self.args["idle_timeout_s"] is not None:
            self.handles.append(self.loop.call_later(self.args["idle_timeout_s"], self._check_idle))

    def _settle(self) -> None:
        if not self.settled.done():
            self.settled.set_result(None)

    def _check_idle(self) -> None:
        idle = self.args["idle_timeout_s"]
        assert idle is not None  # only scheduled when there is one
        quiet = time.monotonic() - self.output.last_output
        if quiet >= idle:
            self._fire_timeout("idle")
        else:
            self.handles.append(self.loop.call_later(idle - quiet, self._check_idle))

    def _fire_timeout(self, which: ExecTimedOut) -> None:
        if self.timed_out is not None or not self.child.running:
            return
        self.timed_out = which
        if self.adopter is not None and self._detach(self.adopter):
            return
        self.kill("timeout" if which == "wall" else "idle_timeout")

    def _detach(self, adopter: Adopter) -> bool:
        """Give the running command to the process table: its pipes, its rings, its exit."""
        assert self.rings is not None
        try:
            adopter.check()
        except Exception:  # the table is full (a limit): the timeout kills as on_timeout "kill"
            return False
        for h in self.handles:
            h.cancel()
        fds = self.output.hand_over()
        rings = {"stdout": self.rings[1], "stderr": self.rings[2]}
        argv = self.args["argv"]
        command = self.args["shell"] if self.args["shell"] is not None else " ".join(argv or [])
        self.detached = adopter.adopt(command, self.child, fds, rings, give_away_spills(self.caps[1], self.caps[2]))
        self._settle()
        return True

    def kill(self, reason: KilledBy = "cancel") -> None:
        """End the whole run: TERM, the kill grace, then everything left in its cgroup."""
        if self.kill_task is None:
            self.kill_task = self.child.end(self.args["kill_grace_s"], reason)

    def signal(self, sig: int) -> None:
        self.child.signal(sig)

    # -- completion -------------------------------------------------------------------
    async def wait(self) -> ExecReply:
        if not self.settled.done():
            await self.settled
        if self.detached is not None:
            return await self.result()
        if self.kill_task is not None:
            await self.kill_task  # a timed-out tree is gone before we answer
        # Leftover children may hold the pipes open (``daemon &``); do not wait for them
        # forever. Killed trees close their pipes within the kill grace.
        if self.output.sources:
            linger = self.args["linger_s"]
            if self.kill_task is not None:
                linger += self.args["kill_grace_s"]
            await self.output.wait_ended(linger)
        # Whatever is still readable right now belongs to the result.
        if self.stream:
            await self.output.drain_to_client()
        else:
            self.output.drain_now()
        return await self.result()

    async def result(self) -> ExecReply:
        status = self.child.status if self.child.status is not None else 0
        exit_code = os.waitstatus_to_exitcode(status)
        running = self.detached is not None
        return {
            "exit_code": exit_code if exit_code >= 0 and not running else None,
            "signal": -exit_code if exit_code < 0 and not running else None,
            "timed_out": self.timed_out,
            **await capture_fields_off_loop(  # shaping may take a worker thread
                self.caps[1],
                self.caps[2],
                streamed=self.stream,
                strip_ansi=self.args["strip_ansi"],
                collapse_cr=self.args["collapse_cr"],
            ),  # "changes": the handler adds it
            "duration_s": time.monotonic() - self.t0,
            "pid": self.pid,
            "detached": self.detached,
            **run_figures(self.child.exit_info()),
        }

    def close(self) -> None:
        for h in self.handles:
            h.cancel()
        self.handles = []
        self.output.close()
        if self.detached is None:
            self.child.release()  # else the process table owns it now


async def feed_stdin(run: ExecRun, data: bytes | None) -> None:
    """Write fixed stdin bytes, or relay INPUT frames; always close stdin at the end."""
    ctx, loop = run.ctx, run.loop
    fd = run.child.stdin
    assert fd is not None
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
        if run.detached is None or data is not None:
            run.child.close_fd("stdin")  # a detached stdin_stream stays open: process.write


def apply_signal(run: ExecRun, value: Any) -> None:
    sig = parse_signal(value)
    if sig is not None:
        run.signal(sig)
