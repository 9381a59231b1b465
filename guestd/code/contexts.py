"""Persistent Python code contexts: one ipykernel kernel per context, driven with jupyter_client.

jupyter_client (and zmq, tornado, traitlets) is imported on first use only, so a
guestd that never runs code does not pay for it in memory or start-up time.

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
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import socket
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from guestd.capture import OutputCapture, capture_fields
from guestd.children import usage_between
from guestd.children.cgroups import guestd_running
from guestd.children.tree import alive, descendants
from guestd.code.kernel import NO_IPYKERNEL, PRIVATE_NAME
from guestd.code.kernelspec import PYTHON_KERNEL, ForeignSpec, find_kernelspec, foreign_command
from guestd.code.messages import RunState, decode, fit_reply, kernel_content_cap, kernel_max_message
from guestd.code.python import KernelPython, missing_ipykernel
from guestd.code.python import resolve as resolve_python
from guestd.code.reseed import ReseedChannel, handover_channel, kernel_seed
from guestd.code.start import StartWait, kernel_pids, within, work_done
from guestd.services import derive, to_the_end
from guestd.wire.errors import ErrorCode, GuestdError, limit_error

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.children import Child, KilledBy
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

POOL_RETRY_S = 5.0  # after a pool kernel failed to start; doubled after each failure in a row
POOL_RETRY_MAX_S = 300.0
GONE_WAIT_S = 5.0  # a SIGKILLed kernel's processes are gone within milliseconds; bounded anyway
EXIT_STATUS_WAIT_S = 2.0  # a start that failed: how long its exit status may take to be known
DEFAULT_CONTEXT = "default"


# Waits for a kernel's confirmation of its seed after a restore (guestd.code.reseed). An idle
# kernel's re-seed thread answers within a millisecond; a second means the thread is gone
# (a cell closed its channel) or the guest is starved: then a hidden cell re-seeds it. A busy
# kernel answers as soon as its cell lets a thread run: at once in a sleep or I/O, within the
# 5 ms switch interval in a Python loop, only when it returns from a C call holding the GIL;
# the restore does not wait longer than BUSY for it (it is pending: guestd.code.contexts).
IDLE_CONFIRM_WAIT_S = 1.0
BUSY_CONFIRM_WAIT_S = 0.05
NEXT_CELL_CONFIRM_WAIT_S = 1.0  # a pending seed, before the context's next cell


KERNEL_RCVHWM = 8
_zmq_contexts: dict[int, Any] = {}


def _zmq_context(limits: Any) -> Any:
    """One zmq context for every kernel client, its sockets capped at kernel_max_message."""
    cap = kernel_max_message(limits)
    ctx = _zmq_contexts.get(cap)
    if ctx is None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        ctx.setsockopt(zmq.MAXMSGSIZE, cap)
        # At most this many messages wait in guestd per socket; the kernel's iopub then waits
        # (XPUB_NODROP, guestd.code.kernel) instead of guestd buffering a fast cell's output.
        ctx.setsockopt(zmq.RCVHWM, KERNEL_RCVHWM)
        _zmq_contexts[cap] = ctx
    return ctx


def _ipython_dir(runtime_dir: str) -> str:
    """guestd's IPython directory for every kernel: made by guestd, 0755, with an empty
    profile. A kernel running as the workload user cannot write it (IPython then keeps its
    history in a temporary directory of its own)."""
    d = os.path.join(runtime_dir, "ipython")
    startup = os.path.join(d, "profile_default", "startup")
    os.makedirs(startup, mode=0o755, exist_ok=True)
    for path in (d, os.path.dirname(startup), startup):
        os.chmod(path, 0o755)
    return d


def _exit_reason(status: int | None) -> str:
    if status is None:
        return "kernel process ended (status unknown)"
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"killed by signal {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    return f"exited with status {code}"


def _home_of(uid: int) -> str | None:
    """The user's home directory, if the user has one that exists."""
    import pwd

    try:
        home = pwd.getpwuid(uid).pw_dir
    except KeyError:
        return None
    return home if os.path.isdir(home) else None


