"""A persistent code context: one kernel (guestd's Python kernel or an installed kernelspec),
its runs serialized and bounded, restarts, re-seeding after a restore.

The table of contexts and the warm kernel pool: guestd.code.table. The parts below a context:
guestd.code.kernelspec (which kernels can be named and their command),
guestd.code.kernel_process (one kernel's process and channels, driven with jupyter_client,
imported on first use only) and guestd.code.messages (what a kernel's messages make of a run:
pure, no I/O).

Every wait on a kernel is bounded: runs have a deadline (interrupt, then restart
after a grace), kernel death is seen at once through a pidfd, and start-up has
its own wait, the host's or one that follows the kernel's progress (then
``unavailable``, and the kernel is ended: guestd.code.start).

Trust between contexts (SECURITY.md, "code contexts"): every kernel runs as the one
workload user, so contexts are one trust domain with each other and with every workload
process: isolation between them is not promised (that needs separate users or VMs). What
guestd does promise is that a new, restarted or pooled kernel starts from guestd's state,
not the workload's: an IPython directory only guestd writes, no user site-packages, and
no key on disk at any time (the kernel gets it over a socketpair once it is non-dumpable).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from guestd.children import usage_between
from guestd.code.kernel import PRIVATE_NAME
from guestd.code.kernelspec import PYTHON_KERNEL, ForeignSpec
from guestd.code.messages import RunState, fit_reply
from guestd.code.start import StartWait
from guestd.output.capture import OutputCapture, capture_fields
from guestd.services import derive
from guestd.wire.errors import ErrorCode, GuestdError, limit_error

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.children import KilledBy
    from guestd.children.cgroups import RunUsage
    from guestd.code.kernel_process import Kernel
    from guestd.services import Services
    from guestd.wire.types import (
        CodeRunArgs,
        CodeRunReply,
        CodeRunStatus,
        CodeRunTimeoutAction,
        ContextInfoRecord,
        ContextInfoState,
    )

log = logging.getLogger("guestd.code")


# Waits for a kernel's confirmation of its seed after a restore (guestd.code.reseed). An idle
# kernel's re-seed thread answers within a millisecond; a second means the thread is gone
# (a cell closed its channel) or the guest is starved: then a hidden cell re-seeds it. A busy
# kernel answers as soon as its cell lets a thread run: at once in a sleep or I/O, within the
# 5 ms switch interval in a Python loop, only when it returns from a C call holding the GIL;
# the restore does not wait longer than BUSY for it (it is pending: CodeContext.reseed).
IDLE_CONFIRM_WAIT_S = 1.0
BUSY_CONFIRM_WAIT_S = 0.05
NEXT_CELL_CONFIRM_WAIT_S = 1.0  # a pending seed, before the context's next cell


@dataclass
class _Ending:
    """How a cell's run ended, beside what its messages made of it (RunState)."""

    status: CodeRunStatus
    timeout_action: CodeRunTimeoutAction | None = None
    exit_reason: str | None = None  # status "died": why the kernel ended
    usage_after: RunUsage | None = None  # timeout_action "restarted": the counters before the restart


class ContextTable(Protocol):
    """What a context needs of its table (guestd.code.table.Contexts): guestd's services, new
    kernels (each knows the restores seen when it was made), and the last restore's seed for
    a kernel that came up across it (``None``: it is current)."""

    services: Services

    def new_kernel(self, spec: ForeignSpec | None) -> Kernel: ...

    async def catch_up(self, kernel: Kernel) -> bytes | None: ...


