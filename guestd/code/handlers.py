"""code capability: persistent code contexts, Python or any installed kernelspec (engine: table.py, contexts.py)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from guestd.services import add_ops, op

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.code.contexts import CodeContext
    from guestd.code.table import Contexts
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


class CodeCapability:
    """The code ops and lifecycle hooks; the context manager (and jupyter_client) on first use."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self._made: Contexts | None = None

    def contexts(self) -> Contexts:
        """The code-context manager; made (and jupyter_client imported) on first use."""
        if self._made is None:
            from guestd.code.table import Contexts

            self._made = Contexts(self.services)
            self._made.ensure_pool()
        return self._made

    # -- lifecycle hooks -------------------------------------------------------------------
    def on_start(self) -> None:
        """Kills the kernels a previous guestd may have left when it crashed."""
        kdir = self.services.kernel_dir()
        if os.listdir(kdir):
            from guestd.code.pidfiles import reap_orphan_kernels

            orphans = reap_orphan_kernels(kdir)
            if orphans:
                log.warning("killed %d kernel(s) left by a previous guestd", orphans)

    def prewarm(self) -> None:
        """The pool's kernels, when configured: jupyter_client's import and the kernels' start
        come after guestd's first reply, never before it."""
        if self.services.config.code_prewarm and self.services.config.code_pool > 0:
            self.contexts()

    async def on_restore(self, entropy: bytes) -> dict[str, list[str]]:
        if self._made is None:
            return {"contexts_reseeded": [], "contexts_pending": []}
        return await self._made.reseed(entropy)

    def busy(self) -> dict[str, list[str]]:
        return self._made.busy() if self._made is not None else {"busy_contexts": []}

    async def shutdown(self) -> None:
        if self._made is not None:
            await self._made.shutdown()

    def info(self) -> dict[str, object]:
        """Which Python each kernel runs (system.info)."""
        from guestd.code.python import kernels_info

        return {"kernels": kernels_info(self.services.config.code_python)}

    # -- ops -------------------------------------------------------------------------------
    async def _resolve(self, ref: str | None, create_default: bool = False) -> CodeContext:
        if ref is None and create_default:
            return await self.contexts().get_or_create_default()
        return self.contexts().find(ref if ref is not None else "default")

    @op("code.create")
    async def op_create(self, ctx: Request, a: CodeCreateArgs) -> CodeCreateReply:
        c, pooled, existing = await self.contexts().create(
            a["cwd"], a["env"], a["name"], a["kernel"], a["start_timeout_s"]
        )
        assert c.kernel is not None
        return {
            "id": c.id,
            "name": c.name,
            "pid": c.kernel.pid,
            "pooled": pooled,
            "existing": existing,
            "kernel": c.kernel_name,
        }

    @op("code.run")
    async def op_run(self, ctx: Request, a: CodeRunArgs) -> CodeRunReply:
        c = await self._resolve(a["context"], create_default=True)
        runs = self.services.runs
        if a["keep"] and runs is not None:
            if a["stream"]:
                from guestd.wire.errors import ErrorCode, GuestdError

                raise GuestdError(
                    ErrorCode.BAD_REQUEST,
                    "keep: not with stream (the run must not need its connection)",
                    details={"field": "keep"},
                )

            async def kept() -> CodeRunReply:
                return await c.run(a["code"], a, None)

            reply: CodeRunReply = await runs.keep(ctx, "code.run", c.id, a["code"], kept)
            return reply
        return await c.run(a["code"], a, ctx)

    @op("code.interrupt", control=True)
    async def op_interrupt(self, ctx: Request, a: CodeInterruptArgs) -> CodeInterruptReply:
        await (await self._resolve(a["context"])).interrupt()
        return {}

    @op("code.restart")
    async def op_restart(self, ctx: Request, a: CodeRestartArgs) -> CodeRestartReply:
        c = await self._resolve(a["context"])
        async with c.lock:  # never swap the kernel under a running cell
            return {"pid": await c.restart()}

    @op("code.close")
    async def op_close(self, ctx: Request, a: CodeCloseArgs) -> CodeCloseReply:
        await self.contexts().close((await self._resolve(a["context"])).id)
        return {}

    @op("code.list", control=True)
    async def op_list(self, ctx: Request, a: CodeListArgs) -> CodeListReply:
        if self._made is None:
            return {"contexts": [], "pool_ready": 0}
        cs = self._made
        return {"contexts": [c.describe() for c in cs.by_id.values()], "pool_ready": len(cs.pool)}


def register(services: Services) -> None:
    code = CodeCapability(services)
    services.on_start.append(code.on_start)
    services.after_first_reply.append(code.prewarm)
    services.info.append(code.info)
    services.on_restore.append(code.on_restore)
    services.busy.append(code.busy)
    services.on_shutdown.append(code.shutdown)
    add_ops(services.ops, code)