def write_private_file(directory: str, name: str, data: bytes, ids: tuple[int, int] | None) -> None:
    """``directory``/``name`` made new (0600, owned by ``ids``) with ``data``, without following
    anything: the directory is the workload user's own (a kernel's), so the workload may plant
    or swap a symlink or FIFO at that name at any moment. Created ``O_EXCL|O_NOFOLLOW`` under
    the directory's fd (an entry already there is removed first: the name has random bits, so
    it is a plant), then owner and mode set on the fd, never by name (SECURITY.md, "foreign
    kernels")."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dfd)
        fd = os.open(name, flags, 0o600, dir_fd=dfd)
        try:
            os.fchmod(fd, 0o600)
            if ids is not None:
                os.fchown(fd, *ids)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


class Kernel:
    """One kernel process and its client channels: guestd's own Python kernel, or with
    ``spec`` a kernelspec installed in the guest (a foreign kernel, SECURITY.md)."""

    def __init__(self, services: Services, kid: str, spec: ForeignSpec | None = None, epoch: int = 0) -> None:
        self.services = services
        self.kid = kid
        self.spec = spec
        self.epoch = epoch  # the restores guestd had seen when this kernel was spawned (Contexts.epoch)
        self.reseeder: ReseedChannel | None = None  # guestd's own launcher only, once it is ready
        self.connection_file: str | None = None  # a foreign kernel's, until it is ready
        self.km: Any = None
        self.kc: Any = None
        self.pid = 0
        self.child: Child | None = None
        self.died: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.readers: list[asyncio.Future[None]] = []
        self.current: RunState | None = None  # the run whose messages the readers deliver
        self.python: KernelPython | None = None  # the interpreter of a "python" kernel, once resolved

    async def start(self, cwd: str | None, env: dict[str, str] | None, wait: StartWait) -> None:
        """Start the kernel and wait (``wait``) until it answers. A start that fails or is
        cancelled leaves the kernel to the caller, who ends it with :meth:`shutdown`."""
        from jupyter_client.manager import AsyncKernelManager

        kdir = self.services.kernel_dir()
        # jupyter_client writes the connection file, makes the client and cleans up; the process
        # itself is a run of guestd.children (its own cgroup, the workload user), like any other.
        km = AsyncKernelManager(kernel_name="guestd-python" if self.spec is None else self.spec.name)
        km.transport = "ipc"  # Unix sockets in a 0700 directory: no ports, no network
        km.ip = os.path.join(kdir, self.kid)
        kenv = dict(os.environ)
        if self.spec is None:
            kenv.update(env or {})
        else:
            # The kernelspec's env and the context's apply to the kernel's command only, not to
            # guestd's Python that starts it (a PYTHONPATH there would hide guestd): see exec_foreign.
            kenv["GUESTD_KERNEL_ENV"] = json.dumps({**self.spec.env, **(env or {})})
        kenv["GUESTD_PARENT_PID"] = str(os.getpid())
        if self.spec is None:
            self.python = resolve_python(self.services.config.code_python, kenv.get("PATH"))
        if self.python is not None and self.python.own:
            from guestd.config import PRIVATE_ENV

            kenv.update(PRIVATE_ENV)  # the kernel runs guestd's own Python (a baked image's libpython)
        kenv["GUESTD_KERNEL_MAX_CONTENT"] = str(kernel_content_cap(self.services.config.limits))
        kenv.setdefault("PYTHONUNBUFFERED", "1")
        kenv["MPLBACKEND"] = kenv.get("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        self.km = km
        ids = self.services.config.policy.workload_ids()
        if ids is not None:
            # The kernel runs as the workload user: it must read its connection file and bind its
            # ipc sockets, so its files live in a directory of its own, owned by that user.
            # Parents must be traversable (not listable) by that user: 0711.
            os.chmod(self.services.runtime_dir(), 0o711)
            os.chmod(kdir, 0o711)
            kdir = os.path.join(kdir, f"u{ids[0]}")
            os.makedirs(kdir, mode=0o700, exist_ok=True)
            os.chown(kdir, *ids)
            km.ip = os.path.join(kdir, self.kid)
            kenv["HOME"] = kdir  # guestd's HOME is not the workload user's to write
            if self.python is not None and not self.python.own:
                # The workload's Python: its user site-packages (pip install --user) are the
                # workload user's, under that user's home, as in the workload's own shells.
                kenv["HOME"] = _home_of(ids[0]) or kdir
        # A fresh kernel starts from guestd's IPython directory, not the workload's (the workload
        # user cannot write it: no startup files, no profile config). guestd's own Python also
        # gets no user site-packages (usercustomize); the workload's Python gets its packages,
        # user site included: that is what it is for. See SECURITY.md, "code contexts".
        kenv["IPYTHONDIR"] = _ipython_dir(self.services.runtime_dir())
        if self.python is None or self.python.own:
            kenv["PYTHONNOUSERSITE"] = "1"
        # The connection info lives in guestd's memory and reaches the kernel over a socketpair
        # (its fd 0), never a file: see hand_over_connection.
        for number, name in enumerate(("shell", "iopub", "stdin", "hb", "control"), start=1):
            setattr(km, f"{name}_port", number)  # ipc: the socket paths are <ip>-<number>
        km.session.key = secrets.token_hex(32).encode()
        channel = None
        if self.spec is not None:
            await self._start_foreign(km, kdir, kenv, cwd, ids)
        else:
            channel = await self._start_own(kenv, cwd)
        assert self.child is not None
        # Watched and recorded from the spawn on: a kernel that dies, or whose start is given up,
        # is reaped (and a crashed guestd's successor finds its pid file) however far it came.
        self.child.watch(self._on_exit, 0.2)
        self._write_pidfile()
        child = self.child
        cgroup_pids = child.cgroup.pids if child.cgroup is not None else None
        came_up = False
        try:
            await within(
                wait, self._come_up(km, channel, ids), self.died, lambda: work_done(kernel_pids(child.pid, cgroup_pids))
            )
            came_up = True
        except GuestdError:
            if self.python is not None and child.status is None:
                # The launcher's end is seen (its channel closed) before it has exited and its exit
                # watch, which polls, has reaped it: the status says whether it lacked ipykernel.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(child.exited), EXIT_STATUS_WAIT_S)
            status = child.status
            if self.python is not None and status is not None and os.waitstatus_to_exitcode(status) == NO_IPYKERNEL:
                raise missing_ipykernel(self.python) from None
            raise
        finally:
            if channel is not None and not came_up:
                channel.close()
            self._remove_connection_file()  # a foreign kernel has read it by now (or failed)
        if channel is not None:
            self.reseeder = ReseedChannel(channel)  # the key went over it; now the seeds of restores
        # From here on guestd reads the channels itself: one long-lived reader per socket that
        # hands each message to the run in progress, with a lean decode (no date parsing, no
        # protocol adaptation) instead of jupyter_client's per-call poll + deserialize.
        kc = self.kc
        self.readers = [
            asyncio.ensure_future(self._reader(kc.iopub_channel.socket, "iopub")),
            asyncio.ensure_future(self._reader(kc.shell_channel.socket, "shell")),
            asyncio.ensure_future(self._reader(kc.stdin_channel.socket, "stdin")),
        ]

    async def _start_own(self, kenv: dict[str, str], cwd: str | None) -> socket.socket:
        """guestd's Python kernel; returns guestd's end of the socketpair the key goes over
        (:meth:`_come_up` hands it over once the kernel is non-dumpable)."""
        from guestd.children import DEVNULL

        assert self.python is not None
        ours, theirs = handover_channel()
        try:
            self.child = await self.services.children.spawn(
                self.python.argv(),  # guestd's own Python, or the workload's (guestd.code.python)
                kind="kernel",
                env=kenv,
                cwd=cwd or os.getcwd(),
                # Not guestd's fds 1 and 2 (its log): the workload must not write into guestd's log.
                # ipykernel forwards what cells write to these fds to the client anyway.
                stdin=theirs.fileno(),
                stdout=DEVNULL,
                stderr=DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self.child.pid
        return ours

    async def _start_foreign(
        self, km: Any, kdir: str, kenv: dict[str, str], cwd: str | None, ids: tuple[int, int] | None
    ) -> None:
        """A kernelspec's kernel reads its connection info from a file (``{connection_file}``), so
        the key is on disk until the kernel is ready: 0600, owned by the kernel's user, in that
        user's 0700 kernel directory (other users cannot reach it), removed once the kernel
        answers. The kernel is an ordinary process of that user: the workload (the same user)
        can read the key (the file while the kernel starts, its memory where ptrace is allowed),
        so a foreign kernel is no boundary against the workload (SECURITY.md, "foreign kernels")."""
        from guestd.children import DEVNULL
        from guestd.config import PRIVATE_ENV

        assert self.spec is not None
        path = os.path.join(kdir, f"{self.kid}.json")
        info = km.get_connection_info(session=False)
        info["key"] = info["key"].decode("ascii")
        info["kernel_name"] = self.spec.name
        self.connection_file = path
        write_private_file(kdir, f"{self.kid}.json", json.dumps(info).encode(), ids)
        kenv["GUESTD_KERNEL_DROP_ENV"] = ",".join(PRIVATE_ENV)
        self.child = await self.services.children.spawn(
            # guestd.code.kernel --exec: PR_SET_PDEATHSIG (kept across the exec), then the kernelspec's command.
            [sys.executable, "-P", "-m", "guestd.code.kernel", "--exec", *foreign_command(self.spec, path)],
            kind="kernel",
            env=kenv,
            cwd=cwd or os.getcwd(),
            stdin=DEVNULL,
            stdout=DEVNULL,  # not guestd's log: the workload must not write into it
            stderr=DEVNULL,
        )
        self.pid = self.child.pid

    def _remove_connection_file(self) -> None:
        path, self.connection_file = self.connection_file, None
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass

    async def _come_up(self, km: Any, channel: socket.socket | None, ids: tuple[int, int] | None) -> None:
        """From spawned to answering: the key handed over (guestd's own kernel), the channels
        opened, the first kernel_info answered. Unbounded here: :func:`within` bounds it."""
        if channel is not None:
            # One message; the channel stays open for re-seeding (Kernel.start closes it on failure).
            await hand_over_connection(channel, self.pid, km.get_connection_info(session=False), ids)
        # No parent: jupyter_client would ask the manager whether the kernel lives, and the manager
        # did not start it (guestd.children did), so it would say no; self.died answers instead.
        kc = km.client(parent=None, context=_zmq_context(self.services.config.limits))
        kc.start_channels(hb=False)  # liveness comes from the pidfd; no heartbeat thread
        self.kc = kc
        try:
            await kc.wait_for_ready(timeout=None)
        except Exception as exc:  # a kernel that died before it answered
            raise GuestdError(
                ErrorCode.UNAVAILABLE, f"kernel failed to start: {exc}", details={"stage": "start"}
            ) from None

    async def _reader(self, sock: Any, channel: str) -> None:
        session = self.kc.session
        while True:
            frames = await sock.recv_multipart()
            await asyncio.sleep(0)  # a fast cell's messages must not hold the loop (pings, other runs)
            try:
                msg = decode(session, frames)
            except Exception:
                log.warning("kernel %s: undecodable %s message dropped", self.kid, channel)
                continue
            run = self.current
            if run is None or msg["parent_header"].get("msg_id") != run.msg_id:
                continue  # late output of an earlier cell, or a reply nobody waits for
            try:
                if channel == "iopub":
                    await run.on_iopub(msg)
                elif channel == "shell":
                    run.on_shell(msg)
                else:
                    run.on_stdin(msg, self)
            except ConnectionResetError:
                run.stream = None  # the streaming client left; keep reading for the kernel's sake
            except Exception:
                log.exception("kernel %s: handling a %s message failed", self.kid, channel)

    def _pidfile(self) -> str:
        return os.path.join(self.services.kernel_dir(), f"{self.kid}.pid")

    def _write_pidfile(self) -> None:
        try:
            import psutil

            ctime = psutil.Process(self.pid).create_time()
            with open(self._pidfile(), "w") as f:
                # A foreign kernel's command line is its kernelspec's, not guestd.code.kernel.
                f.write(f"{self.pid} {ctime}" + (" foreign\n" if self.spec is not None else "\n"))
        except (OSError, ImportError, Exception):  # best effort: PDEATHSIG is the first line of defence
            log.debug("could not record kernel pid", exc_info=True)

    def _on_exit(self) -> None:
        assert self.child is not None
        # What the kernel started (``setsid -f``, ``cmd &``) dies with it: a dead context can only
        # be restarted or closed, and nothing else owns those processes (they ran on, in the dead
        # context's run, until then).
        self.child.kill_now()
        if not self.died.done():
            self.died.set_result(_exit_reason(self.child.status))
        self._remove_pidfile()

    def _remove_pidfile(self) -> None:
        try:
            os.unlink(self._pidfile())
        except OSError:
            pass

    @property
    def alive(self) -> bool:
        return not self.died.done()

    @property
    def ready(self) -> bool:
        """Started and answering (guestd reads its channels)."""
        return bool(self.readers)

    def send_input(self, line: str) -> None:
        """The answer to the cell's ``input()`` (RunState.on_stdin)."""
        self.kc.input(line)

    def interrupt(self) -> None:
        if self.alive and self.spec is not None and self.spec.interrupt_mode == "message" and self.kc is not None:
            # The kernelspec asks for interrupt_request on the control channel instead of SIGINT.
            self.kc.control_channel.send(self.kc.session.msg("interrupt_request", {}))
            return
        if self.alive:
            try:
                os.killpg(self.pid, signal.SIGINT)  # the kernel's own process group
            except OSError:
                try:
                    os.kill(self.pid, signal.SIGINT)
                except OSError:
                    pass

    async def shutdown(self) -> None:
        """Kill now (a context's state is disposable) and release every file: all of it, also
        when the request that asked is cancelled while the kernel is slow to die."""
        await to_the_end(self._shutdown())

    async def _shutdown(self) -> None:
        if self.reseeder is not None:
            self.reseeder.close()
        for r in self.readers:
            r.cancel()
        if self.readers:
            await asyncio.gather(*self.readers, return_exceptions=True)
        self.readers = []
        if self.kc is not None:
            try:
                self.kc.stop_channels()
            except Exception:
                pass
        if self.child is not None:
            # The whole run: what cells started in sessions of their own dies with the kernel.
            # Without a leaf cgroup, its processes are those found under it now.
            cg = self.child.cgroup
            tree = descendants(self.pid) if cg is None and self.child.running else []
            self.child.kill_now()
            if self.alive:
                try:
                    await asyncio.wait_for(asyncio.shield(self.died), GONE_WAIT_S)  # reaped by the watch
                except TimeoutError:
                    log.warning("kernel %s (pid %d) did not exit after SIGKILL", self.kid, self.pid)
            # Answer only once they are all gone: the next request must not find a kernel whose
            # start was given up still in the workload's cgroup (issue 29).
            loop = asyncio.get_running_loop()
            deadline = loop.time() + GONE_WAIT_S
            while (cg.populated() if cg is not None else alive(tree)) and loop.time() < deadline:
                await asyncio.sleep(0.02)
            self.child.release()
        if self.km is not None:
            try:
                await self.km.cleanup_resources(restart=False)  # connection file, ipc sockets
            except Exception:
                pass
        self._remove_connection_file()
        self._remove_pidfile()

    def memory(self) -> int | None:
        try:
            import psutil

            return int(psutil.Process(self.pid).memory_info().rss)
        except Exception:
            return None


class CodeContext:
    def __init__(
        self,
        manager: Contexts,
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
        if self.pending_seed is not None and not silent:
            await self._settle_seed()  # a restore happened while this context was busy
        kernel = self.kernel
        if kernel is None or not kernel.alive:
            reason = kernel.died.result() if kernel is not None and kernel.died.done() else "not started"
            raise GuestdError(
                ErrorCode.UNAVAILABLE,
                f"context {self.id} has no live kernel ({reason}); restart it",
                details={"context": self.id, "exit_reason": reason},
            )
        t0 = time.monotonic()
        streamed = bool(opts["stream"])
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
        st.msg_id = kernel.kc.execute(
            code, silent=silent, store_history=not silent, allow_stdin=lines is not None, stop_on_error=True
        )
        kernel.current = st  # replies cannot arrive before we are back in the event loop
        usage = [kernel.child.usage_now() if kernel.child is not None else None]  # before, after
        status: CodeRunStatus = "ok"
        timeout_action: CodeRunTimeoutAction | None = None
        exit_reason = None
        try:
            try:
                outcome = await self._wait_done(st, kernel, opts["timeout_s"])
            except asyncio.CancelledError:
                kernel.interrupt()  # nobody waits for this cell any more: stop it, like a cancelled exec
                st.stream = None
                self._abandoned = (st, kernel, opts["interrupt_grace_s"])
                raise
            if outcome == "died":
                status, exit_reason = "died", kernel.died.result()
            elif outcome == "timeout":
                status = "timeout"
                kernel.interrupt()
                grace = await self._wait_done(st, kernel, opts["interrupt_grace_s"])
                if grace == "done":
                    timeout_action = "interrupted"
                else:
                    timeout_action = "restarted"
                    usage.append(kernel.child.usage_now() if kernel.child is not None else None)
                    await self.restart()
            else:
                status = st.finish(interrupted=self._interrupted, foreign=self.spec is not None)
        finally:
            if self._abandoned is None:
                kernel.current = None
            self._interrupted = False
        if st.execution_count is not None:
            self.execution_count = st.execution_count
        if len(usage) == 1:
            usage.append(kernel.child.usage_now() if kernel.child is not None else None)
        why: KilledBy | None = "timeout" if status == "timeout" else None
        if status == "died" and kernel.child is not None:
            why = kernel.child.exit_info()["killed_by"]
        reply: CodeRunReply = {
            "context": self.id,
            "status": status,
            "timeout_action": timeout_action,
            "exit_reason": exit_reason,
            **capture_fields(st.stdout, st.stderr, streamed=streamed),
            "results": [] if streamed else st.results,
            "results_dropped": st.results_dropped,
            "error": st.error,
            "stdin_exhausted": st.stdin_exhausted,
            "execution_count": st.execution_count,
            "duration_s": time.monotonic() - t0,
            **usage_between(usage[0], usage[1], why, None),  # type: ignore[typeddict-item]  # "run_id": guestd.runs adds it
        }
        return fit_reply(reply, st)

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
        k = Kernel(self.manager.services, self.manager.new_kernel_id(), self.spec, self.manager.epoch)
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


class Contexts:
    """All code contexts of the daemon, plus the warm kernel pool."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.contexts: dict[str, CodeContext] = {}
        self.pool: list[Kernel] = []
        self._refill: asyncio.Task[None] | None = None
        self._counter = 0
        self.epoch = 0  # restores seen; a kernel spawned before the last one needs its seed
        self._restore_key = b""  # the last restore's, for kernels that come up after it

    def new_kernel_id(self) -> str:
        self._counter += 1
        return f"k{os.getpid()}-{self._counter}-{os.urandom(3).hex()}"

    def find(self, ref: str) -> CodeContext:
        c = self.contexts.get(ref)
        if c is None:
            for ctx in self.contexts.values():
                if ctx.name == ref:
                    return ctx
            raise GuestdError(ErrorCode.NOT_FOUND, f"no code context {ref!r}", details={"context": ref})
        return c

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
        if name is not None:
            for ctx in self.contexts.values():
                if ctx.name == name:
                    return ctx, False, True
        limits = self.services.config.limits
        if len(self.contexts) >= limits.max_contexts:
            raise limit_error("max_contexts", limits.max_contexts, f"at most {limits.max_contexts} code contexts")
        if cwd is not None and not os.path.isdir(cwd):
            raise GuestdError(
                ErrorCode.NOT_FOUND, f"cwd is not a directory: {cwd}", details={"stage": "cwd", "cwd": cwd}
            )
        spec = None
        if kernel is not None and kernel != PYTHON_KERNEL:
            spec = await self.services.run_in_io(find_kernelspec, kernel)
        cid = "c" + os.urandom(6).hex()
        ctx = CodeContext(self, cid, name, cwd, env, spec, StartWait(start_timeout_s))
        self.contexts[cid] = ctx  # reserved now so concurrent creates count against the limit
        try:
            pooled = self._take_pooled() if spec is None else None  # the pool holds guestd's kernels only
            was_pooled = await ctx.start_kernel(pooled)
        except BaseException:
            self.contexts.pop(cid, None)  # first: no one finds the context while its kernel ends
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
        ctx = self.find(ref)
        self.contexts.pop(ctx.id, None)
        await ctx.close()

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
            k = Kernel(self.services, self.new_kernel_id(), epoch=self.epoch)
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
        return {"busy_contexts": [c.id for c in self.contexts.values() if c.busy]}

    async def reseed(self, entropy: bytes) -> dict[str, list[str]]:
        """After a restore: fresh random state in every kernel, contexts and pool, all at once
        through their side channels (guestd.code.reseed), none waiting on another."""
        self.epoch += 1
        self._restore_key = derive(entropy, "code-kernels")
        contexts = list(self.contexts.values())
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
        kernels = [c.kernel for c in self.contexts.values() if c.kernel is not None] + self.pool
        self.contexts.clear()
        self.pool = []
        await asyncio.gather(*(k.shutdown() for k in kernels), return_exceptions=True)


def _owner_alive(name: str) -> bool:
    """Kernel ids are ``k<guestd pid>-...``: is the guestd that made this file still running?"""
    m = re.match(r"k(\d+)-", name)
    if not m:
        return False
    owner = int(m.group(1))
    return owner == os.getpid() or guestd_running(owner)


async def hand_over_connection(
    channel: socket.socket, pid: int, info: Mapping[str, Any], ids: tuple[int, int] | None
) -> None:
    """Give a starting kernel its connection info and key once it asks. By then it has made
    itself non-dumpable; that is checked (its /proc files belong to root although it runs as
    the workload user) and that no process traces it (one that attached before would read
    the key from its memory). Otherwise the kernel does not get the key and fails to start."""
    loop = asyncio.get_running_loop()
    channel.setblocking(False)

    def refused(why: str) -> GuestdError:
        return GuestdError(ErrorCode.UNAVAILABLE, f"kernel failed to start: {why}", details={"stage": "start"})

    try:
        asked = await loop.sock_recv(channel, 16)  # bounded by the start's wait (guestd.code.start)
    except OSError as exc:
        raise refused(f"it never asked for its key ({exc!r})") from None
    if asked != b"ready\n":
        raise refused("it ended before asking for its key")
    # A non-dumpable process's /proc files (not its /proc/<pid> directory) belong to root.
    if ids is not None and os.stat(f"/proc/{pid}/environ").st_uid != 0:
        raise refused("it is still dumpable: its key is not handed over")
    if _traced_by(pid):
        raise refused("a process traces it: its key is not handed over")
    plain = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in info.items()}
    await loop.sock_sendall(channel, json.dumps(plain).encode())


def _traced_by(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return 0


def reap_orphan_kernels(kernel_dir: str) -> int:
    """Kill kernels whose guestd is gone (it crashed; their pid files survived it). Returns how many.

    Files of a guestd that is still running (another instance sharing the directory)
    are left alone.
    """
    killed = 0
    try:
        names = os.listdir(kernel_dir)
    except OSError:
        return 0
    for n in names:
        if _owner_alive(n):
            continue
        path = os.path.join(kernel_dir, n)
        if n.endswith(".pid"):
            try:
                with open(path) as f:
                    words = f.read().split()
                pid, ctime = int(words[0]), float(words[1])
                foreign = words[2:3] == ["foreign"]  # its command line is its kernelspec's
                import psutil

                p = psutil.Process(pid)
                command = " ".join(p.cmdline())
                ours = "guestd.code.kernel" in command or PRIVATE_NAME in command  # own or workload Python
                if abs(p.create_time() - ctime) < 0.01 and (foreign or ours):
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        p.kill()
                    killed += 1
            except Exception:
                pass
        try:
            os.unlink(path)
        except OSError:
            pass
    return killed
