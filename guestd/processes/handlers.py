"""process capability: background processes, attach/reattach by offset, PTYs (engine: table.py)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from guestd.children.options import parse_signal
from guestd.services import add_ops, op
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.processes.table import ManagedProcess
    from guestd.services import Request, Services
    from guestd.wire.types import (
        ProcessAttachArgs,
        ProcessAttachReply,
        ProcessCloseStdinArgs,
        ProcessCloseStdinReply,
        ProcessForgetArgs,
        ProcessForgetReply,
        ProcessListArgs,
        ProcessListReply,
        ProcessResizeArgs,
        ProcessResizeReply,
        ProcessSignalArgs,
        ProcessSignalReply,
        ProcessStartArgs,
        ProcessStartReply,
        ProcessWaitArgs,
        ProcessWaitReply,
        ProcessWriteArgs,
        ProcessWriteReply,
    )

EXIT_SETTLE_S = 0.5  # after exit, how long attach keeps reading output of leftover children


class ProcessesCapability:
    """The process ops over one process table. The table is made at the capability's first
    use of it (its module is not imported before) and is itself the services' adopter: on_timeout
    "detach" of exec and shell.run hands runs to it."""

    def __init__(self, services: Services) -> None:
        from guestd.processes.table import ProcessTable

        self.limits = services.config.limits
        self.table = ProcessTable(services)

    def busy(self) -> dict[str, list[str]]:
        return {"processes": [p.id for p in self.table.procs.values() if p.running]}

    async def shutdown(self) -> None:
        await self.table.shutdown()

    @op("process.start")
    async def op_start(self, ctx: Request, a: ProcessStartArgs) -> ProcessStartReply:
        p = await self.table.start(a)
        return {"id": p.id, "pid": p.pid}

    @op("process.list", control=True)
    async def op_list(self, ctx: Request, a: ProcessListArgs) -> ProcessListReply:
        return {"processes": [p.describe() for p in self.table.procs.values()]}

    @op("process.attach")
    async def op_attach(self, ctx: Request, a: ProcessAttachArgs) -> ProcessAttachReply:
        p = self.table.get(a["id"])
        chunk = a["chunk"] or self.limits.max_chunk
        offs = {"stdout": a["stdout_from"], "stderr": a["stderr_from"]}
        loop_time = time.monotonic
        exited_at: float | None = None
        while True:
            progressed = False
            for name in ("stdout", "stderr"):
                data, at, lost = p.rings[name].read(offs[name], chunk)
                if lost:
                    await ctx.send_event({"ev": "lost", "stream": name, "bytes": lost, "offset": at})
                offs[name] = at
                if data:
                    await ctx.send_data_event({"ev": name, "offset": at}, data)
                    offs[name] = at + len(data)
                    progressed = True
            if progressed:
                continue
            if not a["follow"]:
                return _attach_reply(p, offs)
            if not p.running:
                if exited_at is None:
                    exited_at = loop_time()
                drained = all(p.rings[n].closed for n in ("stdout", "stderr"))
                if drained or loop_time() - exited_at >= EXIT_SETTLE_S:
                    return _attach_reply(p, offs)
            await p.changed(timeout=0.1 if not p.running else EXIT_SETTLE_S)

    @op("process.wait")
    async def op_wait(self, ctx: Request, a: ProcessWaitArgs) -> ProcessWaitReply:
        p = self.table.get(a["id"])
        loop = asyncio.get_running_loop()
        deadline = None if a["timeout_s"] is None else loop.time() + a["timeout_s"]
        while p.running:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return {"state": "running", **p.exit_info(), "timed_out": True, **await p.spill_fields(0)}
            await p.changed(timeout=left)
        # Exited: its streams end soon after (unless what it left running holds them), then its
        # spill files are complete.
        return {"state": "exited", **p.exit_info(), "timed_out": False, **await p.spill_fields(EXIT_SETTLE_S)}

    @op("process.signal", control=True)
    async def op_signal(self, ctx: Request, a: ProcessSignalArgs) -> ProcessSignalReply:
        sig = parse_signal(a["signal"])
        if sig is None:
            raise GuestdError(ErrorCode.BAD_REQUEST, f"unknown signal {a['signal']!r}", details={"field": "signal"})
        self.table.get(a["id"]).send_signal(sig)
        return {}

    @op("process.write")
    async def op_write(self, ctx: Request, a: ProcessWriteArgs) -> ProcessWriteReply:
        return {"written": await self.table.get(a["id"]).write_stdin(a["data"])}

    @op("process.close_stdin")
    async def op_close_stdin(self, ctx: Request, a: ProcessCloseStdinArgs) -> ProcessCloseStdinReply:
        self.table.get(a["id"]).close_stdin()
        return {}

    @op("process.resize")
    async def op_resize(self, ctx: Request, a: ProcessResizeArgs) -> ProcessResizeReply:
        self.table.get(a["id"]).resize(a["rows"], a["cols"])
        return {}

    @op("process.forget")
    async def op_forget(self, ctx: Request, a: ProcessForgetArgs) -> ProcessForgetReply:
        self.table.forget(a["id"])
        return {}


def _attach_reply(p: ManagedProcess, offs: dict[str, int]) -> ProcessAttachReply:
    return {
        "state": "running" if p.running else "exited",
        **p.exit_info(),
        "stdout_offset": offs["stdout"],
        "stderr_offset": offs["stderr"],
    }


def register(services: Services) -> ProcessesCapability:
    capability = ProcessesCapability(services)
    services.busy.append(capability.busy)
    services.on_shutdown.append(capability.shutdown)
    services.adopter = capability.table
    add_ops(services.ops, capability)
    return capability
