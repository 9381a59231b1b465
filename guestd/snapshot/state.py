"""Snapshot safety: quiesce before a snapshot, re-seed and re-identify after every restore.

A restored clone wakes up with its parent's memory: the same kernel CRNG state, the
same user-space PRNG states, a stale wall clock and the same ids. Nothing in the guest
learns about the restore unless the host says so, with `restore`. guestd then, before
it answers any other request:

1. re-seeds the kernel CRNG: RNDADDENTROPY with the host's bytes *and* RNDRESEEDCRNG
   (adding entropy alone does not make the CRNG reseed at once);
2. sets the wall clock when it is off by more than a threshold (guestd's own deadlines
   use the monotonic clock, so running timeouts stay right);
3. re-seeds its own PRNG and regenerates its instance id;
4. applies the new identity (hostname, /etc/machine-id, environment, access token);
5. drops every connection from before the snapshot;
then re-seeds every code context (Python's `random`, and numpy's global state when
numpy is loaded) and every shell session (`$RANDOM`), side by side with writing the
generation file and signalling the workload. A kernel takes its seed through a side
channel that does not wait for its message loop (guestd.code.reseed), so a context
running a cell is re-seeded at once too, unless the cell holds the interpreter in a C
call: then before its next cell. A shell session is re-seeded at once when idle, or
before its next run when busy.

Privileged steps (ioctls on /dev/random, clock_settime, sethostname, /etc/machine-id,
random-seed files, FIFREEZE) go through guestd.snapshot.privileged, which records them instead
when guestd does not run in a guest; guestd.snapshot.inputs checks a request's inputs first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any, cast

from guestd.services import derive
from guestd.snapshot.clock import ClockWatch
from guestd.snapshot.privileged import Privileged, why_simulated
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.services import Services
    from guestd.snapshot.inputs import Identity
    from guestd.wire.types import ClockCheckReply, SnapshotPrepareReply, SnapshotRestoreArgs, SnapshotRestoreReply

log = logging.getLogger("guestd.snapshot")

FREEZE_SETTLE_POLLS = 500  # x 10 ms: how long prepare waits for cgroup.events "frozen 1"
CLOCK_THRESHOLD_S = 0.2  # the host's clock arrives a request latency late; below this, leave the clock alone


# Ops that never wait behind a quiesce (health checks and the snapshot ops themselves).
UNGATED_WHEN_QUIESCED = frozenset(
    {"ping", "info", "clock.check", "snapshot.prepare", "snapshot.resume", "snapshot.restore"}
)


def load_restore_imports() -> None:
    """What prepare and restore need beyond the gate and the clock: their input checks, the
    generation file (and json, ~1.8 ms), the signals and the clone hazards. Imported at
    snapshot.prepare, so a guest restored from the snapshot finds them in memory and its restore
    imports nothing; not at start, where the snapshot state is made (~0.7 ms of guestd's start).
    A restore with no prepare before it imports them itself."""
    import hashlib  # noqa: F401  (services.derive: the new instance id, seeds, machine-id)
    import json  # noqa: F401  (the generation file's)
    import random  # noqa: F401  (re-seeded by the restore)

    from guestd.snapshot import hazards, inputs, notify  # noqa: F401


class SnapshotState:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.priv = Privileged(why_simulated(services.config))
        if self.priv.why is not None:
            log.info("privileged snapshot steps will be simulated: %s", self.priv.why)
        self.generation = 0
        self.nonces: dict[str, SnapshotRestoreReply] = {}  # nonce -> the report it produced (replays return it)
        self.ready = asyncio.Event()  # cleared while quiesced or restoring: new work waits
        self.ready.set()
        self.quiesced = False
        self.instance_id = os.urandom(16).hex()
        self.sandbox_id: str | None = None
        self.suspected_restore = False
        self.restored_at: float | None = None
        self.lock = asyncio.Lock()
        self._inflight: dict[str, asyncio.Future[SnapshotRestoreReply]] = {}  # nonce -> its running restore
        self._frozen_workload = False  # prepare froze the workload cgroup
        self._fs_frozen: tuple[str, int] | None = None  # (mount point, its fd) frozen by prepare
        self._thaw_timer: asyncio.TimerHandle | None = None
        self.clock = ClockWatch()

    def gate(self, op: str) -> asyncio.Event | None:
        """The event a new request must wait for, or None. During a restore everything but the
        restore itself waits ("before it answers any other request of the new generation");
        while quiesced, new work waits but health checks and snapshot ops do not."""
        if self.ready.is_set():
            return None
        if self.lock.locked():
            return None if op == "snapshot.restore" else self.ready
        return None if op in UNGATED_WHEN_QUIESCED else self.ready

    # -- prepare ------------------------------------------------------------------------
    async def prepare(
        self,
        quiesce: bool,
        timeout_s: float,
        freeze: bool = False,
        fsfreeze: str | None = None,
        freeze_max_s: float = 300.0,
    ) -> SnapshotPrepareReply:
        t0 = time.monotonic()
        load_restore_imports()  # in the snapshot's image, so a restore imports nothing
        if freeze and self.services.workload.path is None:
            raise GuestdError(
                ErrorCode.UNAVAILABLE,
                "no workload cgroup to freeze (see info.workload_cgroup)",
                details={"stage": "freeze", "field": "freeze"},
            )
        if fsfreeze is not None:
            from guestd.snapshot.inputs import check_fsfreeze_target

            check_fsfreeze_target(fsfreeze)
        if quiesce or freeze or fsfreeze is not None:
            self.quiesced = True
            self.ready.clear()  # new work waits for restore (or resume); in-flight work finishes
        loop = asyncio.get_running_loop()

        def limit_the_freeze() -> None:
            """What is frozen thaws by itself after freeze_max_s unless a resume or restore comes."""
            if self._frozen_workload or self._fs_frozen is not None:
                if self._thaw_timer is not None:
                    self._thaw_timer.cancel()
                self._thaw_timer = loop.call_later(freeze_max_s, self._thaw_expired)

        # Armed in a finally: a prepare cancelled after its freeze (its host gone, at the sync
        # or the fsfreeze) must not leave the workload frozen and guestd quiesced for good.
        try:
            try:
                await asyncio.wait_for(self.services.writes.idle.wait(), timeout_s)
                writes_done = True
            except TimeoutError:
                writes_done = False
            frozen = await self._freeze_workload() if freeze else self.services.workload.is_frozen()
            await self.services.run_in_io(os.sync)  # after the freeze: what the workload wrote is on disk
            removed = self.priv.remove_seed_files()
            if fsfreeze is not None and self._fs_frozen is None:
                fs_freeze = asyncio.ensure_future(self.services.run_in_io(self._freeze_fs, fsfreeze))
                try:
                    await asyncio.shield(fs_freeze)
                except asyncio.CancelledError:

                    def when_frozen(done: asyncio.Future[None]) -> None:  # the thread freezes it still
                        if not done.cancelled():
                            done.exception()  # read: a failure nobody waits for is not logged as lost
                        limit_the_freeze()

                    fs_freeze.add_done_callback(when_frozen)
                    raise
        finally:
            limit_the_freeze()
        # /proc/net/tcp{,6} is as long as the workload makes it (about 10 us a socket): off the loop.
        from guestd.snapshot.hazards import clone_hazards

        hazards = await self.services.run_in_io(clone_hazards)
        return {
            "writes_settled": writes_done,
            "synced": True,
            "seed_files_removed": removed,
            "quiesced": self.quiesced,
            "running": self.running_work(),
            "frozen": frozen,
            "fs_frozen": self._fs_frozen[0] if self._fs_frozen is not None else None,
            "hazards": hazards,
            "duration_s": time.monotonic() - t0,
            "simulated": self.priv.why,
        }

    async def _freeze_workload(self) -> bool:
        """cgroup.freeze, then wait (bounded) until the kernel says every process is frozen."""
        workload = self.services.workload
        workload.set_frozen(True)
        self._frozen_workload = True
        for _ in range(FREEZE_SETTLE_POLLS):  # a task in uninterruptible sleep freezes when it wakes
            if workload.is_frozen():
                return True
            await asyncio.sleep(0.01)
        return workload.is_frozen()

    def _freeze_fs(self, path: str) -> None:
        """FIFREEZE (in an I/O thread: it syncs the file system first)."""
        self._fs_frozen = (path, self.priv.freeze_fs(path))

    def thaw(self) -> bool:
        """Lift a freeze of prepare: the file system first, then the workload. True if one was on."""
        was = self._frozen_workload or self._fs_frozen is not None
        if self._thaw_timer is not None:
            self._thaw_timer.cancel()
            self._thaw_timer = None
        if self._fs_frozen is not None:
            path, fd = self._fs_frozen
            self._fs_frozen = None
            self.priv.thaw_fs(path, fd)
        if self._frozen_workload:
            self._frozen_workload = False
            try:
                self.services.workload.set_frozen(False)
            except OSError as exc:
                log.warning("cannot thaw the workload: %s", exc)
        return was

    def _thaw_expired(self) -> None:
        self._thaw_timer = None
        if self.thaw():
            log.warning("no resume or restore within freeze_max_s of a freezing prepare: thawed")
            self.resume_work()

    async def resume(self) -> None:
        """snapshot.resume: thaw, and take new work again."""
        self.thaw()
        self.resume_work()

    def resume_work(self) -> None:
        self.quiesced = False
        self.ready.set()

    def running_work(self) -> dict[str, Any]:
        work: dict[str, Any] = {}
        for report in self.services.busy:
            work.update(report())
        return work

    # -- restore ------------------------------------------------------------------------
    async def restore(self, args: SnapshotRestoreArgs, origin: Any) -> SnapshotRestoreReply:
        nonce = args["nonce"]
        if nonce in self.nonces:
            return {**self.nonces[nonce], "replayed": True}
        running = self._inflight.get(nonce)
        if running is not None:  # a retry while the first call still runs: its report, once it has one
            return {**await asyncio.shield(running), "replayed": True}
        load_restore_imports()  # imported at prepare already, unless no prepare came before
        from guestd.snapshot.inputs import checked_identity

        identity = checked_identity(args)  # every input, before anything changes
        gen = args["generation"]
        self._check_generation(gen)
        first: asyncio.Future[SnapshotRestoreReply] = asyncio.get_running_loop().create_future()
        self._inflight[nonce] = first
        try:
            async with self.lock:
                self._check_generation(gen)  # another restore may have run while this one waited
                self.ready.clear()  # the barrier: other requests wait until the guest is fresh
                t0 = time.monotonic()
                try:
                    report = await self._restore_locked(args, identity, origin, gen)
                finally:
                    self.thaw()  # a failed restore leaves nothing frozen either
                    self.quiesced = False
                    self.ready.set()
                report["duration_s"] = time.monotonic() - t0
                self.nonces[nonce] = report
                if len(self.nonces) > 64:
                    self.nonces.pop(next(iter(self.nonces)))
        except BaseException as exc:
            # A retry waiting for this call fails the same way (a cancelled first call: unavailable).
            first.set_exception(
                exc
                if isinstance(exc, Exception)
                else GuestdError(ErrorCode.UNAVAILABLE, f"the restore with nonce {nonce!r} was cancelled")
            )
            first.exception()  # retrieved: there may be no retry
            raise
        else:
            first.set_result(report)
            return report
        finally:
            del self._inflight[nonce]

    def _check_generation(self, gen: int) -> None:
        if gen <= self.generation:
            raise GuestdError(
                ErrorCode.STALE,
                f"generation {gen} is not newer than the current {self.generation}",
                details={"generation": self.generation},
            )

    async def _restore_locked(
        self, args: SnapshotRestoreArgs, ident: Identity, origin: Any, gen: int
    ) -> SnapshotRestoreReply:
        """The steps that can fail (privileged ones) come first; guestd's own state changes after
        them, all together, so a failure never leaves a new instance id with an old generation."""
        from guestd.snapshot.notify import signal_registered, write_generation_file  # in memory: load_restore_imports

        entropy: bytes = args["entropy"]
        self.priv.recorded = []
        done: dict[str, Any] = {"generation": gen, "replayed": False}
        t = time.monotonic()
        done["crng"] = self.priv.reseed_crng(entropy)
        done["crng_ms"] = (time.monotonic() - t) * 1000
        skew = time.time_ns() - args["time_ns"]
        done["clock_skew_s"] = skew / 1e9
        seen = self.clock.observe(args["time_ns"], "restore")
        done["clock"] = self._step_clock(args["time_ns"], seen) if abs(skew) > CLOCK_THRESHOLD_S * 1e9 else "kept"
        applied = []
        if ident.sandbox_id is not None:
            applied.append("sandbox_id")
            done["machine_id"] = self.priv.set_machine_id(derive(ident.sandbox_id.encode(), "machine-id", 16).hex())
        if ident.hostname is not None:
            done["hostname"] = self.priv.set_hostname(ident.hostname)
            applied.append("hostname")
        # From here on nothing fails: guestd's own state, in one step.
        import random

        random.seed(derive(entropy, "guestd"))
        self.instance_id = derive(entropy, "instance", 16).hex()
        if ident.sandbox_id is not None:
            self.sandbox_id = ident.sandbox_id
        if ident.env is not None:
            os.environ.update(ident.env)
            applied.append("env")
        if ident.token is not None:
            self.services.host.token = ident.token
            applied.append("token")
        done["identity"] = applied
        done["connections_dropped"] = self.services.host.drop_connections(keep=origin)
        self.generation = gen
        self.restored_at = time.time()
        self.suspected_restore = False
        # Kernels and shells are re-seeded from here on, side by side with the steps below: a
        # kernel takes its seed through a side channel (guestd.code.reseed), so none waits for
        # guestd's file and signals, nor for another. A frozen workload applies its seeds once
        # thawed below; the restore answers only once they are applied (or pending).
        t = time.monotonic()
        reseeding = asyncio.ensure_future(self._reseed_workloads(entropy))
        try:
            # The workload runs again only now: after the CRNG re-seed and the new identity, and
            # with the generation file already saying so.
            done["generation_file"] = await self.services.run_in_io(
                write_generation_file,
                self.services.runtime_dir(),
                {
                    "generation": gen,
                    "instance_id": self.instance_id,
                    "sandbox_id": self.sandbox_id,
                    "hostname": ident.hostname,
                    "restored_at": self.restored_at,
                },
            )
            done["thawed"] = self.thaw()
            ids = self.services.config.policy.workload_ids()
            done["signalled"] = await self.services.run_in_io(
                signal_registered, self.services.workload.path, ids[0] if ids is not None else None
            )
        finally:
            reseeded = await reseeding  # also when a step failed: nothing is left running behind it
        done.update(reseeded)
        done["workloads_ms"] = (time.monotonic() - t) * 1000  # overlaps the steps above
        done["actions"] = list(self.priv.recorded)
        done["simulated"] = self.priv.why
        done["instance_id"] = self.instance_id
        # Assembled step by step as the restore proceeds; the schema's result fields name every key.
        return cast("SnapshotRestoreReply", done)

    async def _reseed_workloads(self, entropy: bytes) -> dict[str, Any]:
        report: dict[str, Any] = {
            "contexts_reseeded": [],
            "contexts_pending": [],
            "shells_reseeded": [],
            "shells_pending": [],
            "reseed_errors": [],
        }
        results = await asyncio.gather(*(hook(entropy) for hook in self.services.on_restore), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                report["reseed_errors"].append(repr(r))
                continue
            for key, values in r.items():
                report[key] = report.get(key, []) + list(values)
        return report

    def check_host_time(self, host_time_ns: int | None) -> None:
        """Fallback when the host forgot `restore`: a handshake's clock far from ours means we were paused."""
        if host_time_ns is None:
            return
        report = self.clock.observe(host_time_ns, "hello")
        if abs(report["offset_s"]) > 1.0:
            self.suspected_restore = True
            try:
                self._step_clock(host_time_ns, report)
            except (OSError, ValueError, OverflowError):
                pass  # a clock we cannot set (or a value no clock holds) leaves ours as it is

    def check_clock(self, host_time_ns: int) -> ClockCheckReply:
        """clock.check: compare with the host's clock, report jumps and drift, and set ours when
        it is more than CLOCK_THRESHOLD_S off (saying so when that steps it back under runs)."""
        report = self.clock.observe(host_time_ns, "check")
        how = "kept"
        if abs(report["offset_s"]) > CLOCK_THRESHOLD_S:
            try:
                how = self._step_clock(host_time_ns, report)
            except (ValueError, OverflowError):
                from guestd.snapshot.inputs import restore_input_error

                raise restore_input_error("time_ns", "is outside what the clock can be set to") from None
            except OSError as exc:
                raise GuestdError.from_os_error(exc, stage="clock") from None
        return {
            "offset_s": report["offset_s"],
            "since_last_s": report["since_last_s"],
            "host_jump_s": report["host_jump_s"],
            "guest_jump_s": report["guest_jump_s"],
            "drift_ppm": report["drift_ppm"],
            "clock": how,
            "stepped_s": report.get("stepped_s"),
            "runs_in_flight": report.get("runs_in_flight", len(self.services.children.live)),
            "backwards_under_runs": bool(report.get("backwards_under_runs")),
            "simulated": self.priv.why,
        }

    def _step_clock(self, host_time_ns: int, report: dict[str, Any]) -> str:
        """Set the wall clock to the host's; a step back while runs are in flight (their timers
        on CLOCK_REALTIME fire late by as much) is logged, counted and reported."""
        by_ns = host_time_ns - time.time_ns()
        runs = len(self.services.children.live)
        how = self.priv.set_clock(host_time_ns)
        report.update(stepped_s=by_ns / 1e9, runs_in_flight=runs, clock=how)
        if how == "done":
            self.clock.stepped(by_ns)
        if by_ns < 0 and runs:
            report["backwards_under_runs"] = True
            self.clock.backwards_under_runs += 1
            log.warning("wall clock stepped back %.3f s to the host's, under %d run(s) in flight", -by_ns / 1e9, runs)
        return how

    def describe(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "instance_id": self.instance_id,
            "sandbox_id": self.sandbox_id,
            "quiesced": self.quiesced,
            "frozen": self._frozen_workload,
            "fs_frozen": self._fs_frozen[0] if self._fs_frozen is not None else None,
            "suspected_restore": self.suspected_restore,
            "restored_at": self.restored_at,
            "simulate_privileged": self.priv.simulate,
            "simulated": self.priv.why,
            "clock": self.clock.describe(),
        }
