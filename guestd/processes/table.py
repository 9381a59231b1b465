"""Background processes that outlive the request (and the connection) that started them.

Each process's output is drained into bounded rings (:class:`OutputRing`) as it
arrives, whether or not anyone is attached, so a stalled reader never blocks the
process or other readers. Readers address output by absolute offsets and can
reattach after a dropped connection without gaps or duplicates.

With ``spill: true`` every byte also goes to a file per stream (guestd.output.spill), from byte 0,
so what a ring no longer holds (``[0, ring start)``) is still there at the same offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING, TypedDict

from guestd.children import DEVNULL, PIPE, STDOUT, Child, ExitInfo, exit_info
from guestd.children.options import build_env, check_cwd, command_argv
from guestd.children.tree import set_winsize, write_all
from guestd.output.capture import OutputRing
from guestd.output.pump import CHANNELS, OutputPump
from guestd.output.spill import abandon, open_spills
from guestd.wire.errors import ErrorCode, GuestdError, limit_error

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.children.cgroups import RunCgroup
    from guestd.output.spill import Spill
    from guestd.services import AdoptedRun, Services
    from guestd.wire.types import ProcessInfoRecord, ProcessStartArgs, SpillInfoRecord

__all__ = ["ExitInfo", "ManagedProcess", "ProcessTable"]


class SpillFields(TypedDict):
    """process_info and process.wait: where each ring starts, and the spill files (or nil)."""

    stdout_ring_start: int
    stderr_ring_start: int
    stdout_spill: SpillInfoRecord | None
    stderr_spill: SpillInfoRecord | None


SETTLE_S = 0.2  # after exit, how long leftover children may still write into the rings


class ManagedProcess:
    def __init__(self, table: ProcessTable, process_id: str, command: str, ring_bytes: int) -> None:
        self.table = table
        self.id = process_id
        self.command = command
        self.pid = 0
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.status: int | None = None
        self.rings = {"stdout": OutputRing(ring_bytes), "stderr": OutputRing(ring_bytes)}
        self.child: Child | AdoptedRun | None = None
        self.leaf: RunCgroup | None = None
        # The streams still being read: into the rings (and spill files), whoever is attached.
        self.output = OutputPump(on_output=self._notify, on_end=self._stream_ended)
        self._waiters: list[asyncio.Future[None]] = []
        self._write_lock = asyncio.Lock()  # FIFO: process.write calls go in one at a time, in order
        self._writes_queued = 0  # process.write calls received so far
        self._writes_failed_below = 0  # writes numbered below this one fail unsent (one before tore)
        self._torn_write_code: str = ErrorCode.IO_ERROR.value  # the code of the write that tore: the queue fails alike
        self._stdin_closed = False
        self.spills: dict[str, Spill] | None = None  # spill: true
        self._spill_closed: dict[str, asyncio.Task[SpillInfoRecord]] = {}  # a stream ended: its file complete

    @property
    def pty_fd(self) -> int | None:
        return self.child.pty if self.child is not None else None

    # -- start ------------------------------------------------------------------------
    async def start(self, args: ProcessStartArgs) -> None:
        argv = command_argv(args["argv"], args["shell"])
        check_cwd(args["cwd"])
        env = build_env(args["env"], args["env_mode"], self.table.services.config.policy.workload_ids())
        if args["spill"]:
            out, err = await open_spills(self.table.services, "proc")
            self.spills = {"stdout": out, "stderr": err}
        try:
            await self._spawn(args, argv, env)
        except BaseException:
            if self.spills is not None:
                abandon((self.spills["stdout"], self.spills["stderr"]))
            raise
        self._hold_spills()
        for name in ("stdout", "stderr"):
            if name not in self.output.sources:
                self._end_spill(name)  # merge_stderr or a pty: nothing comes on stderr

    async def _spawn(self, args: ProcessStartArgs, argv: list[str], env: dict[str, str] | None) -> None:
        children = self.table.services.children
        if args["pty"]:
            if env is None:
                env = dict(os.environ)
            env.setdefault("TERM", "xterm-256color")
            child = await children.spawn(argv, kind="proc", env=env, cwd=args["cwd"], pty=(args["rows"], args["cols"]))
            assert child.pty is not None
            fds = {"stdout": child.pty}
        else:
            child = await children.spawn(
                argv,
                kind="proc",
                env=env,
                cwd=args["cwd"],
                stdin=PIPE if args["stdin"] else DEVNULL,
                stderr=STDOUT if args["merge_stderr"] else PIPE,
            )
            assert child.stdout is not None
            fds = {"stdout": child.stdout}
            if child.stderr is not None:
                fds["stderr"] = child.stderr
            else:
                self.rings["stderr"].closed = True  # merge_stderr: all of it is in stdout
        self.child = child
        self.leaf = child.cgroup  # kept after exit: KILL still ends what the process left
        self.pid = child.pid
        self._read_streams(fds)
        child.watch(self._on_exit, 0.05)

    def adopt(
        self, run: AdoptedRun, fds: dict[str, int], rings: dict[str, OutputRing], spills: dict[str, Spill] | None
    ) -> None:
        """Take over a command that is already running (exec or shell.run ``on_timeout: "detach"``):
        its rings already hold its output from byte 0, and reading goes on from its fds (and
        into its spill files, which hold it from byte 0 too)."""
        self.child = run
        self.leaf = run.cgroup
        self.pid = run.pid
        self.rings = rings
        self.spills = spills
        self._hold_spills()
        self._read_streams(fds)
        for name in ("stdout", "stderr"):
            if name not in fds:
                rings[name].closed = True
                self._end_spill(name)
        if run.status is not None:
            asyncio.get_running_loop().call_soon(self._on_exit)  # it ended while being handed over
        else:
            run.watch(self._on_exit, 0.05)

    # -- output -----------------------------------------------------------------------
    def _read_streams(self, fds: dict[str, int]) -> None:
        """Read ``fds`` (by stream name) into the rings, and the spill files with spill."""
        for name, fd in fds.items():
            spill = self.spills[name] if self.spills is not None else None
            taps = (self.rings[name], spill) if spill is not None else (self.rings[name],)
            self.output.add(name, fd, CHANNELS[name], taps)

    def _close_stream(self, name: str) -> None:
        self.output.remove(name)
        self._stream_ended(name)

    def _stream_ended(self, name: str) -> None:
        self.rings[name].closed = True
        self._end_spill(name)
        if name == "stdout" and self.pty_fd is not None:
            self.rings["stderr"].closed = True
        self._release_if_done()
        self._notify()

    def _end_spill(self, name: str) -> None:
        """The stream ended: its spill file is complete once what was accepted is on disk."""
        if self.spills is not None and name not in self._spill_closed:
            self._spill_closed[name] = asyncio.get_running_loop().create_task(self.spills[name].close())

    async def spill_fields(self, settle_s: float) -> SpillFields:
        """Where each ring starts and, with spill, the files: exact (every byte of an ended stream
        on disk) when the streams end within ``settle_s``, else the bytes on disk so far."""
        infos: list[SpillInfoRecord | None] = [None, None]
        if self.spills is not None:
            loop = asyncio.get_running_loop()
            until = loop.time() + settle_s
            while len(self._spill_closed) < 2 and loop.time() < until:
                await self.changed(timeout=until - loop.time())
            for i, name in enumerate(("stdout", "stderr")):
                closing = self._spill_closed.get(name)
                infos[i] = await asyncio.shield(closing) if closing is not None else self.spills[name].info()
        return self._spill_fields(infos)

    def _spill_fields(self, infos: list[SpillInfoRecord | None]) -> SpillFields:
        return {
            "stdout_ring_start": self.rings["stdout"].start,
            "stderr_ring_start": self.rings["stderr"].start,
            "stdout_spill": infos[0],
            "stderr_spill": infos[1],
        }

    def _hold_spills(self) -> None:
        """This record names the spill files from now on: the directory sweep leaves them."""
        for spill in (self.spills or {}).values():
            spill.hold()

    def remove_spills(self) -> None:
        """process.forget: the files go with the process (after their pending writes)."""
        if self.spills is None:
            return
        spills, self.spills = self.spills, None

        async def remove() -> None:
            for name, spill in spills.items():
                try:
                    closing = self._spill_closed.get(name)
                    with contextlib.suppress(Exception):
                        await (asyncio.shield(closing) if closing is not None else spill.close())
                    with contextlib.suppress(OSError):
                        os.unlink(spill.path)
                finally:
                    spill.let_go()

        task = asyncio.get_running_loop().create_task(remove())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _release_if_done(self) -> None:
        """A finished process whose streams have ended holds no fd: its rings stay readable."""
        if self.child is not None and not self.running and not self.output.sources:
            self.child.release()

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def changed(self, timeout: float | None = None) -> None:
        """Wait until new output arrives or the state changes (or the timeout passes)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass

    # -- exit -------------------------------------------------------------------------
    def _on_exit(self) -> None:
        assert self.child is not None
        self.status = self.child.status
        self.ended_at = time.time()
        self.child.close_fd("stdin")
        # Leftover children may keep the pipes open; whatever they write still lands in the rings.
        asyncio.get_running_loop().call_later(SETTLE_S, self._finish_streams_if_idle)
        self._notify()

    def _finish_streams_if_idle(self) -> None:
        if self.pty_fd is not None and "stdout" in self.output.sources:
            # A pty master never reports EOF while other processes hold the slave; drain and stop.
            self.output.read_once("stdout")
            self._close_stream("stdout")
        self._release_if_done()
        self._notify()

    @property
    def running(self) -> bool:
        return self.status is None

    def exit_info(self) -> ExitInfo:
        return self.child.exit_info() if self.child is not None else exit_info(self.status)

    # -- control ----------------------------------------------------------------------
    def send_signal(self, sig: int) -> None:
        if self.running and self.child is not None:
            self.child.signal(sig)  # KILL ends the whole run: everything in its cgroup
            return
        if sig == signal.SIGKILL and self.leaf is not None:
            self.leaf.kill()  # what the process left running when it exited
            return
        raise GuestdError(ErrorCode.BAD_REQUEST, f"process {self.id} has exited", details={"process": self.id})

    async def write_stdin(self, data: bytes) -> int:
        """Write all of ``data``, after the writes that arrived before it (one at a time, in
        arrival order: a paste sent as concurrent chunks arrives whole and in order).

        The deadline counts from arrival, the wait behind earlier writes included. A write that
        fails or times out says how much of it went in (``details.written``); the writes queued
        behind it fail as well (``details.stage: queue``), so nothing follows a torn write."""
        loop = asyncio.get_running_loop()
        limit_s = self.table.services.config.process_stdin_timeout_s
        deadline = loop.time() + limit_s
        seq = self._writes_queued
        self._writes_queued += 1
        try:
            async with asyncio.timeout_at(deadline):
                await self._write_lock.acquire()
        except TimeoutError:
            raise GuestdError(
                ErrorCode.TIMEOUT,
                f"process {self.id} did not read its stdin within {limit_s:g} s (earlier writes pending)",
                details={"process": self.id, "written": 0, "stage": "queue"},
            ) from None
        try:
            if seq < self._writes_failed_below:
                # The same code as the write that tore, so the answer does not depend on whether
                # this one's own deadline or the lock came first.
                raise GuestdError(
                    self._torn_write_code,
                    f"an earlier write to process {self.id} failed ({self._torn_write_code}); this one was not sent",
                    details={"process": self.id, "written": 0, "stage": "queue"},
                )
            fd = self._stdin_fd()
            sent = [0]
            try:
                async with asyncio.timeout_at(deadline):
                    await write_all(loop, fd, data, sent)
            except BaseException as exc:
                self._writes_failed_below = self._writes_queued  # what waits behind a torn write
                error = self._write_error(exc, sent[0], limit_s)
                if isinstance(error, GuestdError):
                    self._torn_write_code = error.code
                raise error from None
            return len(data)
        finally:
            self._write_lock.release()

    def _stdin_fd(self) -> int:
        if not self.running:
            raise GuestdError(
                ErrorCode.BAD_REQUEST, f"process {self.id} has exited", details={"process": self.id, "written": 0}
            )
        fd = self.pty_fd if self.pty_fd is not None else (self.child.stdin if self.child is not None else None)
        if fd is None:
            why = (
                "closed its stdin (process.close_stdin)"
                if self._stdin_closed
                else "has no stdin (start it with stdin or pty)"
            )
            raise GuestdError(
                ErrorCode.BAD_REQUEST, f"process {self.id} {why}", details={"process": self.id, "written": 0}
            )
        return fd

    def _write_error(self, exc: BaseException, written: int, limit_s: float) -> BaseException:
        details = {"process": self.id, "written": written}
        # TimeoutError is an OSError in Python 3.11: test it first.
        if isinstance(exc, TimeoutError):
            return GuestdError(
                ErrorCode.TIMEOUT,
                f"process {self.id} did not read its stdin within {limit_s:g} s ({written} bytes went in)",
                details=details,
            )
        if isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and not self.running):
            state = "has exited" if not self.running else "closed its stdin"
            return GuestdError(ErrorCode.BAD_REQUEST, f"process {self.id} {state}", details=details)
        if isinstance(exc, OSError):
            return GuestdError.from_os_error(exc, **details)
        return exc  # cancelled: the request is gone

    def close_stdin(self) -> None:
        self._stdin_closed = True
        if self.pty_fd is not None:
            # A terminal has no half-close: send EOF the way a user would (^D at line start).
            os.write(self.pty_fd, b"\x04")
            return
        if self.child is not None:
            self.child.close_fd("stdin")

    def resize(self, rows: int, cols: int) -> None:
        if self.pty_fd is None:
            raise GuestdError(ErrorCode.BAD_REQUEST, f"process {self.id} has no pty", details={"process": self.id})
        set_winsize(self.pty_fd, rows, cols)  # the tty layer sends SIGWINCH to the foreground group

    def describe(self) -> ProcessInfoRecord:
        out: ProcessInfoRecord = {
            "id": self.id,
            "pid": self.pid,
            "command": self.command,
            "state": "running" if self.running else "exited",
            "pty": self.pty_fd is not None,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "stdout_offset": self.rings["stdout"].total,
            "stderr_offset": self.rings["stderr"].total,
            "cpu_s": None,
            "rss": None,
            **self.exit_info(),
            **self._spill_fields([s.info() for s in self.spills.values()] if self.spills else [None, None]),
        }
        if self.running:
            try:
                import psutil

                p = psutil.Process(self.pid)
                with p.oneshot():
                    t = p.cpu_times()
                    out["cpu_s"] = t.user + t.system
                    out["rss"] = p.memory_info().rss
            except Exception:
                pass
        return out

    def release(self) -> None:
        """Drop every fd (after the process is gone or forgotten)."""
        for name in list(self.output.sources):
            self._close_stream(name)
        if self.child is not None:
            self.child.release()
        self._notify()


