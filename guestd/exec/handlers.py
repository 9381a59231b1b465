"""exec handler: run a process to completion with bounded capture and real timeouts (see run.py)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from guestd.children import DEVNULL, PIPE, STDOUT, Child
from guestd.children.options import build_env, check_cwd, command_argv
from guestd.exec.run import ExecRun, apply_signal, feed_stdin
from guestd.output.spill import abandon, finish, open_spills
from guestd.services import add_ops, op
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.services import Request, Services
    from guestd.wire.types import ExecArgs, ExecReply


def _ignore_signal(_value: object) -> None:
    pass  # the run is over: a late signal has nothing to reach


def _close_run(ctx: Request, run: ExecRun) -> None:
    run.close()
    # The request context held the run through this handler: dropped, the run and its
    # context are freed as the request ends, not by the garbage collector (exec under load).
    ctx.handle_signals(_ignore_signal)


class ExecCapability:
    """The exec op in its phases: admit, spawn, start (output, signals, stdin), wait for the
    result, and the cleanup that stops the run when the request is cancelled."""

    def __init__(self, services: Services) -> None:
        self.services = services

    @op("exec")
    async def op_exec(self, ctx: Request, args: ExecArgs) -> ExecReply:
        services = self.services
        t0 = time.monotonic()  # before the spawn: duration_s includes starting the process
        self.admit(args)
        # spill with stream is refused before this (the schema's exclusive).
        spills = await open_spills(services, "exec") if args["spill"] else None
        try:
            cursor = await services.changes_cursor(args["report_changes"])
            child = await self.spawn(args)
        except BaseException:
            abandon(spills)
            raise
        run = ExecRun(ctx, args, child, t0, services.adopter, services.config.limits.max_ring_bytes)
        if spills is not None:
            run.caps[1].spill, run.caps[2].spill = spills
        helpers: list[asyncio.Task[None]] = []
        replied = False
        try:
            self.start(ctx, run, helpers)
            reply = await run.wait()
            spills, kept = None, spills  # from here finish() owns the files, also when cancelled
            reply = await services.with_changes(cursor, await finish(reply, kept))
            replied = True
            return reply
        except asyncio.CancelledError:
            await self.stop(run)
            raise
        finally:
            abandon(spills)
            for t in helpers:
                t.cancel()
            if replied:
                # The run is over and its reply built: closing its pipes and pidfd (and retiring
                # its leaf) waits until the reply is written, which happens as this coroutine
                # returns, in the same step (15-20 us less between exit and reply here).
                run.loop.call_soon(_close_run, ctx, run)
            else:
                _close_run(ctx, run)

    # -- phases ----------------------------------------------------------------------------
    def admit(self, args: ExecArgs) -> None:
        """Refuse before anything starts what would fail later: on_timeout "detach" without a
        process table (or with a full one), a cwd that is not a directory."""
        adopter = self.services.adopter
        if args["on_timeout"] == "detach" and (args["timeout_s"] is not None or args["idle_timeout_s"] is not None):
            if adopter is None:
                raise GuestdError(ErrorCode.BAD_REQUEST, "on_timeout detach needs the process capability")
            adopter.check()  # a full process table is a limit error now, not at the timeout
        check_cwd(args["cwd"])

    async def spawn(self, args: ExecArgs) -> Child:
        """The command's process in its own run (cgroup, workload user), its pipes open."""
        children = self.services.children
        stdin_pipe = args["stdin"] is not None or args["stdin_stream"]
        return await children.spawn(
            command_argv(args["argv"], args["shell"]),
            kind="exec",
            env=build_env(args["env"], args["env_mode"], children.ids()),
            cwd=args["cwd"],
            stdin=PIPE if stdin_pipe else DEVNULL,
            stderr=STDOUT if args["merge_stderr"] else PIPE,
        )

    def start(self, ctx: Request, run: ExecRun, helpers: list[asyncio.Task[None]]) -> None:
        """Output, exit watch and timeouts running; signals reaching the run; stdin fed by a
        helper task appended to ``helpers`` (the handler cancels them at its end)."""
        run.start()
        if run.stream:
            ctx.post_event({"ev": "started", "pid": run.pid})
        # Signals apply at once in every stdin mode, also after eof and behind unread stdin.
        ctx.handle_signals(lambda value: apply_signal(run, value))
        stdin = run.args["stdin"]
        if run.args["stdin_stream"]:
            helpers.append(run.loop.create_task(feed_stdin(run, None)))
        else:
            ctx.stop_taking_data()  # INPUT data and eof mean nothing without stdin_stream
            if stdin is not None:
                helpers.append(run.loop.create_task(feed_stdin(run, stdin)))

    async def stop(self, run: ExecRun) -> None:
        """Cancelled request or dropped connection: the work must really stop, including what
        the command left running after its main process exited (held pipes, setsid)."""
        run.kill()
        if run.kill_task is not None:
            await asyncio.shield(run.kill_task)


def register(services: Services) -> None:
    add_ops(services.ops, ExecCapability(services))
