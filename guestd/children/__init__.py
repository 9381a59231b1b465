"""The child-process component: every workload process guestd starts is spawned, placed in
its run's cgroup, watched, reaped and ended here (exec, background processes, shells, kernels).

``Children.spawn`` starts a run: a leaf cgroup of its own (see ``cgroups``), the workload
user, a new session, fresh pipes or a pty, a normal OOM score and nice value, every CPU its
cpuset allows, and nothing of guestd's signal handlers, raised fd limit or CPU pinning (a guestd
pinned to a CPU of its own or run at a higher priority, so the control plane answers under load,
does not hand that CPU or priority to what it starts).
The native path (``_clone``) creates the process inside its leaf with clone3, as vfork does,
so no Python runs in a child of the daemon and nothing has to move between cgroups; it runs
in the native module's own spawn threads, which need no GIL: the loop hands a spawn over and
learns it is done through an eventfd, so it never waits for an exec, and no Python thread has
to be handed the GIL to pass a spawn along (that hop cost ~70 us each way per exec here). ``Child`` is the handle:
exit watch, exit fields, signals, and ``end`` (TERM, grace, then ``cgroup.kill`` of the whole
run).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import logging
import os
import resource
import signal
import subprocess
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from guestd.children.cgroups import RunCgroup, RunUsage, WorkloadCgroup, WorkloadConfig
from guestd.children.reaper import Reaper
from guestd.children.tree import (
    ExitWatch,
    descendants,
    kill_tree,
    set_winsize,
    signal_each,
    signal_group,
    try_reap_usage,
)
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.types import RunFigures, RunFiguresFields

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor
    from types import ModuleType

__all__ = [
    "DEVNULL",
    "PIPE",
    "STDOUT",
    "Child",
    "Children",
    "ExitInfo",
    "KilledBy",
    "RunFigures",
    "WorkloadConfig",
    "run_figures",
    "usage_between",
]

log = logging.getLogger("guestd.children")

PIPE = -1  # a new pipe; guestd keeps the other end
STDOUT = -2  # stderr only: the same pipe as stdout
DEVNULL = -3
_NO_CLONE3 = (errno.ENOSYS, errno.E2BIG, errno.EINVAL)
# A child stopped (SIGSTOP from the workload) between dropping to the workload user and exec
# would hold its spawn thread forever (CLONE_VFORK). While spawns are in flight a watchdog
# looks every WATCH_S: a child found stopped is killed, and any child not exec'd after
# STUCK_SPAWN_S (a spawn takes milliseconds, even under TCG).
WATCH_S = 0.05
STUCK_SPAWN_S = 10.0
IDS_TTL_S = 1.0  # how long a lookup of the workload user's ids is reused

# guestd raises its own soft fd limit to the hard one (it holds a pipe pair per run); what it
# starts gets the limit guestd was given, since select()-based programs break above 1024.
_NOFILE_AT_START = resource.getrlimit(resource.RLIMIT_NOFILE)


def raise_fd_limit(wanted: int = 1 << 20) -> int:
    """Raise guestd's own fd limit (as root up to ``wanted``, else to the hard limit); returns it."""
    soft, hard = _NOFILE_AT_START
    target = hard
    if os.geteuid() == 0:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = max(hard, min(wanted, int(f.read())))
        except (OSError, ValueError):
            pass
    for limit in (target, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            return limit
        except (ValueError, OSError):
            continue
    return soft


def _own_oom_score_adj() -> int:
    try:
        with open("/proc/self/oom_score_adj") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


# guestd runs with OOMScoreAdjust=-1000 and children inherit it: each is set back (to
# GUESTD_CHILD_OOM_SCORE_ADJ, default 0) before it execs. Raising a score needs no privilege.
_CHILD_OOM = os.environ.get("GUESTD_CHILD_OOM_SCORE_ADJ")
_OOM_RESET: bytes | None = (_CHILD_OOM or "0").encode() if _CHILD_OOM is not None or _own_oom_score_adj() < 0 else None


# What guestd starts may run on every CPU its cpuset allows, whatever guestd's own affinity
# (GUESTD_CHILD_ALL_CPUS=0: it inherits guestd's, for bench/load.py to compare).
_ALL_CPUS = os.environ.get("GUESTD_CHILD_ALL_CPUS", "1") != "0"


# guestd may run at a higher priority than its workload (Nice= in its unit, so the control
# plane answers under load); what it starts is set back to nice 0 before it execs.
_NICE_RESET = os.getpriority(os.PRIO_PROCESS, 0) != 0


# GUESTD_RUN_USAGE=0: no reading of the run's cgroup at exit (bench/observability.py measures
# what that reading costs an exec; figures then come from wait4 alone).
_RUN_USAGE = os.environ.get("GUESTD_RUN_USAGE", "1") != "0"


def _load_native() -> ModuleType | None:
    if os.environ.get("GUESTD_NATIVE_SPAWN", "1") == "0":
        return None
    try:
        from guestd.children import _clone  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _clone if _clone.AVAILABLE else None


# Why a run ended (PROTOCOL.md "Why a run ended"): guestd ended it for a timeout, an idle
# timeout or a cancelled request; the kernel's OOM killer; any other signal (an external kill,
# the client's own signal op, an abort). None: it exited by itself.
KilledBy = Literal["timeout", "idle_timeout", "cancel", "signal", "oom"]


class ExitInfo(RunFiguresFields):
    """How a process ended, as every process reply reports it (nil while it runs), with the
    figures of why and what it used (the schema's run_figures group; nil: not known)."""

    exit_code: int | None
    signal: int | None


_NO_FIGURES: RunFigures = {
    "killed_by": None,
    "oom_killed": None,
    "cpu_user_s": None,
    "cpu_sys_s": None,
    "max_rss_bytes": None,
}


def exit_info(status: int | None) -> ExitInfo:
    """The exit fields of a wait status alone (no figures: see ``Child.exit_info``)."""
    if status is None:
        return {"exit_code": None, "signal": None, **_NO_FIGURES}
    code = os.waitstatus_to_exitcode(status)
    return {"exit_code": code if code >= 0 else None, "signal": -code if code < 0 else None, **_NO_FIGURES}


def run_figures(info: ExitInfo) -> RunFigures:
    """The figures of an exit info alone (for results that report the exit their own way)."""
    return {
        "killed_by": info["killed_by"],
        "oom_killed": info["oom_killed"],
        "cpu_user_s": info["cpu_user_s"],
        "cpu_sys_s": info["cpu_sys_s"],
        "max_rss_bytes": info["max_rss_bytes"],
    }


def usage_between(
    before: RunUsage | None, after: RunUsage | None, killed_by: KilledBy | None, exit_code: int | None
) -> RunFigures:
    """The figures of part of a long-lived run (one shell command, one cell): what its leaf
    counted between two readings. ``killed_by`` is the caller's (a timeout it fired...);
    without one, an OOM kill counted meanwhile with status 137 (bash's 128 + SIGKILL) is "oom".
    No peak RSS: a process's peak covers its whole life, not a part of it."""

    def delta(a: int | None, b: int | None) -> int | None:
        return None if a is None or b is None else max(0, b - a)

    user = sys_ = oom = None
    if before is not None and after is not None:
        user, sys_ = delta(before.user_usec, after.user_usec), delta(before.system_usec, after.system_usec)
        oom = delta(before.oom_kills, after.oom_kills)
    if killed_by is None and oom and exit_code == 128 + signal.SIGKILL:
        killed_by = "oom"
    return {
        "killed_by": killed_by,
        "oom_killed": None if oom is None else oom > 0,
        "cpu_user_s": None if user is None else user / 1e6,
        "cpu_sys_s": None if sys_ is None else sys_ / 1e6,
        "max_rss_bytes": None,
    }


class Child:
    """One started run: its main process, its pipes (guestd's ends), its leaf cgroup."""

    def __init__(
        self,
        owner: Children,
        kind: str,
        pid: int,
        pidfd: int | None,
        cgroup: RunCgroup | None,
        fds: dict[str, int],
        popen: subprocess.Popen[bytes] | None,
    ) -> None:
        self.owner = owner
        self.kind = kind
        self.pid = pid
        self.cgroup = cgroup
        self.stdin = fds.get("stdin")
        self.stdout = fds.get("stdout")
        self.stderr = fds.get("stderr")
        self.pty = fds.get("pty")
        self.status: int | None = None
        self._pidfd = pidfd
        self._popen = popen  # fallback spawn only: told the exit status so it never waits
        self._exit_watch: ExitWatch | None = None
        self._exit_callbacks: list[Callable[[], None]] = []
        self.exited: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ending: asyncio.Task[None] | None = None
        self._known: list[Any] = []  # descendants seen before the leader died (no-cgroup mode)
        self.ended_by: KilledBy | None = None  # why guestd ended the run, when it did (first reason)
        self.rusage: resource.struct_rusage | None = None  # wait4: the main process + what it waited for
        self.leaf_at_exit: RunUsage | None = None  # the leaf's counters when the main process was reaped

    # -- exit ---------------------------------------------------------------------------
    def watch(self, on_exit: Callable[[], None] | None = None, poll_s: float = 0.05) -> None:
        """Start the exit watch (once); ``on_exit`` runs on the loop after the reap."""
        if on_exit is not None:
            self._exit_callbacks.append(on_exit)
        if self._exit_watch is None and self.status is None:
            loop = asyncio.get_running_loop()
            self._exit_watch = ExitWatch(loop, self.pid, self._on_exit_ready, poll_s, pidfd=self._pidfd)
            self._on_exit_ready()

    def _on_exit_ready(self) -> None:
        if self.status is not None:
            return
        reaped = try_reap_usage(self.pid)
        if reaped is None:
            return
        status, self.rusage = reaped
        if self.cgroup is not None and _RUN_USAGE:
            self.leaf_at_exit = self.cgroup.usage()
        self.status = status
        if self._popen is not None:
            self._popen.returncode = os.waitstatus_to_exitcode(status)
        if self._exit_watch is not None:
            self._exit_watch.close()
        self.owner.reaped(self)
        if not self.exited.done():
            self.exited.set_result(None)
        # Once only, and dropped: a callback holds its owner (an exec run), which holds this
        # Child; kept, every run would be a reference cycle left for the garbage collector.
        callbacks, self._exit_callbacks = self._exit_callbacks, []
        for cb in callbacks:
            cb()

    @property
    def running(self) -> bool:
        return self.status is None

    def exit_info(self) -> ExitInfo:
        """Exit status, why the run ended, and what it used (all nil while it runs).

        CPU: the leaf's cpu.stat when the main process was reaped (every process of the run,
        orphans included, up to that moment), else wait4's rusage (the main process and the
        children it waited for). ``max_rss_bytes``: the leaf's memory.peak (every process of
        the run, page cache included), nil without per-run memory accounting. Not wait4's
        ru_maxrss: exec records the high-water mark of the memory it leaves, and a child spawned
        like vfork (or forked) leaves guestd's, so `true` reported 37 MB here."""
        info = exit_info(self.status)
        if self.status is None:
            return info
        ru, leaf = self.rusage, self.leaf_at_exit
        user = sys_ = None
        if leaf is not None and leaf.user_usec is not None and leaf.system_usec is not None:
            user, sys_ = leaf.user_usec / 1e6, leaf.system_usec / 1e6
        elif ru is not None:
            user, sys_ = ru.ru_utime, ru.ru_stime
        oom = None if leaf is None or leaf.oom_kills is None else leaf.oom_kills > 0
        info["oom_killed"] = oom
        info["cpu_user_s"] = user
        info["cpu_sys_s"] = sys_
        info["max_rss_bytes"] = leaf.peak_bytes if leaf is not None else None
        info["killed_by"] = self.ended_by or _death_cause(info["signal"], oom)
        return info

    def usage_now(self) -> RunUsage | None:
        """The leaf's counters now (None without a leaf): for figures of part of a run."""
        return self.cgroup.usage() if self.cgroup is not None else None

    def note_end(self, reason: KilledBy) -> None:
        """guestd is about to end the run for ``reason`` (kept when it is the first one)."""
        if self.ended_by is None and self.status is None:
            self.ended_by = reason

    # -- signals and ending ---------------------------------------------------------------
    def signal(self, sig: int) -> None:
        """``sig`` to the run's process group (its session leader's group); once the leader is
        reaped its pid may be reused, so then to what is left in the run's cgroup instead."""
        if sig == signal.SIGKILL:
            self.kill_now()
        elif self.running:
            signal_group(self.pid, sig)
        elif self.cgroup is not None:
            self.cgroup.signal_all(sig)

    def kill_now(self) -> None:
        """SIGKILL the whole run at once: the leaf cgroup, or the group plus known descendants."""
        if self.cgroup is not None:
            self.cgroup.kill()
            return
        if self.running:
            escaped = descendants(self.pid)
            signal_group(self.pid, signal.SIGKILL)
            signal_each(escaped, signal.SIGKILL)
        signal_each(self._known, signal.SIGKILL)  # psutil handles: no pid-reuse mistakes

    def end(self, grace_s: float, reason: KilledBy | None = None) -> asyncio.Task[None]:
        """TERM (and CONT) everything in the run, wait up to ``grace_s`` for it to be gone,
        then kill what is left. Idempotent: the same task for every caller. ``reason``: why
        (reported as the run's ``killed_by``)."""
        if reason is not None:
            self.note_end(reason)
        if self._ending is None:
            if self.cgroup is None:
                self._known = descendants(self.pid) if self.running else []
                self._ending = asyncio.get_running_loop().create_task(
                    kill_tree(self.pid, self._known, grace_s, _event_of(self.exited))
                )
            else:
                self._ending = asyncio.get_running_loop().create_task(self._end_cgroup(self.cgroup, grace_s))
        return self._ending

    async def _end_cgroup(self, cg: RunCgroup, grace_s: float) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGCONT):  # a stopped process never handles TERM
            if self.running:  # once reaped, the leader's pid (and group id) may be reused
                signal_group(self.pid, sig)
            cg.signal_all(sig)
        deadline = loop.time() + grace_s
        while cg.populated() and loop.time() < deadline:
            await asyncio.sleep(min(0.02, max(0.0, deadline - loop.time())))
        if cg.populated():
            cg.kill()
        for _ in range(250):  # SIGKILLed processes leave within milliseconds; bounded anyway
            if not cg.populated():
                break
            await asyncio.sleep(0.02)

    # -- release --------------------------------------------------------------------------
    def close_fd(self, name: str) -> None:
        fd = getattr(self, name)
        if fd is not None:
            setattr(self, name, None)
            with contextlib.suppress(OSError):
                os.close(fd)

    def release(self) -> None:
        """Close guestd's ends of the pipes and the exit watch. The leaf goes once it is empty."""
        for name in ("stdin", "stdout", "stderr", "pty"):
            self.close_fd(name)
        if self._exit_watch is not None:
            self._exit_watch.close()
        self._exit_callbacks = []  # no exit is reported any more (and no cycle through them is kept)
        if self._pidfd is not None:  # released while running: the orphan sweep reaps it
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None
        self.owner.retire(self)


