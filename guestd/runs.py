"""Kept runs: a ``shell.run`` or ``code.run`` with ``keep: true`` outlives its request.

The op runs in a task the run table owns; the request only awaits it (shielded), so a lost
connection or a cancel leaves the run going, and its reply (bounded like any reply: the op's
own max_output) or its error is kept under a run id for ``run.get`` / ``run.wait``. Bounds:
at most ``limits.max_kept_runs`` runs, running ones included; at the cap the oldest ended
run whose result was already delivered (to its request or a run.get/run.wait) makes room,
else the new run is a ``limit`` error: a result nobody has seen is never dropped to make
room. An ended run is dropped ``processes.retention_s`` after it ended, seen or not.
``run.cancel`` cancels the task as a cancel of the request would have before it was kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from guestd.services import add_ops, op
from guestd.wire.errors import ErrorCode, GuestdError, limit_error

if TYPE_CHECKING:
    from guestd.services import Request, Services
    from guestd.wire.types import (
        RunCancelArgs,
        RunCancelReply,
        RunGetArgs,
        RunGetReply,
        RunInfoRecord,
        RunInfoState,
        RunListArgs,
        RunListReply,
        RunWaitArgs,
        RunWaitReply,
    )

WHAT_MAX = 200


class KeptRun:
    def __init__(self, op: str, target: str, what: str, task: asyncio.Task[Any]) -> None:
        self.id = "r" + os.urandom(6).hex()
        self.op = op
        self.target = target
        self.what = what[:WHAT_MAX]
        self.task = task
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.delivered = False  # its result (or error) reached someone
        self.cancelled = False  # by run.cancel
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self.ended_at = time.time()
        if not task.cancelled():
            task.exception()  # retrieved: kept in the record, never "exception never retrieved"

    def describe(self, with_result: bool) -> RunInfoRecord:
        state: RunInfoState = "running"
        result: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        if self.task.done():
            exc = None if self.task.cancelled() else self.task.exception()
            if self.task.cancelled() or exc is not None:
                state = "failed"
                if isinstance(exc, GuestdError):
                    error = {"code": exc.code, "message": exc.message, "details": exc.details or {}}
                elif self.task.cancelled():
                    error = {
                        "code": ErrorCode.CANCELLED.value,
                        "message": "cancelled by run.cancel" if self.cancelled else "cancelled: guestd is stopping",
                        "details": {"run": self.id},
                    }
                else:
                    error = {
                        "code": ErrorCode.INTERNAL.value,
                        "message": repr(exc),
                        "details": {},
                    }
            else:
                state = "done"
                result = self.task.result() if with_result else None
            if with_result:
                self.delivered = True
        return {
            "id": self.id,
            "op": self.op,
            "target": self.target,
            "what": self.what,
            "state": state,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "result": result,
            "error": error if with_result or error is None else {"code": error["code"], "message": error["message"]},
        }


class RunTable:
    """The kept runs (``services.runs``) and the run.* ops that read and cancel them."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.runs: dict[str, KeptRun] = {}

    def expire(self) -> None:
        keep = self.services.config.process_retention_s
        now = time.time()
        for r in list(self.runs.values()):
            if r.ended_at is not None and now - r.ended_at > keep:
                del self.runs[r.id]

    def _make_room(self) -> None:
        self.expire()
        cap = self.services.config.limits.max_kept_runs
        if len(self.runs) < cap:
            return
        seen = [r for r in self.runs.values() if r.ended_at is not None and r.delivered]
        if seen:
            del self.runs[min(seen, key=lambda r: r.ended_at or 0.0).id]
            return
        raise limit_error("max_kept_runs", cap, f"at most {cap} kept runs; fetch finished ones with run.get")

    async def keep(
        self, ctx: Request | None, op: str, target: str, what: str, run: Callable[[], Awaitable[Any]]
    ) -> Any:
        """Run ``run()`` as a kept run; its reply with ``run_id`` (the request may go away first)."""
        self._make_room()

        async def body() -> Any:
            return await run()

        kept = KeptRun(op, target, what, asyncio.get_running_loop().create_task(body()))
        self.runs[kept.id] = kept
        if ctx is not None and ctx.active:
            with contextlib.suppress(Exception):
                await ctx.send_event({"ev": "kept", "run_id": kept.id})
        reply = await asyncio.shield(kept.task)  # CancelledError here: the request went, the run goes on
        kept.delivered = True
        return {**reply, "run_id": kept.id}

    def get(self, run_id: str) -> KeptRun:
        self.expire()
        r = self.runs.get(run_id)
        if r is None:
            raise GuestdError(ErrorCode.NOT_FOUND, f"no kept run {run_id}", details={"run": run_id})
        return r

    async def wait(self, run_id: str, timeout: float) -> KeptRun:
        r = self.get(run_id)
        if not r.task.done():
            await asyncio.wait({r.task}, timeout=timeout)
        return r

    async def cancel(self, run_id: str, timeout: float) -> KeptRun:
        """Cancel the run's task as a cancelled request would (the op interrupts what it runs),
        then wait up to ``timeout`` for it to end."""
        r = self.get(run_id)
        if not r.task.done():
            r.cancelled = True
            r.task.cancel()
            await asyncio.wait({r.task}, timeout=timeout)
        return r

    async def shutdown(self) -> None:
        """guestd is stopping (its runs are ended already): cancel what still waits."""
        for r in self.runs.values():
            r.task.cancel()

    # -- ops: run.get, run.wait, run.list, run.cancel ------------------------------------
    @op("run.get", control=True)
    async def op_get(self, ctx: Request, a: RunGetArgs) -> RunGetReply:
        return {"run": self.get(a["id"]).describe(with_result=True)}

    @op("run.wait")
    async def op_wait(self, ctx: Request, a: RunWaitArgs) -> RunWaitReply:
        return {"run": (await self.wait(a["id"], a["timeout_s"])).describe(with_result=True)}

    @op("run.list", control=True)
    async def op_list(self, ctx: Request, a: RunListArgs) -> RunListReply:
        self.expire()
        return {"runs": [r.describe(with_result=False) for r in self.runs.values()]}

    @op("run.cancel", control=True)
    async def op_cancel(self, ctx: Request, a: RunCancelArgs) -> RunCancelReply:
        return {"run": (await self.cancel(a["id"], a["timeout_s"])).describe(with_result=True)}


def register(services: Services) -> RunTable:
    table = RunTable(services)
    services.runs = table
    services.on_shutdown.append(table.shutdown)
    add_ops(services.ops, table)
    return table
