"""code capability: persistent Python contexts (see guestd.contexts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.contexts import CodeContext, Contexts
    from guestd.server.connection import RequestContext
    from guestd.server.daemon import Daemon
    from guestd.wire.types import (
        CodeCloseArgs,
        CodeCloseReply,
        CodeCreateArgs,
        CodeCreateReply,
        CodeInterruptArgs,
        CodeInterruptReply,
        CodeListArgs,
        CodeListReply,
        CodeRestartArgs,
        CodeRestartReply,
        CodeRunArgs,
        CodeRunReply,
    )


def register(daemon: Daemon) -> None:
    def contexts() -> Contexts:
        return daemon.contexts()  # first use imports jupyter_client, not before

    async def resolve(ref: str | None, create_default: bool = False) -> CodeContext:
        if ref is None and create_default:
            return await contexts().get_or_create_default()
        return contexts().find(ref if ref is not None else "default")

    async def op_create(ctx: RequestContext, a: CodeCreateArgs) -> CodeCreateReply:
        c, pooled, existing = await contexts().create(a["cwd"], a["env"], a["name"])
        assert c.kernel is not None
        return {"id": c.id, "name": c.name, "pid": c.kernel.pid, "pooled": pooled, "existing": existing}

    async def op_run(ctx: RequestContext, a: CodeRunArgs) -> CodeRunReply:
        c = await resolve(a["context"], create_default=True)
        return await c.run(a["code"], a, ctx)

    async def op_interrupt(ctx: RequestContext, a: CodeInterruptArgs) -> CodeInterruptReply:
        await (await resolve(a["context"])).interrupt()
        return {}

    async def op_restart(ctx: RequestContext, a: CodeRestartArgs) -> CodeRestartReply:
        c = await resolve(a["context"])
        async with c.lock:  # never swap the kernel under a running cell
            return {"pid": await c.restart()}

    async def op_close(ctx: RequestContext, a: CodeCloseArgs) -> CodeCloseReply:
        await contexts().close((await resolve(a["context"])).id)
        return {}

    async def op_list(ctx: RequestContext, a: CodeListArgs) -> CodeListReply:
        if not daemon.has_contexts():
            return {"contexts": [], "pool_ready": 0}
        cs = contexts()
        return {"contexts": [c.describe() for c in cs.contexts.values()], "pool_ready": len(cs.pool)}

    for name, fn in (
        ("code.create", op_create),
        ("code.run", op_run),
        ("code.interrupt", op_interrupt),
        ("code.restart", op_restart),
        ("code.close", op_close),
        ("code.list", op_list),
    ):
        daemon.dispatcher.add(name, fn)