def _death_cause(sig: int | None, oom: bool | None) -> KilledBy | None:
    """Why a run guestd did not end itself ended: the OOM killer when it killed one of the run's
    processes and the main process died of SIGKILL, any other signal, else nothing."""
    if sig is None:
        return None
    return "oom" if oom and sig == signal.SIGKILL else "signal"


def _event_of(fut: asyncio.Future[None]) -> asyncio.Event:
    ev = asyncio.Event()
    if fut.done():
        ev.set()
    else:
        fut.add_done_callback(lambda _f: ev.set())
    return ev


@dataclass(frozen=True)
class SpawnOrder:
    """One spawn, as the spawn thread gets it (see Children.spawn for the meaning of each)."""

    argv: list[str]
    kind: str
    run_id: str
    env: dict[str, str] | None
    cwd: str | None
    stdin: int
    stdout: int
    stderr: int
    pty: tuple[int, int] | None
    extra_fds: dict[int, int] | None
    user: tuple[int, int] | None = None


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
        self.native = _load_native()
        self.live: set[Child] = set()
        self.lingering: set[RunCgroup] = set()  # finished runs whose leaf still has processes
        self._pool: ThreadPoolExecutor | None = None
        self._done_fd: int | None = None  # the native spawn threads' eventfd, watched by the loop
        self._null_fd: int | None = None
        self._counter = 0
        # Spawns in flight: their pids are not tracked yet, so the orphan sweep must wait
        # (it would reap them as orphans and their owners would see status 255).
        self._spawning = 0
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
        self._counter += 1
        run_id = f"{self._counter}-{os.urandom(4).hex()}"
        order = SpawnOrder(argv, kind, run_id, env, cwd, stdin, stdout, stderr, pty, extra_fds, user)
        if self.native is not None:
            try:
                return await self._spawn_native(order)
            except _Clone3Unavailable:
                pass  # this kernel has no clone3 (into a cgroup): the subprocess path from now on
        return await self._spawn_pooled(order)

    async def _spawn_pooled(self, order: SpawnOrder) -> Child:
        """The subprocess fallback: a spawn in a thread pool (Python runs in the forked child)."""
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
                _exec_paths(o.argv[0], (os.environ if o.env is None else o.env).get("PATH")),
                [os.fsencode(a) for a in o.argv],
                None if o.env is None else self._encode_env(o.env),
                None if o.cwd is None else os.fsencode(o.cwd),
                child_fds,
                ids[0] if ids else -1,
                ids[1] if ids else -1,
                True,
                o.pty is not None,
                -1,
                _OOM_RESET,
                _NOFILE_AT_START,
                _ALL_CPUS,
                _NICE_RESET,
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
            pending.finish(outcome)

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
            pid, pidfd, popen = self._start(o.argv, o.env, o.cwd, child_fds, ids, o.pty is not None, cgroup)
        except BaseException:
            for fd in list(ours.values()):
                os.close(fd)
            if cgroup is not None:
                self._drop_leaf(cgroup, threadsafe=True)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        return pid, pidfd, cgroup, ours, popen

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

    def _start(
        self,
        argv: list[str],
        env: dict[str, str] | None,
        cwd: str | None,
        child_fds: list[tuple[int, int]],
        ids: tuple[int, int] | None,
        ctty: bool,
        cgroup: RunCgroup | None,
    ) -> tuple[int, int | None, subprocess.Popen[bytes] | None]:
        try:
            popen = _popen_fallback(argv, env, cwd, child_fds, ids, ctty, cgroup)
            pidfd = None
            with contextlib.suppress(OSError, AttributeError):
                pidfd = os.pidfd_open(popen.pid)
            return popen.pid, pidfd, popen
        except OSError as exc:
            raise _spawn_error(exc, argv[0], cwd) from None
        except (ValueError, TypeError) as exc:  # NUL bytes in argv, env or cwd
            raise GuestdError(ErrorCode.BAD_REQUEST, f"cannot spawn: {exc}", details={"stage": "spawn"}) from None
        except subprocess.SubprocessError as exc:
            raise GuestdError(
                ErrorCode.UNAVAILABLE,
                f"could not set up the child (workload cgroup / workload user): {exc}",
                details={"stage": "spawn"},
            ) from None

    # -- bookkeeping ------------------------------------------------------------------------
    def reaped(self, child: Child) -> None:
        self.reaper.tracked.discard(child.pid)
        if self.reaper.enabled and not self._spawning:
            self.reaper.sweep()  # a sweep may have stopped at this child while it was unreaped

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