class ProcessTable:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.procs: dict[str, ManagedProcess] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def get(self, process_id: str) -> ManagedProcess:
        p = self.procs.get(process_id)
        if p is None:
            raise GuestdError(ErrorCode.NOT_FOUND, f"no process {process_id!r}", details={"process": process_id})
        return p

    async def start(self, args: ProcessStartArgs) -> ManagedProcess:
        self.check()
        command = args["shell"] if args["shell"] is not None else " ".join(args["argv"] or [])
        mp = ManagedProcess(self, "p" + os.urandom(6).hex(), command, args["ring_bytes"])
        self.procs[mp.id] = mp  # reserved now: concurrent starts count against the limits
        try:
            await mp.start(args)
        except BaseException:
            del self.procs[mp.id]
            raise
        self._keep_sweeping()
        return mp

    def check(self) -> None:
        """Raise the typed ``limit`` error when no more live processes may be started or adopted
        (services.Adopter); a finished one is evicted first to make room among the kept."""
        self._expire()
        limits = self.services.config.limits
        if sum(1 for p in self.procs.values() if p.running) >= limits.max_processes:
            raise limit_error("max_processes", limits.max_processes, f"at most {limits.max_processes} live processes")
        if len(self.procs) >= limits.max_kept_processes:
            self._evict_oldest_finished()
            if len(self.procs) >= limits.max_kept_processes:
                raise limit_error(
                    "max_kept_processes", limits.max_kept_processes, "too many kept processes; forget some"
                )

    def adopt(
        self,
        command: str,
        run: AdoptedRun,
        fds: dict[str, int],
        rings: dict[str, OutputRing],
        spills: dict[str, Spill] | None = None,
    ) -> str:
        """A timed-out exec or shell command becomes a background process (on_timeout "detach")."""
        mp = ManagedProcess(self, "p" + os.urandom(6).hex(), command, 1)
        mp.adopt(run, fds, rings, spills)
        self.procs[mp.id] = mp
        self._keep_sweeping()
        return mp.id

    def _keep_sweeping(self) -> None:
        """The sweeper of expired processes running while the table holds any."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    def forget(self, process_id: str) -> None:
        p = self.get(process_id)
        if p.running:
            raise GuestdError(
                ErrorCode.BAD_REQUEST,
                f"process {process_id} is still running; signal it first",
                details={"process": process_id},
            )
        del self.procs[process_id]
        p.release()
        p.remove_spills()

    def _evict_oldest_finished(self) -> None:
        done = sorted((p for p in self.procs.values() if not p.running), key=lambda p: p.ended_at or 0)
        if done:
            self.forget(done[0].id)

    def _expire(self) -> None:
        keep = self.services.config.process_retention_s
        now = time.time()
        for p in list(self.procs.values()):
            if not p.running and p.ended_at is not None and now - p.ended_at > keep:
                self.forget(p.id)

    async def _sweep(self) -> None:
        while self.procs:
            await asyncio.sleep(min(60.0, max(1.0, self.services.config.process_retention_s / 4)))
            self._expire()

    async def shutdown(self) -> None:
        """guestd is stopping: every run ends through guestd.children; drop the fds here."""
        for p in self.procs.values():
            p.release()
