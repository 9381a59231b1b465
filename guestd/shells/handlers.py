"""shell handlers: persistent bash sessions (engine: session.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from guestd.services import add_ops, op

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.services import Request, Services
    from guestd.shells.table import Shells
    from guestd.wire.types import (
        ShellCloseArgs,
        ShellCloseReply,
        ShellCreateArgs,
        ShellCreateReply,
        ShellListArgs,
        ShellListReply,
        ShellResizeArgs,
        ShellResizeReply,
        ShellRunArgs,
        ShellRunReply,
    )


class ShellsCapability:
    """The shell ops and lifecycle hooks; the session table on first use."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self._made: Shells | None = None

    def shells(self) -> Shells:
        """The session table, made on first use."""
        if self._made is None:
            from guestd.shells.table import Shells

            self._made = Shells(self.services)
        return self._made

    # -- lifecycle hooks -------------------------------------------------------------------
    async def on_restore(self, entropy: bytes) -> dict[str, list[str]]:
        if self._made is None:
            return {"shells_reseeded": [], "shells_pending": []}
        return await self._made.reseed(entropy)

    def busy(self) -> dict[str, list[str]]:
        return self._made.busy() if self._made is not None else {"busy_shells": []}

    async def shutdown(self) -> None:
        if self._made is not None:
            await self._made.shutdown()

    # -- ops -------------------------------------------------------------------------------
    @op("shell.create")
    async def op_create(self, ctx: Request, a: ShellCreateArgs) -> ShellCreateReply:
        s = await self.shells().create(a["cwd"], a["env"], a["name"])
        return {"id": s.id, "pid": s.pid}

    @op("shell.run")
    async def op_run(self, ctx: Request, a: ShellRunArgs) -> ShellRunReply:
        services = self.services
        runs = services.runs
        if a["keep"] and runs is not None:
            if a["stream"] or a["stdin_stream"] or a["pty"]:
                from guestd.wire.errors import ErrorCode, GuestdError

                raise GuestdError(
                    ErrorCode.BAD_REQUEST,
                    "keep: not with stream, stdin_stream or pty (the run must not need its connection)",
                    details={"field": "keep"},
                )
            session = self.shells().find(a["id"])

            async def kept() -> ShellRunReply:
                cursor = await services.changes_cursor(a["report_changes"])
                return await services.with_changes(cursor, await session.run(a, None))

            reply: ShellRunReply = await runs.keep(ctx, "shell.run", session.id, a["command"], kept)
            return reply
        cursor = await services.changes_cursor(a["report_changes"])
        return await services.with_changes(cursor, await self.shells().find(a["id"]).run(a, ctx))

    @op("shell.resize", control=True)
    async def op_resize(self, ctx: Request, a: ShellResizeArgs) -> ShellResizeReply:
        self.shells().find(a["id"]).resize(a["rows"], a["cols"])
        return {}

    @op("shell.list", control=True)
    async def op_list(self, ctx: Request, a: ShellListArgs) -> ShellListReply:
        if self._made is None:
            return {"sessions": []}
        return {"sessions": [s.describe() for s in self._made.by_id.values()]}

    @op("shell.close")
    async def op_close(self, ctx: Request, a: ShellCloseArgs) -> ShellCloseReply:
        await self.shells().close(a["id"])
        return {}


def register(services: Services) -> None:
    shells = ShellsCapability(services)
    services.on_restore.append(shells.on_restore)
    services.busy.append(shells.busy)
    services.on_shutdown.append(shells.shutdown)
    add_ops(services.ops, shells)
