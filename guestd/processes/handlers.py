"""process capability: background processes, attach/reattach by offset, PTYs (engine: table.py)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from guestd.children.options import parse_signal
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.capture import OutputRing
    from guestd.processes.table import ManagedProcess, ProcessTable
    from guestd.services import AdoptedRun, Request, Services
    from guestd.spill import Spill
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


def register(services: Services) -> None:
    limits = services.config.limits
    tables: list[ProcessTable] = []  # made on first use

    def table() -> ProcessTable:
        if not tables:
            from guestd.processes.table import ProcessTable

            tables.append(ProcessTable(services))
        return tables[0]

    def busy() -> dict[str, list[str]]:
        return {"processes": [p.id for p in tables[0].procs.values() if p.running] if tables else []}

    async def shutdown() -> None:
        if tables:
            await tables[0].shutdown()

    class Adopter:
        """on_timeout "detach" of exec and shell.run hands its run to the table through this."""

        def check(self) -> None:
            table().check_adopt()

        def adopt(
            self,
            command: str,
            run: AdoptedRun,
            fds: dict[str, int],
            rings: dict[str, OutputRing],
            spills: dict[str, Spill] | None = None,
        ) -> str:
            return table().adopt(command, run, fds, rings, spills)

    services.busy.append(busy)
    services.on_shutdown.append(shutdown)
    services.adopter = Adopter()

    async def op_start(ctx: Request, a: ProcessStartArgs) -> ProcessStartReply:
        p = await table().start(a)
        return {"id": p.id, "pid": p.pid}

    async def op_list(ctx: Request, a: ProcessListArgs) -> ProcessListReply:
        if not tables:
            return {"processes": []}
        return {"processes": [p.describe() for p in table().procs.values()]}

    def final(p: ManagedProcess, offs: dict[str, int]) -> ProcessAttachReply:
        return {
            "state": "running" if p.running else "exited",
            **p.exit_info(),
            "stdout_offset": offs["stdout"],
            "stderr_offset": offs["stderr"],
        }

    async def op_attach(ctx: Request, a: ProcessAttachArgs) -> ProcessAttachReply:
        p = table().get(a["id"])
        chunk = a["chunk"] or limits.max_chunk
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
                return final(p, offs)
            if not p.running:
                if exited_at is None:
                    exited_at = loop_time()
                drained = all(p.rings[n].closed for n in ("stdout", "stderr"))
                if drained or loop_time() - exited_at >= EXIT_SETTLE_S:
                    return final(p, offs)
            await p.changed(timeout=0.1 if not p.running else EXIT_SETTLE_S)

    async def op_wait(ctx: Request, a: ProcessWaitArgs) -> ProcessWaitReply:
        p = table().get(a["id"])
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

    async def op_signal(ctx: Request, a: ProcessSignalArgs) -> ProcessSignalReply:
        sig = parse_signal(a["signal"])
        if sig is None:
            raise GuestdError(ErrorCode.BAD_REQUEST, f"unknown signal {a['signal']!r}", details={"field": "signal"})
        table().get(a["id"]).send_signal(sig)
        return {}

    async def op_write(ctx: Request, a: ProcessWriteArgs) -> ProcessWriteReply:
        return {"written": await table().get(a["id"]).write_stdin(a["data"])}

    async def op_close_stdin(ctx: Request, a: ProcessCloseStdinArgs) -> ProcessCloseStdinReply:
        table().get(a["id"]).close_stdin()
        return {}

    async def op_resize(ctx: Request, a: ProcessResizeArgs) -> ProcessResizeReply:
        table().get(a["id"]).resize(a["rows"], a["cols"])
        return {}

    async def op_forget(ctx: Request, a: ProcessForgetArgs) -> ProcessForgetReply:
        table().forget(a["id"])
        return {}

    for name, fn in (
        ("process.start", op_start),
        ("process.list", op_list),
        ("process.attach", op_attach),
        ("process.wait", op_wait),
        ("process.signal", op_signal),
        ("process.write", op_write),
        ("process.close_stdin", op_close_stdin),
        ("process.resize", op_resize),
        ("process.forget", op_forget),
    ):
        services.ops.add(name, fn)

    from guestd.runs import register as register_runs

    register_runs(services)  # kept runs (shell.run / code.run keep: true) belong to this capability