@functools.lru_cache(maxsize=256)
def _exec_paths(exe: str, path: str | None) -> list[bytes]:
    """Where to look for ``exe``, as execvpe would: as given when it has a slash, else in
    ``path`` (a PATH value; None: the default path). Kept: 15 us per spawn otherwise. The
    caller must not change the list."""
    if os.sep in exe:
        return [os.fsencode(exe)]
    return [os.fsencode(os.path.join(d, exe)) for d in os.get_exec_path({} if path is None else {"PATH": path})]


def _popen_fallback(
    argv: list[str],
    env: dict[str, str] | None,
    cwd: str | None,
    child_fds: list[tuple[int, int]],
    ids: tuple[int, int] | None,
    ctty: bool,
    cgroup: RunCgroup | None,
) -> subprocess.Popen[bytes]:
    """Where the native spawn is missing: fork + a Python preexec step (slower, see _clone.c)."""
    by_target = dict((t, s) for s, t in child_fds)
    procs = os.path.join(cgroup.path, "cgroup.procs") if cgroup is not None else ""

    def preexec() -> None:
        if procs:
            with open(procs, "w") as f:
                f.write("0")
        if ctty:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        if _OOM_RESET is not None:
            with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "wb") as f:
                f.write(_OOM_RESET)
        resource.setrlimit(resource.RLIMIT_NOFILE, _NOFILE_AT_START)
        if _ALL_CPUS:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, range(1024))
        if _NICE_RESET:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, 0)  # as the native spawn: every CPU the cpuset allows
        for target, source in by_target.items():
            if target > 2:
                os.dup2(source, target, inheritable=True)
        if ids is not None:
            os.setgroups([])
            os.setresgid(ids[1], ids[1], ids[1])
            os.setresuid(ids[0], ids[0], ids[0])

    return subprocess.Popen(
        argv,
        stdin=by_target.get(0),
        stdout=by_target.get(1),
        stderr=by_target.get(2),
        cwd=cwd,
        env=env,
        start_new_session=True,
        # Extra fds are dup'ed onto their numbers in preexec, which runs before close_fds would
        # close them; every fd guestd opens is O_CLOEXEC (PEP 446), so nothing else leaks.
        close_fds=False,
        preexec_fn=preexec,
    )


