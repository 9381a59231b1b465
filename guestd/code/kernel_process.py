"""One kernel process and guestd's channels to it: the spawn of guestd's own Python kernel or
a kernelspec's, its environment, the hand-over of its connection (key) once it is
non-dumpable, its death and shutdown (its pid file, for the guestd after a crash:
guestd.code.pidfiles).

jupyter_client (and zmq, tornado, traitlets) is imported on first use only, so a
guestd that never runs code does not pay for it in memory or start-up time.

Trust (SECURITY.md, "code contexts"): a new, restarted or pooled kernel starts from guestd's
state, not the workload's: an IPython directory only guestd writes, no user site-packages,
and no key on disk at any time (the kernel gets it over a socketpair once it is
non-dumpable). A foreign kernel reads its key from a file (SECURITY.md, "foreign kernels").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from guestd.children.tree import alive, descendants
from guestd.code.kernel import NO_IPYKERNEL
from guestd.code.kernelspec import ForeignSpec, foreign_command, import_jupyter_client
from guestd.code.messages import RunState, decode, kernel_content_cap, kernel_max_message
from guestd.code.pidfiles import remove_pidfile, write_pidfile
from guestd.code.python import KernelPython, missing_ipykernel
from guestd.code.python import resolve as resolve_python
from guestd.code.reseed import ReseedChannel, handover_channel
from guestd.code.start import StartWait, kernel_pids, within, work_done
from guestd.services import to_the_end
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.children import Child
    from guestd.children.cgroups import RunUsage
    from guestd.services import Services

log = logging.getLogger("guestd.code")

GONE_WAIT_S = 5.0  # a SIGKILLed kernel's processes are gone within milliseconds; bounded anyway
EXIT_STATUS_WAIT_S = 2.0  # a start that failed: how long its exit status may take to be known
# A kernel's cells can forge messages without end (they hold its key): guestd's log is not
# theirs to fill, so it tells of a kernel's first few unusable messages only.
MAX_LOGGED_DROPS = 10
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
        self.drops = 0  # messages that could not be used (forged, most likely)

    async def start(self, cwd: str | None, env: dict[str, str] | None, wait: StartWait) -> None:
        """Start the kernel and wait (``wait``) until it answers. A start that fails or is
        cancelled leaves the kernel to the caller, who ends it with :meth:`shutdown`."""
        await self.services.run_in_io(import_jupyter_client)  # off the loop, never two at once
        from jupyter_client.manager import AsyncKernelManager

        # jupyter_client makes the client and cleans up; the process itself is a run of
        # guestd.children (its own cgroup, the workload user), like any other.
        km = AsyncKernelManager(kernel_name="guestd-python" if self.spec is None else self.spec.name)
        kenv = self._environment(env)
        self.km = km
        ids = self.services.config.policy.workload_ids()
        kdir = self._files_dir(ids, kenv)
        km.transport = "ipc"  # Unix sockets in a 0700 directory: no ports, no network
        km.ip = os.path.join(kdir, self.kid)
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
        await self._wait_up(km, channel, ids, wait)
        self._read_channels()

    def _environment(self, env: dict[str, str] | None) -> dict[str, str]:
        """The kernel's environment: guestd's, the context's (and a kernelspec's) and what the
        launcher needs; for guestd's own kernel, resolves the Python it runs on (self.python)."""
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
        # A fresh kernel starts from guestd's IPython directory, not the workload's (the workload
        # user cannot write it: no startup files, no profile config). guestd's own Python also
        # gets no user site-packages (usercustomize); the workload's Python gets its packages,
        # user site included: that is what it is for. See SECURITY.md, "code contexts".
        kenv["IPYTHONDIR"] = _ipython_dir(self.services.runtime_dir())
        if self.python is None or self.python.own:
            kenv["PYTHONNOUSERSITE"] = "1"
        return kenv

    def _files_dir(self, ids: tuple[int, int] | None, kenv: dict[str, str]) -> str:
        """The directory of the kernel's sockets (and a foreign kernel's connection file); with a
        workload user, one of that user's own, which is also the kernel's HOME unless it runs
        the workload's Python (then the user's home)."""
        kdir = self.services.kernel_dir()
        if ids is None:
            return kdir
        # The kernel runs as the workload user: it must read its connection file and bind its
        # ipc sockets, so its files live in a directory of its own, owned by that user.
        # Parents must be traversable (not listable) by that user: 0711.
        os.chmod(self.services.runtime_dir(), 0o711)
        os.chmod(kdir, 0o711)
        kdir = os.path.join(kdir, f"u{ids[0]}")
        os.makedirs(kdir, mode=0o700, exist_ok=True)
        os.chown(kdir, *ids)
        kenv["HOME"] = kdir  # guestd's HOME is not the workload user's to write
        if self.python is not None and not self.python.own:
            # The workload's Python: its user site-packages (pip install --user) are the
            # workload user's, under that user's home, as in the workload's own shells.
            kenv["HOME"] = _home_of(ids[0]) or kdir
        return kdir

    async def _wait_up(
        self, km: Any, channel: socket.socket | None, ids: tuple[int, int] | None, wait: StartWait
    ) -> None:
        """From spawned to answering, within ``wait``; the channel the key went over (guestd's
        own kernel) is kept for the seeds of restores."""
        assert self.child is not None
        # Watched and recorded from the spawn on: a kernel that dies, or whose start is given up,
        # is reaped (and a crashed guestd's successor finds its pid file) however far it came.
        self.child.watch(self._on_exit, 0.2)
        write_pidfile(self.services.kernel_dir(), self.kid, self.pid, foreign=self.spec is not None)
        child = self.child
        cgroup_pids = child.cgroup.pids if child.cgroup is not None else None
        came_up = False
        try:
            await within(
                wait, self._come_up(km, channel, ids), self.died, lambda: work_done(kernel_pids(child.pid, cgroup_pids))
            )
            came_up = True
        except GuestdError:
            lacking = await self._lacking_ipykernel(child)
            if lacking is not None:
                raise lacking from None
            raise
        finally:
            if channel is not None and not came_up:
                channel.close()
            self._remove_connection_file()  # a foreign kernel has read it by now (or failed)
        if channel is not None:
            self.reseeder = ReseedChannel(channel)  # the key went over it; now the seeds of restores

    async def _lacking_ipykernel(self, child: Child) -> GuestdError | None:
        """The error to report when a failed start was the launcher's Python lacking ipykernel."""
        if self.python is None:
            return None
        if child.status is None:
            # The launcher's end is seen (its channel closed) before it has exited and its exit
            # watch, which polls, has reaped it: the status says whether it lacked ipykernel.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(child.exited), EXIT_STATUS_WAIT_S)
        status = child.status
        if status is not None and os.waitstatus_to_exitcode(status) == NO_IPYKERNEL:
            return missing_ipykernel(self.python)
        return None

    def _read_channels(self) -> None:
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
                self._dropped(f"undecodable {channel} message dropped")
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
                self._dropped(f"handling a {channel} message failed", exc_info=True)

    def _dropped(self, what: str, *, exc_info: bool = False) -> None:
        """Log a message guestd could not use, the first MAX_LOGGED_DROPS of this kernel only."""
        self.drops += 1
        if self.drops <= MAX_LOGGED_DROPS:
            last = " (this kernel's later ones are not logged)" if self.drops == MAX_LOGGED_DROPS else ""
            log.warning("kernel %s: %s%s", self.kid, what, last, exc_info=exc_info)

    def _on_exit(self) -> None:
        assert self.child is not None
        # What the kernel started (``setsid -f``, ``cmd &``) dies with it: a dead context can only
        # be restarted or closed, and nothing else owns those processes (they ran on, in the dead
        # context's run, until then).
        self.child.kill_now()
        if not self.died.done():
            self.died.set_result(_exit_reason(self.child.status))
        remove_pidfile(self.services.kernel_dir(), self.kid)

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
            # start was given up still in the workload's cgroup (containment of kernel starts).
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
        remove_pidfile(self.services.kernel_dir(), self.kid)

    def usage_now(self) -> RunUsage | None:
        """The counters of the kernel's run (its cgroup leaf) now: a cell's share is a difference."""
        return self.child.usage_now() if self.child is not None else None

    def memory(self) -> int | None:
        try:
            import psutil

            return int(psutil.Process(self.pid).memory_info().rss)
        except Exception:
            return None


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
