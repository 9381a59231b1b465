"""``Children``: spawns runs and owns them until their leaf cgroup is gone.

The native clone3 path or the subprocess fallback in a thread pool; the watchdog of spawns
stopped before exec; the orphan reaper and the sweep of emptied leaves; every run ended at
shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from guestd.children.cgroups import RunCgroup, WorkloadCgroup
from guestd.children.launch import (
    ALL_CPUS,
    NICE_RESET,
    NO_CLONE3,
    NOFILE_AT_START,
    OOM_RESET,
    Clone3Unavailable,
    clone_module,
    exec_paths,
    load_native,
    popen_fallback,
    spawn_error,
)
from guestd.children.reaper import Reaper
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.record import Record

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    # The handle and the tree's helpers load with the first spawn, not on guestd's start path
    # (~0.9 ms with the exit records), where Children is made; spawn() loads them first.
    from guestd.children.child import Child

log = logging.getLogger("guestd.children")

PIPE = -1  # a new pipe; guestd keeps the other end
STDOUT = -2  # stderr only: the same pipe as stdout
DEVNULL = -3
# A child stopped (SIGSTOP from the workload) between dropping to the workload user and exec
# would hold its spawn thread forever (CLONE_VFORK). While spawns are in flight a watchdog
# looks every WATCH_S: a child found stopped is killed, and any child not exec'd after
# STUCK_SPAWN_S (a spawn takes milliseconds, even under TCG).
WATCH_S = 0.05
STUCK_SPAWN_S = 10.0
IDS_TTL_S = 1.0  # how long a lookup of the workload user's ids is reused


class SpawnOrder(Record):
    """One spawn, as the spawn thread gets it (see Children.spawn for the meaning of each)."""

    __slots__ = ("argv", "cwd", "env", "extra_fds", "kind", "pty", "run_id", "stderr", "stdin", "stdout", "user")

    def __init__(
        self,
        argv: list[str],
        kind: str,
        run_id: str,
        env: dict[str, str] | None,
        cwd: str | None,
        stdin: int,
        stdout: int,
        stderr: int,
        pty: tuple[int, int] | None,
        extra_fds: dict[int, int] | None,
        user: tuple[int, int] | None = None,
    ) -> None:
        self.argv: Final = argv
        self.kind: Final = kind
        self.run_id: Final = run_id
        self.env: Final = env
        self.cwd: Final = cwd
        self.stdin: Final = stdin
        self.stdout: Final = stdout
        self.stderr: Final = stderr
        self.pty: Final = pty
        self.extra_fds: Final = extra_fds
        self.user: Final = user


# pid, pidfd, leaf cgroup, guestd's ends of the pipes, and the Popen of the fallback spawn
Spawned = tuple[int, "int | None", "RunCgroup | None", dict[str, int], "subprocess.Popen[bytes] | None"]


class Children:
    """Spawns runs and owns them until their leaf is empty and removed."""

    def __init__(self, workload: WorkloadCgroup, workload_ids: Callable[[], tuple[int, int] | None]) -> None:
        self.workload = workload
        self.workload_ids = workload_ids
        self._ids: tuple[float, tuple[int, int] | None] | None = None  # (when looked up, ids)
        self._env_encoded: tuple[dict[str, str], list[bytes]] | None = None
        self.reaper = Reaper()
        self.native = load_native()
        self.live: set[Child] = set()
        self.lingering: set[RunCgroup] = set()  # finished runs whose leaf still has processes
        self._pool: ThreadPoolExecutor | None = None
        self._done_fd: int | None = None  # the native spawn threads' eventfd, watched by the loop
        self._null_fd: int | None = None
        self._counter = 0
        # With the counter, a run's id: unique among this guestd's runs and (random per guestd)
        # apart from those of an earlier guestd that had the same pid (its leaves may remain).
        self._run_tag = os.urandom(4).hex()
        # Spawns in flight: their pids are not tracked yet, so the orphan sweep must wait
        # (it would reap them as orphans and their owners would see status 255).
        self._spawning = 0
        self._sweep_soon = False  # a reaper sweep is scheduled (reaped)
        self._watchdog: asyncio.Task[None] | None = None
        self.closing = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def ids(self) -> tuple[int, int] | None:
        """The workload user's (uid, gid), looked up at most once every IDS_TTL_S (a password
        database lookup is 12 us here, and every spawn needed it twice)."""
        now = time.monotonic()
        cached = self._ids
        if cached is None or now - cached[0] > IDS_TTL_S:
            cached = self._ids = (now, self.workload_ids())  # an error (no such user) is not kept
        return cached[1]

    def _encode_env(self, env: dict[str, str]) -> list[bytes]:
        """``env`` as NAME=value bytes; the last one is kept (most runs share one environment,
        and encoding it took 17 us per spawn)."""
        last = self._env_encoded
        if last is not None and last[0] == env:
            return last[1]
        encoded = [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()]
        self._env_encoded = (dict(env), encoded)
        return encoded

    @property
    def spawn_method(self) -> str:
        return "clone3" if self.native is not None else "popen"

    def _devnull(self) -> int:
        if self._null_fd is None:
            self._null_fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        return self._null_fd

    async def spawn(
        self,
        argv: list[str],
        *,
        kind: str,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: int = DEVNULL,
        stdout: int = PIPE,
        stderr: int = PIPE,
        pty: tuple[int, int] | None = None,
        extra_fds: dict[int, int] | None = None,
        user: tuple[int, int] | None = None,
    ) -> Child:
        """Start ``argv`` as a new run of ``kind``. Raises GuestdError (details.stage: cwd or spawn).

        ``stdin``/``stdout``/``stderr``: PIPE, DEVNULL, STDOUT (stderr) or an fd to give the
        child (the caller keeps it). ``pty=(rows, cols)``: all three on a new terminal that
        becomes the child's controlling tty; guestd's end is ``Child.pty``. ``extra_fds``:
        {target fd in the child: fd here}. ``user``: (uid, gid) to run as instead of the
        workload user (guestd as root only; grep's rg when there is no workload user).
        """
        if self.closing:
            raise GuestdError(ErrorCode.UNAVAILABLE, "guestd is stopping", details={"stage": "spawn"})
        # The run handle (and the tree's helpers it imports) loads at the first spawn, not on
        # guestd's start path; here, before any process exists: an import failing once one had
        # started would leave it, its fds and its leaf untracked. Later, a sys.modules hit.
        import guestd.children.child  # noqa: F401

        self._counter += 1
        run_id = f"{self._counter}-{self._run_tag}"
        order = SpawnOrder(argv, kind, run_id, env, cwd, stdin, stdout, stderr, pty, extra_fds, user)
        if self.native is not None:
            try:
                return await self._spawn_native(order)
            except Clone3Unavailable:
                pass  # this kernel has no clone3 (into a cgroup): the subprocess path from now on
        return await self._spawn_pooled(order)

    async def _spawn_pooled(self, order: SpawnOrder) -> Child:
        """The subprocess fallback: a spawn in a thread pool (Python runs in the forked child)."""
        from guestd.children.child import Child  # loaded by spawn(), before the process

        if self._pool is None:
            # A spawn blocks its thread until the child has exec'd, never the loop.
            # They live as long as guestd: a kernel's PR_SET_PDEATHSIG follows the thread that
            # created it, so a worker that exited would take its kernels with it.
            from concurrent.futures import ThreadPoolExecutor  # on first spawn: idle memory

            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="guestd-spawn")
        kind = order.kind
        loop = self._loop = asyncio.get_running_loop()
        self._spawning += 1
        fut = loop.run_in_executor(self._pool, self._spawn_blocking, order)
        try:
            pid, pidfd, cgroup, fds, popen = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # The thread cannot be stopped: whatever it starts is ended at once, and the orphan
            # sweep reaps it.
            def cleanup(done: asyncio.Future[Any]) -> None:
                self._spawned()
                if not done.cancelled() and done.exception() is None:
                    child = Child(self, kind, *done.result())
                    child.kill_now()
                    child.release()

            fut.add_done_callback(cleanup)
            raise
        except BaseException:
            self._spawned()
            # The future holds the exception, whose traceback holds this frame: let go of it,
            # so a failed spawn is freed as it is reported, not by the garbage collector.
            del fut
            raise
        child = Child(self, kind, pid, pidfd, cgroup, fds, popen)
        self.live.add(child)
        self.reaper.tracked.add(pid)
        self._spawned()
        return child

    async def _spawn_native(self, o: SpawnOrder) -> Child:
        """Pipes here, the leaf and clone3 in a spawn thread of the native module (no GIL: the
        loop is not kept waiting, and no Python thread has to be handed the spawn); the loop
        learns it is done through the module's eventfd (``_collect``)."""
        native = self.native
        assert native is not None
        loop = self._loop = asyncio.get_running_loop()
        if self._done_fd is None:
            self._done_fd = native.spawner()
            loop.add_reader(self._done_fd, self._collect)
        try:
            ours, theirs, child_fds = self._child_fds(o)
        except OSError as exc:  # pipes or a pty: out of fds, most likely
            raise GuestdError.from_os_error(exc, stage="spawn", argv0=o.argv[0]) from None
        leaf = self.workload.leaf_order(o.kind, o.run_id)
        ids = o.user if o.user is not None and os.geteuid() == 0 else self.ids()
        pending = _NativeSpawn(self, o, loop.create_future(), ours, theirs, leaf[1] if leaf else None)
        try:
            native.submit(
                pending,
                leaf[0] if leaf else None,
                exec_paths(o.argv[0], (os.environ if o.env is None else o.env).get("PATH")),
                [os.fsencode(a) for a in o.argv],
                None if o.env is None else self._encode_env(o.env),
                None if o.cwd is None else os.fsencode(o.cwd),
                child_fds,
                ids[0] if ids else -1,
                ids[1] if ids else -1,
                True,
                o.pty is not None,
                -1,
                OOM_RESET,
                NOFILE_AT_START,
                ALL_CPUS,
                NICE_RESET,
            )
        except (ValueError, TypeError) as exc:  # NUL bytes in argv, env or cwd
            pending.close_fds(ours=True)
            raise GuestdError(ErrorCode.BAD_REQUEST, f"cannot spawn: {exc}", details={"stage": "spawn"}) from None
        self._spawning += 1
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = loop.create_task(self._watch_spawns())
        fut = pending.fut
        try:
            return await fut
        except asyncio.CancelledError:
            # Started, but the request went away before it saw the child: ended at once (a spawn
            # still in its thread is ended by _collect, which finds the future cancelled).
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                child = fut.result()
                child.kill_now()
                child.release()
            raise
        finally:
            del fut, pending  # an exception's traceback holds this frame: no cycle per failed spawn

    def _collect(self) -> None:
        """The spawn threads' eventfd is readable: hand each finished spawn to its waiter."""
        assert self.native is not None or self._done_fd is not None
        for pending, outcome in _collect_native():
            try:
                pending.finish(outcome)
            except Exception:  # a bug of guestd's: this request fails, typed; the batch goes on
                log.exception("finishing a spawn of %r failed", pending.order.argv[0])
                try:
                    pending.abandon(outcome)
                except Exception:  # and the rest of the batch is still handed out
                    log.exception("ending what the spawn of %r made failed", pending.order.argv[0])

    def _spawned(self) -> None:
        self._spawning -= 1

    def _spawn_blocking(self, o: SpawnOrder) -> Spawned:
        """Runs in a spawn thread: pipes, the leaf, the process."""
        try:
            return self._spawn_in_thread(o)
        except OSError as exc:  # pipes or a pty: out of fds, most likely
            raise GuestdError.from_os_error(exc, stage="spawn", argv0=o.argv[0]) from None

    def _child_fds(self, o: SpawnOrder) -> tuple[dict[str, int], list[int], list[tuple[int, int]]]:
        """guestd's ends (returned), the child's ends (closed once it has started) and the
        (source, target) fds the child gets."""
        ours: dict[str, int] = {}
        theirs: list[int] = []
        child_fds: list[tuple[int, int]] = []
        try:
            if o.pty is not None:
                master, slave = os.openpty()
                theirs.append(slave)
                ours["pty"] = master
                os.set_inheritable(master, False)
                from guestd.children.tree import set_winsize

                set_winsize(master, o.pty[0], o.pty[1])
                child_fds += [(slave, 0), (slave, 1), (slave, 2)]
            else:
                for target, name, how in ((0, "stdin", o.stdin), (1, "stdout", o.stdout), (2, "stderr", o.stderr)):
                    if how == PIPE:
                        r, w = os.pipe2(os.O_CLOEXEC)
                        mine, its = (w, r) if target == 0 else (r, w)
                        ours[name] = mine
                        theirs.append(its)
                        os.set_blocking(mine, False)
                        child_fds.append((its, target))
                    elif how == DEVNULL:
                        child_fds.append((self._devnull(), target))
                    elif how == STDOUT:
                        child_fds.append((dict((t, s) for s, t in child_fds)[1], 2))
                    else:
                        child_fds.append((how, target))
        except BaseException:
            for fd in [*ours.values(), *theirs]:
                os.close(fd)
            raise
        for target, source in (o.extra_fds or {}).items():
            child_fds.append((source, target))
        return ours, theirs, child_fds

    def _spawn_in_thread(self, o: SpawnOrder) -> Spawned:
        ours, theirs, child_fds = self._child_fds(o)
        cgroup: RunCgroup | None = None
        try:
            try:
                cgroup = self.workload.new_run(o.kind, o.run_id)
            except OSError as exc:
                raise GuestdError(
                    ErrorCode.UNAVAILABLE, f"cannot make the run's cgroup: {exc}", details={"stage": "spawn"}
                ) from None
            ids = o.user if o.user is not None and os.geteuid() == 0 else self.ids()
            popen = popen_fallback(o.argv, o.env, o.cwd, child_fds, ids, o.pty is not None, cgroup)
            pidfd = None
            with contextlib.suppress(OSError, AttributeError):
                pidfd = os.pidfd_open(popen.pid)
        except BaseException:
            for fd in list(ours.values()):
                os.close(fd)
            if cgroup is not None:
                self._drop_leaf(cgroup, threadsafe=True)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        return popen.pid, pidfd, cgroup, ours, popen

    def _drop_leaf(self, cgroup: RunCgroup, threadsafe: bool = False) -> None:
        """The leaf of a spawn that failed: removed, or (a child killed by the watchdog mid-exec
        may still be in it) killed and left to the sweep."""
        if not cgroup.remove():
            cgroup.kill()
            cgroup.close_fd()
            if threadsafe and self._loop is not None:
                self._loop.call_soon_threadsafe(self.lingering.add, cgroup)
            elif not threadsafe:
                self.lingering.add(cgroup)

    # -- bookkeeping ------------------------------------------------------------------------
    def reaped(self, child: Child) -> None:
        self.reaper.tracked.discard(child.pid)
        if self.reaper.enabled and not self._sweep_soon:
            # A sweep may have stopped at this child while it was unreaped: one runs after the
            # callbacks of this exit (an exec's reply goes out first), once for a burst of exits.
            self._sweep_soon = True
            (self._loop or asyncio.get_running_loop()).call_soon(self._sweep_after_exits)

    def _sweep_after_exits(self) -> None:
        self._sweep_soon = False
        if self.reaper.enabled and not self._spawning:
            self.reaper.sweep()

    def retire(self, child: Child) -> None:
        """The run is over for guestd: its leaf is removed now, or once its last process is gone."""
        self.live.discard(child)
        if child.status is None:
            # Not reaped yet (released during a kill grace): the reaper sweep takes it.
            self.reaper.tracked.discard(child.pid)
        cg, child.cgroup = child.cgroup, None
        if cg is not None:
            cg.close_fd()  # nothing is spawned into a retired leaf
            # Removed right after the current callback (an exec's reply is written first: the
            # rmdir is 30-80 us here); kept as lingering until then, so shutdown and the sweep
            # see it whatever happens meanwhile.
            self.lingering.add(cg)
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon(self._remove_leaf, cg)
            else:
                self._remove_leaf(cg)

    def _remove_leaf(self, cg: RunCgroup) -> None:
        if cg in self.lingering and cg.remove():
            self.lingering.discard(cg)

    def kill_stuck_spawns(self, stopped_after_s: float = WATCH_S, older_than_s: float = STUCK_SPAWN_S) -> int:
        if self.native is None or not self._spawning:
            return 0
        return int(self.native.kill_stuck(stopped_after_s, older_than_s))

    async def _watch_spawns(self) -> None:
        while self._spawning:
            await asyncio.sleep(WATCH_S)
            if self.kill_stuck_spawns():
                log.warning("killed a child stopped before it could exec (the workload stops its own processes)")

    def sweep(self) -> None:
        """Periodic: reap orphans, remove leaves that have emptied."""
        if self.reaper.enabled and not self._spawning:
            self.reaper.sweep()
        for cg in list(self.lingering):
            if cg.remove():
                self.lingering.discard(cg)

    async def run_periodic(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.sweep()

    async def shutdown(self, grace_s: float = 2.0) -> None:
        """guestd is stopping: end every run it started, leftovers of finished runs included."""
        self.closing = True  # no new spawn starts: queued ones are cancelled, running ones end
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.kill_stuck_spawns(0.0, 0.0)
        for _ in range(100):  # in-flight spawns return within a watchdog tick
            if not self._spawning:
                break
            self.kill_stuck_spawns(0.0, 0.0)
            await asyncio.sleep(0.02)
        ends = [c.end(grace_s) for c in list(self.live)]
        for cg in self.lingering:
            cg.kill()
        if ends:
            await asyncio.wait(ends, timeout=grace_s + 3.0)
        for c in list(self.live):
            c.kill_now()
        for _ in range(100):
            self.sweep()
            if not self.lingering:
                break
            await asyncio.sleep(0.02)


def _collect_native() -> list[tuple[_NativeSpawn, tuple[int, int, int] | OSError]]:
    done: list[tuple[_NativeSpawn, tuple[int, int, int] | OSError]] = clone_module().collect()
    return done


class _NativeSpawn:
    """One spawn handed to the native spawn threads: what to do with it once it is done."""

    __slots__ = ("cgroup", "child", "fut", "leaf_path", "order", "ours", "owner", "theirs")

    def __init__(
        self,
        owner: Children,
        order: SpawnOrder,
        fut: asyncio.Future[Child],
        ours: dict[str, int],
        theirs: list[int],
        leaf_path: str | None,
    ) -> None:
        self.owner = owner
        self.order = order
        self.fut = fut
        self.ours = ours
        self.theirs = theirs
        self.leaf_path = leaf_path
        self.cgroup: RunCgroup | None = None  # the leaf, once wrapped (it owns the leaf's fd)
        self.child: Child | None = None  # once made (it owns the pidfd, guestd's ends, the leaf)

    def close_fds(self, ours: bool) -> None:
        # Each fd is forgotten before it is closed: after a failed close, a second call (abandon)
        # never closes a number that may be another thread's file by then.
        while self.theirs:
            os.close(self.theirs.pop())
        if ours:
            while self.ours:
                os.close(self.ours.popitem()[1])

    def finish(self, outcome: tuple[int, int, int] | OSError) -> None:
        owner, fut = self.owner, self.fut
        owner._spawned()
        if isinstance(outcome, BaseException):
            self._drop_failed(outcome)
            if getattr(outcome, "stage", None) == "clone" and outcome.errno in NO_CLONE3:
                log.warning("clone3 spawn unavailable (%s); using subprocess from now on", outcome)
                owner.native = None
                error: BaseException = Clone3Unavailable()
            else:
                error = spawn_error(outcome, self.order.argv[0], self.order.cwd)
            if not fut.done():
                fut.set_exception(error)
            self.fut = None  # type: ignore[assignment]  # the exception's traceback: no cycle kept
            return
        self.close_fds(ours=False)
        pid, pidfd, leaf_fd = outcome
        from guestd.children.child import Child  # loaded by spawn(), before the process

        child = self.child = Child(owner, self.order.kind, pid, pidfd, self._leaf(leaf_fd), self.ours, None)
        self.ours = {}  # the child's now
        owner.live.add(child)
        owner.reaper.tracked.add(pid)  # now, before any sweep could take it for an orphan
        if fut.done():  # the request went away meanwhile: the run ends at once
            child.kill_now()
            child.release()
        else:
            fut.set_result(child)

    def _leaf(self, leaf_fd: int) -> RunCgroup | None:
        """The leaf the spawn thread made (None: it made none), wrapped once: the wrapper owns
        ``leaf_fd`` from then on, so a second call (abandon after finish) returns the same."""
        if self.cgroup is None and leaf_fd >= 0 and self.leaf_path is not None:
            self.cgroup = self.owner.workload.run_leaf(self.leaf_path, leaf_fd)
        return self.cgroup

    def _drop_failed(self, outcome: OSError) -> None:
        """A spawn that failed: its pipes closed, the leaf the thread made (if any) removed."""
        self.close_fds(ours=True)
        if self.cgroup is not None:
            return  # wrapped and dropped already (abandon after a finish that got this far)
        leaf = self._leaf(getattr(outcome, "leaf_fd", -1))
        if leaf is not None:
            self.owner._drop_leaf(leaf)

    def abandon(self, outcome: tuple[int, int, int] | OSError) -> None:
        """``finish`` raised (a bug of guestd's, never the workload's doing): the request fails
        with a typed internal error instead of waiting forever, and what the spawn made is
        ended and closed. Each step checks what ``finish`` got to, so nothing is closed twice;
        a started process is killed before its pipes close (EOF must not be what ends it)."""
        fut, self.fut = self.fut, None  # type: ignore[assignment]
        if fut is not None and not fut.done():
            what = f"it had failed: {outcome}" if isinstance(outcome, BaseException) else "the process was killed"
            fut.set_exception(
                GuestdError(
                    ErrorCode.INTERNAL,
                    f"guestd failed to finish the spawn of {self.order.argv[0]!r}; {what}",
                    details={"stage": "spawn"},
                )
            )
        child, self.child = self.child, None
        if child is not None:  # it owns the rest
            child.kill_now()
            child.release()
            return
        if isinstance(outcome, BaseException):
            self._drop_failed(outcome)
            return
        # Started, with no Child yet (finish failed before it was made, so nothing tracks it):
        # killed as Child.kill_now would; the orphan sweep reaps it, the lingering sweep takes
        # the leaf.
        pid, pidfd, leaf_fd = outcome
        leaf = self._leaf(leaf_fd)
        if leaf is not None:
            leaf.kill()
        else:
            from guestd.children.tree import kill_group_and_descendants

            kill_group_and_descendants(pid)
        self.close_fds(ours=True)
        os.close(pidfd)
        if leaf is not None:
            self.owner._drop_leaf(leaf)