def _spawn_error(exc: OSError, argv0: str, cwd: str | None) -> GuestdError:
    """A could-not-start error for a spawn's OSError (its .stage says where it failed)."""
    stage = getattr(exc, "stage", None)
    if stage == "cwd" or (stage is None and cwd is not None and exc.filename == cwd):
        return GuestdError.from_os_error(exc, stage="cwd", cwd=cwd)
    if stage in (None, "exec", "clone"):  # clone: e.g. EAGAIN at the workload's pids.max
        return GuestdError.from_os_error(exc, stage="spawn", argv0=argv0)
    if stage == "stopped":
        return GuestdError(
            ErrorCode.UNAVAILABLE,
            "the process was stopped (by the workload?) before it could exec, and was killed",
            details={"stage": "spawn"},
        )
    if stage == "cgroup":
        return GuestdError(ErrorCode.UNAVAILABLE, f"cannot make the run's cgroup: {exc}", details={"stage": "spawn"})
    return GuestdError(
        ErrorCode.UNAVAILABLE, f"could not set up the child ({stage}): {exc}", details={"stage": "spawn"}
    )


class _Clone3Unavailable(Exception):
    """This kernel has no clone3 (5.3) or no CLONE_INTO_CGROUP (5.7): spawn through subprocess."""


def _collect_native() -> list[tuple[_NativeSpawn, tuple[int, int, int] | OSError]]:
    from guestd.children import _clone  # type: ignore[attr-defined]

    done: list[tuple[_NativeSpawn, tuple[int, int, int] | OSError]] = _clone.collect()
    return done


