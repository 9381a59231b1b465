"""shell handlers: persistent bash sessions (engine: session.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def register(services: Services) -> None:
    made: list[Shells] = []  # on first use

    def shells() -> Shells:
        if not made:
            from guestd.shells.table import Shells

            made.append(Shells(services))
        return made[0]

    async def on_restore(entropy: bytes) -> dict[str, list[str]]:
        return await made[0].reseed(entropy) if made else {"shells_reseeded": [], "shells_pending": []}

    async def shutdown() -> None:
        if made:
            await made[0].shutdown()

    services.on_restore.append(on_restore)
    services.busy.append(lambda: made[0].busy() if made else {"busy_shells": []})
    services.on_shutdown.append(shutdown)

    async def op_create(ctx: Request, a: ShellCreateArgs) -> ShellCreateReply:
        s = await shells().create(a["cwd"], a["env"], a["name"])
        return {"id": s.id, "pid": s.pid}

    async def op_run(ctx: Request, a: ShellRunArgs) -> ShellRunReply:
        if a["keep"] and services.runs is not None:
            if a["stream"] or a["stdin_stream"] or a["pty"]:
                from guestd.wire.errors import ErrorCode, GuestdError

                raise GuestdError(
                    ErrorCode.BAD_REQUEST,
                    "keep: not with stream, stdin_stream or pty (the run must not need its connection)",
                    details={"field": "keep"},
                )
            session = shells().get(a["id"])

            async def kept() -> ShellRunReply:
                cursor = await services.changes_cursor(a["report_changes"])
                return await services.with_changes(cursor, await session.run(a, None))

            reply: ShellRunReply = await services.runs.keep(ctx, "shell.run", session.id, a["command"], kept)
            return reply
        cursor = await services.changes_cursor(a["report_changes"])
        return await services.with_changes(cursor, await shells().get(a["id"]).run(a, ctx))

    async def op_resize(ctx: Request, a: ShellResizeArgs) -> ShellResizeReply:
        shells().get(a["id"]).resize(a["rows"], a["cols"])
        return {}

    async def op_list(ctx: Request, a: ShellListArgs) -> ShellListReply:
        if not made:
            return {"sessions": []}
        return {"sessions": [s.describe() for s in shells().sessions.values()]}

    async def op_close(ctx: Request, a: ShellCloseArgs) -> ShellCloseReply:
        await shells().close(a["id"])
        return {}

    for name, fn in (
        ("shell.create", op_create),
        ("shell.run", op_run),
        ("shell.list", op_list),
        ("shell.resize", op_resize),
        ("shell.close", op_close),
    ):
        services.ops.add(name, fn)