class CodeContext:
    """One code context: its kernel, its runs one at a time (the rest queue, bounded), restarts,
    re-seeding after a restore."""

    def __init__(
        self,
        manager: ContextTable,
        cid: str,
        name: str | None,
        cwd: str | None,
        env: dict[str, str] | None,
        spec: ForeignSpec | None = None,
        start_wait: StartWait | None = None,
    ) -> None:
        self.manager = manager
        self.id = cid
        self.name = name
        self.cwd = cwd
        self.env = env
        self.spec = spec  # None: guestd's own Python kernel
        self.start_wait = start_wait or StartWait()  # its kernel's starts: the first and every restart
        self.kernel: Kernel | None = None
        self.lock = asyncio.Lock()
        self.waiting = 0
        self.busy = False
        self.execution_count = 0
        self.last_activity = time.time()
        self.restarts = 0
        self._interrupted = False  # set by code.interrupt so the run reports "interrupted"
        self._abandoned: tuple[RunState, Kernel, float] | None = None  # a cancelled run still finishing
        self.pending_seed: bytes | None = None  # set by a restore; applied before the next cell
        self._settler: asyncio.Task[None] | None = None

    @property
    def state(self) -> ContextInfoState:
        if self.kernel is None:
            return "starting"
        if not self.kernel.alive:
            return "dead"
        return "busy" if self.busy else "idle"

    def describe(self) -> ContextInfoRecord:
        k = self.kernel
        return {
            "id": self.id,
            "name": self.name,
            "state": self.state,
            "pid": k.pid if k else None,
            "memory": k.memory() if k and k.alive else None,
            "last_activity": self.last_activity,
            "execution_count": self.execution_count,
            "queued": self.waiting,
            "restarts": self.restarts,
            "kernel": self.kernel_name,
        }

    @property
    def kernel_name(self) -> str:
        return PYTHON_KERNEL if self.spec is None else self.spec.name

    # -- running ----------------------------------------------------------------------
    async def run(self, code: str, opts: CodeRunArgs, ctx: Any) -> CodeRunReply:
        limits = self.manager.services.config.limits
        if self.waiting >= limits.max_code_queue:
            raise limit_error("max_code_queue", limits.max_code_queue, f"context {self.id} has too many queued runs")
        # The timeout covers the wait in the queue; without one the wait has its own bound
        # (config code.queue_wait_s). A run that never got the context fails as 'timeout'.
        loop = asyncio.get_running_loop()
        queued_at = loop.time()
        budget = opts["timeout_s"] if opts["timeout_s"] is not None else self.manager.services.config.code_queue_wait_s
        self.waiting += 1
        try:
            await asyncio.wait_for(self.lock.acquire(), budget)
        except TimeoutError:
            raise self._queue_timeout(budget) from None
        finally:
            self.waiting -= 1
        handed_off = False
        try:
            if opts["timeout_s"] is not None:
                left = opts["timeout_s"] - (loop.time() - queued_at)
                if left <= 0:
                    raise self._queue_timeout(budget)
                opts = {**opts, "timeout_s": left}
            self.busy = True
            return await self._run_locked(code, opts, ctx)
        except asyncio.CancelledError:
            if self._abandoned is not None:
                # The interrupted cell may still be finishing; the next run must not be sent
                # before it has (ipykernel would abort it). A background task keeps the lock.
                handed_off = True
                self._settler = asyncio.get_running_loop().create_task(self._settle(*self._abandoned))
            raise
        finally:
            if not handed_off:
                self.busy = False
                self.last_activity = time.time()
                self.lock.release()

    def _queue_timeout(self, waited: float) -> GuestdError:
        return GuestdError(
            ErrorCode.TIMEOUT,
            f"context {self.id} stayed busy for {waited:g} s; the cell was not run",
            details={"stage": "queue", "context": self.id, "waited_s": waited},
        )

    async def _settle(self, st: RunState, kernel: Kernel, grace: float) -> None:
        try:
            if await self._wait_done(st, kernel, grace) == "timeout" and kernel.alive:
                await self.restart()
        except Exception:
            log.exception("context %s: settling an abandoned run failed", self.id)
        finally:
            if kernel.current is st:
                kernel.current = None
            self._abandoned = None
            self.busy = False
            self.last_activity = time.time()
            self.lock.release()

    async def reseed(self, seed: bytes) -> bool:
        """After a restore: True when the kernel confirmed ``seed`` before this returns (idle or
        running a cell), False when it is pending (a cell in a C call holding the GIL, a kernel
        still starting): then the seed is applied as soon as the kernel lets its re-seed
        thread run, and always before the context's next cell (:meth:`_settle_seed`)."""
        kernel = self.kernel
        if kernel is None or not kernel.ready:
            return False  # starting: Contexts.catch_up re-seeds it once it answers
        if not kernel.alive or self.spec is not None:
            return True  # nothing to re-seed: a dead kernel restarts fresh; a foreign one is not Python
        self.pending_seed = seed
        if kernel.reseeder is not None and kernel.reseeder.send(seed):
            wait = BUSY_CONFIRM_WAIT_S if self.lock.locked() else IDLE_CONFIRM_WAIT_S
            if await kernel.reseeder.confirmed(wait):
                if self.pending_seed is seed:
                    self.pending_seed = None
                return True
        if self.lock.locked():
            return False  # busy, and its thread did not answer: before its next cell
        async with self.lock:  # idle, without a working side channel: a hidden cell
            await self._reseed_locked()
        return True

    async def _settle_seed(self) -> None:
        """Before a cell: a seed left pending by a restore is confirmed by the kernel (its thread
        runs at once now that no cell holds the interpreter), or a hidden cell applies it."""
        kernel = self.kernel
        channel = kernel.reseeder if kernel is not None else None
        if channel is not None and await channel.confirmed(NEXT_CELL_CONFIRM_WAIT_S):
            self.pending_seed = None
            return
        await self._reseed_locked()

    async def _reseed_locked(self) -> None:
        """The hidden cell: the launcher's own re-seed (guestd.code.kernel._reseed) run by the
        message loop. Its seed differs from the side channel's, which may still apply late:
        a seed applied twice would repeat the numbers drawn in between."""
        seed, self.pending_seed = self.pending_seed, None
        if seed is None or self.kernel is None or not self.kernel.alive or self.spec is not None:
            return  # a foreign kernel's language is not Python: it is not re-seeded
        code = f"__import__('sys').modules[{PRIVATE_NAME!r}]._reseed({derive(seed, 'hidden-cell')!r})\n"
        await self._run_locked(code, _SETUP_OPTS, None, silent=True)

    async def _run_locked(self, code: str, opts: CodeRunArgs, ctx: Any, *, silent: bool = False) -> CodeRunReply:
        """One cell, the context's lock held: sent, waited for (:meth:`_await_end`), reported."""
        if self.pending_seed is not None and not silent:
            await self._settle_seed()  # a restore happened while this context was busy
        kernel = self._live_kernel()
        t0 = time.monotonic()
        st = self._run_state(opts, ctx)
        st.msg_id = kernel.kc.execute(
            code, silent=silent, store_history=not silent, allow_stdin=st.input_lines is not None, stop_on_error=True
        )
        kernel.current = st  # replies cannot arrive before we are back in the event loop
        before = kernel.usage_now()
        try:
            ending = await self._await_end(st, kernel, opts)
        finally:
            if self._abandoned is None:
                kernel.current = None
            self._interrupted = False
        if st.execution_count is not None:
            self.execution_count = st.execution_count
        # A restarted kernel's counters were read before the restart: its leaf is gone after it.
        after = ending.usage_after if ending.timeout_action == "restarted" else kernel.usage_now()
        why: KilledBy | None = "timeout" if ending.status == "timeout" else None
        if ending.status == "died" and kernel.child is not None:
            why = kernel.child.exit_info()["killed_by"]
        streamed = bool(opts["stream"])
        reply: CodeRunReply = {
            "context": self.id,
            "status": ending.status,
            "timeout_action": ending.timeout_action,
            "exit_reason": ending.exit_reason,
            **capture_fields(st.stdout, st.stderr, streamed=streamed),
            "results": [] if streamed else st.results,
            "results_dropped": st.results_dropped,
            "error": st.error,
            "stdin_exhausted": st.stdin_exhausted,
            "execution_count": st.execution_count,
            "duration_s": time.monotonic() - t0,
            **usage_between(before, after, why, None),  # "run_id": guestd.runs adds it
        }
        return fit_reply(reply, st)

    def _live_kernel(self) -> Kernel:
        kernel = self.kernel
        if kernel is not None and kernel.alive:
            return kernel
        reason = kernel.died.result() if kernel is not None and kernel.died.done() else "not started"
        raise GuestdError(
            ErrorCode.UNAVAILABLE,
            f"context {self.id} has no live kernel ({reason}); restart it",
            details={"context": self.id, "exit_reason": reason},
        )

    def _run_state(self, opts: CodeRunArgs, ctx: Any) -> RunState:
        """A run's state as the request asks: its capture, stream, input lines and frame bound."""
        lines = opts.get("input_lines")
        st = RunState(
            "",
            OutputCapture(opts["max_output"], opts["capture"]),
            OutputCapture(opts["max_output"], opts["capture"]),
            opts["strip_ansi"],
            ctx if opts["stream"] else None,
            list(lines) if lines is not None else None,
            self.manager.services.config.limits,
        )
        max_frame = getattr(ctx, "max_frame", None)
        if isinstance(max_frame, int):
            st.max_frame = max_frame
        return st

    async def _await_end(self, st: RunState, kernel: Kernel, opts: CodeRunArgs) -> _Ending:
        """The cell's end: done (its status from its messages), its kernel dead, or its timeout.
        Cancelled (nobody waits any more), the cell is interrupted and left to settle."""
        try:
            outcome = await self._wait_done(st, kernel, opts["timeout_s"])
        except asyncio.CancelledError:
            kernel.interrupt()  # nobody waits for this cell any more: stop it, like a cancelled exec
            st.stream = None
            self._abandoned = (st, kernel, opts["interrupt_grace_s"])
            raise
        if outcome == "died":
            return _Ending("died", exit_reason=kernel.died.result())
        if outcome == "timeout":
            return await self._end_timed_out(st, kernel, opts["interrupt_grace_s"])
        return _Ending(st.finish(interrupted=self._interrupted, foreign=self.spec is not None))

    async def _end_timed_out(self, st: RunState, kernel: Kernel, grace: float) -> _Ending:
        """A cell past its timeout is interrupted; one still running ``grace`` later costs the
        context its kernel's state (a restart: a new kernel, same id)."""
        kernel.interrupt()
        if await self._wait_done(st, kernel, grace) == "done":
            return _Ending("timeout", timeout_action="interrupted")
        ending = _Ending("timeout", timeout_action="restarted", usage_after=kernel.usage_now())
        await self.restart()
        return ending

    async def _wait_done(self, st: RunState, kernel: Kernel, timeout: float | None) -> str:
        if st.done.is_set():
            return "done"
        if kernel.died.done():
            return "died"
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[str] = loop.create_future()

        def finish(outcome: str) -> None:
            if not waiter.done():
                waiter.set_result(outcome)

        def on_died(_: object) -> None:
            finish("died")

        done_task = loop.create_task(st.done.wait())
        done_task.add_done_callback(lambda _: finish("done"))
        kernel.died.add_done_callback(on_died)
        timer = loop.call_later(timeout, finish, "timeout") if timeout is not None else None
        try:
            return await waiter
        finally:
            done_task.cancel()
            kernel.died.remove_done_callback(on_died)
            if timer is not None:
                timer.cancel()

    async def interrupt(self) -> None:
        if self.kernel is not None:
            self._interrupted = True
            self.kernel.interrupt()

    async def start_kernel(self, pooled: Kernel | None) -> bool:
        """Attach a kernel: a pooled one (then apply cwd/env) or a fresh one. Returns pooled-ness."""
        if pooled is not None:
            self.kernel = pooled
            await self._catch_up(pooled)
            if self.cwd or self.env:
                setup = "import os as _o\n"
                if self.cwd:
                    setup += f"_o.chdir({self.cwd!r})\n"
                if self.env:
                    setup += f"_o.environ.update({self.env!r})\n"
                setup += "del _o\n"
                res = await self._run_locked(setup, _SETUP_OPTS, None)
                if res["status"] != "ok":
                    err = res.get("error")
                    ename, evalue = (err["ename"], err["evalue"]) if err else (None, None)
                    raise GuestdError(
                        ErrorCode.NOT_FOUND if ename == "FileNotFoundError" else ErrorCode.BAD_REQUEST,
                        f"cannot apply cwd/env: {ename}: {evalue}",
                        details={"stage": "cwd"},
                    )
                self.execution_count = 0
            return True
        k = self.manager.new_kernel(self.spec)
        self.kernel = k
        # Failed, given up or cancelled: the caller ends the kernel (self.kernel) before it answers.
        await k.start(self.cwd, self.env, self.start_wait)
        await self._catch_up(k)
        return False

    async def _catch_up(self, kernel: Kernel) -> None:
        """A kernel that came up across a restore (spawned, or pooled, before it) gets that
        restore's seed now, or before its first cell."""
        seed = await self.manager.catch_up(kernel)
        if seed is not None:
            self.pending_seed = seed

    async def restart(self) -> int:
        """Fresh state, same id: a new kernel process with the context's cwd and env."""
        old = self.kernel
        self.kernel = None
        if old is not None:
            await old.shutdown()
        self.restarts += 1
        self.execution_count = 0
        try:
            await self.start_kernel(None)
        except BaseException:
            if self.kernel is not None:
                await self.kernel.shutdown()
            raise
        assert self.kernel is not None
        return self.kernel.pid

    async def close(self) -> None:
        if self.kernel is not None:
            await self.kernel.shutdown()


# guestd's own cells (cwd/env set-up, re-seeding after a restore): quiet and bounded.
_SETUP_OPTS: CodeRunArgs = {
    "context": None,
    "code": "",
    "max_output": 4096,
    "capture": "tail",
    "strip_ansi": True,
    "stream": False,
    "keep": False,
    "timeout_s": 30.0,
    "interrupt_grace_s": 2.0,
    "input_lines": None,
}