class _NativeSpawn:
    """One spawn handed to the native spawn threads: what to do with it once it is done."""

    __slots__ = ("fut", "leaf_path", "order", "ours", "owner", "theirs")

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

    def close_fds(self, ours: bool) -> None:
        for fd in self.theirs:
            os.close(fd)
        self.theirs = []
        if ours:
            for fd in self.ours.values():
                os.close(fd)
            self.ours = {}

    def finish(self, outcome: tuple[int, int, int] | OSError) -> None:
        owner, fut = self.owner, self.fut
        owner._spawned()
        if isinstance(outcome, BaseException):
            self.close_fds(ours=True)
            leaf_fd = getattr(outcome, "leaf_fd", -1)
            if leaf_fd >= 0 and self.leaf_path is not None:
                owner._drop_leaf(RunCgroup(self.leaf_path, leaf_fd))
            if getattr(outcome, "stage", None) == "clone" and outcome.errno in _NO_CLONE3:
                log.warning("clone3 spawn unavailable (%s); using subprocess from now on", outcome)
                owner.native = None
                error: BaseException = _Clone3Unavailable()
            else:
                error = _spawn_error(outcome, self.order.argv[0], self.order.cwd)
            if not fut.done():
                fut.set_exception(error)
            self.fut = None  # type: ignore[assignment]  # the exception's traceback: no cycle kept
            return
        self.close_fds(ours=False)
        pid, pidfd, leaf_fd = outcome
        cgroup = RunCgroup(self.leaf_path, leaf_fd) if leaf_fd >= 0 and self.leaf_path is not None else None
        child = Child(owner, self.order.kind, pid, pidfd, cgroup, self.ours, None)
        owner.live.add(child)
        owner.reaper.tracked.add(pid)  # now, before any sweep could take it for an orphan
        if fut.done():  # the request went away meanwhile: the run ends at once
            child.kill_now()
            child.release()
        else:
            fut.set_result(child)
