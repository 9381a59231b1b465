"""The code contexts of one guestd: made, found, closed, re-seeded after a restore; the warm kernel pool."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from guestd.code.contexts import IDLE_CONFIRM_WAIT_S, CodeContext
from guestd.code.kernel_process import Kernel
from guestd.code.kernelspec import PYTHON_KERNEL, ForeignSpec, find_kernelspec
from guestd.code.reseed import kernel_seed
from guestd.code.start import StartWait, gave_up
from guestd.services import derive
from guestd.tables import NamedTable
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.services import Services

log = logging.getLogger("guestd.code")

POOL_RETRY_S = 5.0  # after a pool kernel failed to start; doubled after each failure in a row
POOL_RETRY_MAX_S = 300.0
# Pool kernels starting at once. A start is ~1 s of one CPU; on 2 CPUs two side by side refill a
# pool of 2 in about one start's time, and they never run beside a create's own start (the
# refill waits for those), so they compete only with the workload: bench/code_pool.py.
POOL_STARTS_AT_ONCE = 2
DEFAULT_CONTEXT = "default"


def read_at_interpreter_start(env: dict[str, str] | None) -> list[str]:
    """The variables of ``env`` that act only when a process starts: Python's own (``PYTHONPATH``,
    ``PYTHONHOME``, ...) and the dynamic loader's (``LD_PRELOAD``, ``LD_LIBRARY_PATH``). A pooled
    kernel is already running, so setting them in it would be silently without effect: such a
    create starts its own kernel with them."""
    return sorted(k for k in env or {} if k.startswith(("PYTHON", "LD_")))


@dataclass(eq=False)
class _Coming:
    """A pool kernel being started, and the create that claimed it (its future gets the kernel
    once it is up, or None when its start failed); a taker that gave up (cancelled) leaves the
    kernel to the pool."""

    kernel: Kernel
    taker: asyncio.Future[Kernel | None] | None = None


class Contexts(NamedTable[CodeContext]):
    """All code contexts of the daemon, plus the warm kernel pool."""

    what = "code context"
    field = "context"
    limit = "max_contexts"

    def __init__(self, services: Services) -> None:
        super().__init__(services)
        self.pool: list[Kernel] = []  # ready
        self._coming: list[_Coming] = []  # starting, at most POOL_STARTS_AT_ONCE
        self._starters: set[asyncio.Task[None]] = set()
        self._waiting = 0  # creates waiting for a kernel to start (their own, or one they claimed)
        self._backoff = POOL_RETRY_S
        self._retry_at = 0.0  # loop time before which no pool kernel starts (after a failure)
        self._retry: asyncio.TimerHandle | None = None
        self._closed = False
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
                # The pool holds guestd's own kernels, started without the create's env.
                poolable = spec is None and not read_at_interpreter_start(env)
                pooled = self._take_pooled() if poolable else None
                if pooled is not None:
                    was_pooled = await ctx.start_kernel(pooled)
                else:
                    with self._waiting_for_kernel():
                        if poolable:
                            pooled = await self._take_coming(ctx)
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
    # The pool keeps ``code_pool`` kernels ready. A create takes a ready one; finding none, it
    # claims one the pool is starting (it is ahead of any kernel the create could start) and
    # else starts its own. The pool starts no kernel while creates wait for theirs: a burst's
    # creates get the CPUs first, and the pool refills once they have their kernels.
    def _take_pooled(self) -> Kernel | None:
        while self.pool:
            k = self.pool.pop(0)
            if k.alive:
                self.ensure_pool()  # its replacement starts now: the next create may claim it
                return k
        return None

    async def _take_coming(self, ctx: CodeContext) -> Kernel | None:
        """A pool kernel that is starting and not claimed yet, once it is up: None when there is
        none, or its start failed (the create starts its own). Bounded by the context's
        start_timeout_s when it has one; given up, or the create cancelled, the kernel stays the
        pool's, unless it was handed over already: then it is the context's, which the create's
        end shuts down."""
        coming = next((c for c in self._coming if c.taker is None), None)
        if coming is None:
            return None
        loop = asyncio.get_running_loop()
        taker: asyncio.Future[Kernel | None] = loop.create_future()
        coming.taker = taker
        began = loop.time()
        try:
            await asyncio.wait({taker}, timeout=ctx.start_wait.timeout_s)
        except asyncio.CancelledError:
            if not self._unclaim(coming) and not taker.exception():
                ctx.kernel = taker.result()  # handed over as the create was cancelled: ended with it
            raise
        if self._unclaim(coming):  # not up within start_timeout_s
            waited = loop.time() - began
            raise gave_up(ctx.start_wait, waited, waited)
        return taker.result()

    @staticmethod
    def _unclaim(coming: _Coming) -> bool:
        """A create gives up its claim: the kernel, still starting, is the pool's again (another
        create may claim it). False when it was handed over already."""
        if coming.taker is None or not coming.taker.cancel():
            return False
        coming.taker = None
        return True

    @contextmanager
    def _waiting_for_kernel(self) -> Iterator[None]:
        """A create waits for a kernel start in this block; the pool starts none meanwhile."""
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1
            if not self._waiting:
                self.ensure_pool()

    def ensure_pool(self) -> None:
        """Start pool kernels up to the configured size (those ready, plus those starting that no
        create claimed), at most POOL_STARTS_AT_ONCE at a time; none while a create waits for a
        kernel, or before the retry time after a failed start."""
        size = self.services.config.code_pool
        if size <= 0 or self._closed or self._waiting:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._retry_at:
            if self._retry is None:
                self._retry = loop.call_at(self._retry_at, self._retry_now)
            return
        unclaimed = sum(1 for c in self._coming if c.taker is None)
        while len(self.pool) + unclaimed < size and len(self._coming) < POOL_STARTS_AT_ONCE:
            coming = _Coming(self.new_kernel())
            self._coming.append(coming)
            unclaimed += 1
            task = loop.create_task(self._start_pooled(coming))
            self._starters.add(task)
            task.add_done_callback(self._starters.discard)

    def _retry_now(self) -> None:
        self._retry = None
        self.ensure_pool()

    async def _start_pooled(self, coming: _Coming) -> None:
        """One pool kernel's start: up, it goes to the create that claimed it, else to the pool.
        A guest too slow (or broken) to start one is retried less and less often."""
        k = coming.kernel
        try:
            await k.start(None, None, StartWait())
            stale = await self.catch_up(k) is not None
        except asyncio.CancelledError:  # guestd's shutdown
            self._coming.remove(coming)
            self._hand_over(coming, GuestdError(ErrorCode.UNAVAILABLE, "guestd is shutting down"))
            await k.shutdown()
            raise
        except Exception as exc:
            self._coming.remove(coming)
            self._hand_over(coming, None)
            log.warning("pool kernel failed to start (next try in %g s): %s", self._backoff, exc)
            self._retry_at = asyncio.get_running_loop().time() + self._backoff
            self._backoff = min(self._backoff * 2, POOL_RETRY_MAX_S)
            await k.shutdown()
            self.ensure_pool()
            return
        self._coming.remove(coming)
        if stale:  # came up across a restore and did not confirm its seed: a fresh one instead
            self._hand_over(coming, None)
            await k.shutdown()
            self.ensure_pool()
            return
        self._backoff = POOL_RETRY_S
        if not self._hand_over(coming, k):
            if len(self.pool) < self.services.config.code_pool and not self._closed:
                self.pool.append(k)
            else:
                await k.shutdown()
        self.ensure_pool()

    @staticmethod
    def _hand_over(coming: _Coming, outcome: Kernel | GuestdError | None) -> bool:
        """Give the claiming create its kernel (None: start your own; an error: fail). False when
        no create waits for it (never claimed, or the claim was given up)."""
        taker = coming.taker
        if taker is None or taker.done():
            return False
        if isinstance(outcome, GuestdError):
            taker.set_exception(outcome)
        else:
            taker.set_result(outcome)
        return True

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
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        starters = list(self._starters)
        for task in starters:
            task.cancel()
        await asyncio.gather(*starters, return_exceptions=True)
        kernels = [c.kernel for c in self.by_id.values() if c.kernel is not None] + self.pool
        self.by_id.clear()
        self.pool = []
        await asyncio.gather(*(k.shutdown() for k in kernels), return_exceptions=True)
