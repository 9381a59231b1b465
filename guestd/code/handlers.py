"""code capability: persistent code contexts, Python or any installed kernelspec (engine: contexts.py)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.code.contexts import CodeContext, Contexts
    from guestd.services import Request, Services
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

log = logging.getLogger("guestd.code")


def register(services: Services) -> None:
    made: list[Contexts] = []

    def contexts() -> Contexts:
        """The code-context manager; made (and jupyter_client imported) on first use."""
        if not made:
            from guestd.code.contexts import Contexts

            made.append(Contexts(services))
            made[0].ensure_pool()
        return made[0]

    def on_start() -> None:
        kdir = services.kernel_dir()
        if os.listdir(kdir):  # a previous guestd may have crashed and left kernels
            from guestd.code.kernel_process import reap_orphan_kernels

            orphans = reap_orphan_kernels(kdir)
            if orphans:
                log.warning("killed %d kernel(s) left by a previous guestd", orphans)

    def prewarm() -> None:
        # jupyter_client's import and the kernels' start: not before guestd's first reply
        if services.config.code_prewarm and services.config.code_pool > 0:
            contexts()

    async def on_restore(entropy: bytes) -> dict[str, list[str]]:
        return await made[0].reseed(entropy) if made else {"contexts_reseeded": [], "contexts_pending": []}

    async def shutdown() -> None:
        if made:
            await made[0].shutdown()

    def info() -> dict[str, object]:
        from guestd.code.python import kernels_info

        return {"kernels": kernels_info(services.config.code_python)}

    services.on_start.append(on_start)
    services.after_first_reply.append(prewarm)
    services.info.append(info)  # which Python each kernel runs
    services.on_restore.append(on_restore)
    services.busy.append(lambda: made[0].busy() if made else {"busy_contexts": []})
    services.on_shutdown.append(shutdown)

    async def resolve(ref: str | None, create_default: bool = False) -> CodeContext:
        if ref is None and create_default:
            return await contexts().get_or_create_default()
        return contexts().find(ref if ref is not None else "default")

    async def op_create(ctx: Request, a: CodeCreateArgs) -> CodeCreateReply:
        c, pooled, existing = await contexts().create(a["cwd"], a["env"], a["name"], a["kernel"], a["start_timeout_s"])
        assert c.kernel is not None
        return {
            "id": c.id,
            "name": c.name,
            "pid": c.kernel.pid,
            "pooled": pooled,
            "existing": existing,
            "kernel": c.kernel_name,
        }

    async def op_run(ctx: Request, a: CodeRunArgs) -> CodeRunReply:
        c = await resolve(a["context"], create_default=True)
        if a["keep"] and services.runs is not None:
            if a["stream"]:
                from guestd.wire.errors import ErrorCode, GuestdError

                raise GuestdError(
                    ErrorCode.BAD_REQUEST,
                    "keep: not with stream (the run must not need its connection)",
                    details={"field": "keep"},
                )

            async def kept() -> CodeRunReply:
                return await c.run(a["code"], a, None)

            reply: CodeRunReply = await services.runs.keep(ctx, "code.run", c.id, a["code"], kept)
            return reply
        return await c.run(a["code"], a, ctx)

    async def op_interrupt(ctx: Request, a: CodeInterruptArgs) -> CodeInterruptReply:
        await (await resolve(a["context"])).interrupt()
        return {}

    async def op_restart(ctx: Request, a: CodeRestartArgs) -> CodeRestartReply:
        c = await resolve(a["context"])
        async with c.lock:  # never swap the kernel under a running cell
            return {"pid": await c.restart()}

    async def op_close(ctx: Request, a: CodeCloseArgs) -> CodeCloseReply:
        await contexts().close((await resolve(a["context"])).id)
        return {}

    async def op_list(ctx: Request, a: CodeListArgs) -> CodeListReply:
        if not made:
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
        services.ops.add(name, fn)
