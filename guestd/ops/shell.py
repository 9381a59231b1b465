"""shell capability: persistent bash sessions (see guestd.shells)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.server.connection import RequestContext
    from guestd.server.daemon import Daemon
    from guestd.shells import Shells
    from guestd.wire.types import (
        ShellCloseArgs,
        ShellCloseReply,
        ShellCreateArgs,
        ShellCreateReply,
        ShellListArgs,
        ShellListReply,
        ShellRunArgs,
        ShellRunReply,
    )


def register(daemon: Daemon) -> None:
    def shells() -> Shells:
        return daemon.shells()

    async def op_create(ctx: RequestContext, a: ShellCreateArgs) -> ShellCreateReply:
        s = await shells().create(a["cwd"], a["env"], a["name"])
        return {"id": s.id, "pid": s.pid}

    async def op_run(ctx: RequestContext, a: ShellRunArgs) -> ShellRunReply:
        return await shells().get(a["id"]).run(a)

    async def op_list(ctx: RequestContext, a: ShellListArgs) -> ShellListReply:
        if not daemon.has_shells():
            return {"sessions": []}
        return {"sessions": [s.describe() for s in shells().sessions.values()]}

    async def op_close(ctx: RequestContext, a: ShellCloseArgs) -> ShellCloseReply:
        await shells().close(a["id"])
        return {}

    for name, fn in (
        ("shell.create", op_create),
        ("shell.run", op_run),
        ("shell.list", op_list),
        ("shell.close", op_close),
    ):
        daemon.dispatcher.add(name, fn)
