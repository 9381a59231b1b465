"""The code contexts of one guestd: made, found, closed, re-seeded after a restore; the warm kernel pool."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING

from guestd.code.contexts import IDLE_CONFIRM_WAIT_S, CodeContext
from guestd.code.kernel_process import Kernel
from guestd.code.kernelspec import PYTHON_KERNEL, ForeignSpec, find_kernelspec
from guestd.code.reseed import kernel_seed
from guestd.code.start import StartWait
from guestd.services import derive
from guestd.tables import NamedTable
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.services import Services

log = logging.getLogger("guestd.code")

POOL_RETRY_S = 5.0  # after a pool kernel failed to start; doubled after each failure in a row
POOL_RETRY_MAX_S = 300.0
DEFAULT_CONTEXT = "default"


class Contexts(NamedTable[CodeContext]):
    """All code contexts of the daemon, plus the warm kernel pool."""

    what = "code context"
    field = "context"
    limit = "max_contexts"

    def __init__(self, services: Services) -> None:
        super().__init__(services)
        self.pool: list[Kernel] = []
        self._refill: asyncio.Task[None] | None = None
        self._counter = 0
        self.epoch = 0  # restores seen; a kernel spawned before the last one needs its seed
        self._restore_key = b""  # the last restore's, for kernels that come up after it

    def new_kernel(self, spec: ForeignSpec | None = None) -> Kernel:
        """A kernel not started yet: guestd's own Python kernel, or ``spec``'s. Its id names the
        guestd that made it (guestd.code.pidfiles tells a crashed guestd's kernels by it)."""
        self._counter += 1
        kid = f"k{os.getpid()}-{self._counter}-{os.urandom(3).hex()}"
        return Kernel(self.services, kid, spec, self.epoch)

    async def create(
        self,
        cwd: str | None,
        env: dict[str, str] | None,
        name: str | None,
        kernel: str | None = None,
        start_timeout_s: float | None = None,
    ) -> tuple[CodeContext, bool, bool]:
        """Returns (context, pooled, existing). A name that exists returns that context.
        ``kernel``: None or "python" for guestd's own kernel, else an installed kernelspec.
        ``start_timeout_s``: the wait for this context's kernel starts (restarts too); None:
        guestd's default, which follows the kernel's progress (guestd.code.start)."""
        existing = self.named(name) if name is not None else None
        if existing is not None:
            return existing, False, True
        self.check_room()
        if cwd is not None and not os.path.isdir(cwd):
            raise GuestdError(
                ErrorCode.NOT_FOUND, f"cwd is not a directory: {cwd}", details={"stage": "cwd", "cwd": cwd}
            )
        spec = None
        if kernel is not None and kernel != PYTHON_KERNEL:
            spec = await self.services.run_in_io(find_kernelspec, kernel)
        cid = "c" + os.urandom(6).hex()
        ctx = CodeContext(self, cid, name, cwd, env, spec, StartWait(start_timeout_s))
        try:
            with self.reserved(ctx):
                pooled = self._take_pooled() if spec is None else None  # the pool holds guestd's kernels only
                was_pooled = await ctx.start_kernel(pooled)
        except BaseException:  # out of the table by now: no one finds the context while its kernel ends
            if ctx.kernel is not None:
                await ctx.kernel.shutdown()
            raise
        self.ensure_pool()
        return ctx, was_pooled, False

    async def get_or_create_default(self) -> CodeContext:
        try:
            return self.find(DEFAULT_CONTEXT)
        except GuestdError:
            ctx, _, _ = await self.create(None, None, DEFAULT_CONTEXT)
            return ctx

    async def close(self, ref: str) -> None:
        await self.remove(ref).close()

    # -- pool ---------------------------------------------------------------------------
    def _take_pooled(self) -> Kernel | None:
        while self.pool:
            k = self.pool.pop(0)
            if k.alive:
                return k
        return None

    def ensure_pool(self) -> None:
        if self.services.config.code_pool <= 0:
            return
        if self._refill is None or self._refill.done():
            self._refill = asyncio.get_running_loop().create_task(self._refill_pool())

    async def _refill_pool(self) -> None:
        # One kernel at a time: a start costs ~1 s of CPU, and the workload comes first. A guest
        # too slow (or broken) to start one is retried less and less often, not every 5 s.
        backoff = POOL_RETRY_S
        while len(self.pool) < self.services.config.code_pool:
            k = self.new_kernel()
            try:
                await k.start(None, None, StartWait())
                stale = await self.catch_up(k) is not None
            except asyncio.CancelledError:
                await k.shutdown()
                raise
            except Exception as exc:
                log.warning("pool kernel failed to start (next try in %g s): %s", backoff, exc)
                await k.shutdown()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, POOL_RETRY_MAX_S)
                continue
            if stale:  # came up across a restore and did not confirm its seed: a fresh one instead
                await k.shutdown()
                continue
            backoff = POOL_RETRY_S
            self.pool.append(k)

    def busy(self) -> dict[str, list[str]]:
        return {"busy_contexts": [c.id for c in self.by_id.values() if c.busy]}

    async def reseed(self, entropy: bytes) -> dict[str, list[str]]:
        """After a restore: fresh random state in every kernel, contexts and pool, all at once
        through their side channels (guestd.code.reseed), none waiting on another."""
        self.epoch += 1
        self._restore_key = derive(entropy, "code-kernels")
        contexts = list(self.by_id.values())
        pooled = list(self.pool)
        outcomes = await asyncio.gather(
            *(self._reseed_context(c) for c in contexts),
            *(self._reseed_pooled(k) for k in pooled),
            return_exceptions=True,
        )
        report: dict[str, list[str]] = {"contexts_reseeded": [], "contexts_pending": [], "reseed_errors": []}
        for ctx, outcome in zip(contexts, outcomes, strict=False):
            if isinstance(outcome, BaseException):
                report["reseed_errors"].append(f"context {ctx.id}: {outcome!r}")
            else:
                report["contexts_reseeded" if outcome else "contexts_pending"].append(ctx.id)
        for outcome in outcomes[len(contexts) :]:
            if isinstance(outcome, BaseException):
                report["reseed_errors"].append(f"pooled kernel: {outcome!r}")
        return report

    async def _reseed_context(self, ctx: CodeContext) -> bool:
        kernel, epoch = ctx.kernel, self.epoch
        if kernel is None or not kernel.ready:
            return False  # starting: CodeContext._catch_up re-seeds it once it answers
        done = await ctx.reseed(kernel_seed(self._restore_key, kernel.pid))
        if done and kernel.epoch < epoch:
            kernel.epoch = epoch
        return done

    async def _reseed_pooled(self, kernel: Kernel) -> None:
        """A pooled kernel confirms its seed, or it leaves the pool (a fresh one replaces it)."""
        if await self.catch_up(kernel) is None or kernel not in self.pool:
            return
        self.pool.remove(kernel)
        await kernel.shutdown()
        self.ensure_pool()

    async def catch_up(self, kernel: Kernel) -> bytes | None:
        """Give ``kernel`` the last restore's seed if it has not had it (spawned before that
        restore). None: it is current (confirmed, or born after); else the seed it did not
        confirm, for a hidden cell."""
        epoch = self.epoch
        if kernel.epoch >= epoch or kernel.spec is not None or not kernel.alive:
            return None
        seed = kernel_seed(self._restore_key, kernel.pid)
        channel = kernel.reseeder
        if channel is not None and channel.send(seed) and await channel.confirmed(IDLE_CONFIRM_WAIT_S):
            kernel.epoch = max(kernel.epoch, epoch)
            return None
        return seed

    async def shutdown(self) -> None:
        if self._refill is not None:
            self._refill.cancel()
            await asyncio.gather(self._refill, return_exceptions=True)
        kernels = [c.kernel for c in self.by_id.values() if c.kernel is not None] + self.pool
        self.by_id.clear()
        self.pool = []
        await asyncio.gather(*(k.shutdown() for k in kernels), return_exceptions=True)
