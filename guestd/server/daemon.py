"""The daemon object: configuration, dispatcher, connections, lifecycle, and ``main``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from guestd import __version__
from guestd.memtune import tune_malloc
from guestd.server.config import DEFAULT_VSOCK_PORT, Config, load_config_file
from guestd.server.connection import Connection
from guestd.server.dispatch import Dispatcher
from guestd.server.transports import Listener, listen, parse_listen
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from guestd.contexts import Contexts
    from guestd.processes import ProcessTable
    from guestd.shells import Shells

log = logging.getLogger("guestd")

# Variables the launcher set for guestd's own interpreter (e.g. LD_LIBRARY_PATH of a baked
# image's private Python). They are taken out of the environment the workload inherits and
# handed only to processes that run guestd's Python (kernels).
PRIVATE_ENV: dict[str, str] = {}


def take_private_env() -> None:
    for name in os.environ.pop("GUESTD_PRIVATE_ENV", "").split(","):
        if name and name in os.environ:
            PRIVATE_ENV[name] = os.environ.pop(name)


def read_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.started_mono = time.monotonic()
        self.boot_id = read_boot_id()
        self.connections: set[Connection] = set()
        self._io: ThreadPoolExecutor | None = None  # made on first file op
        self.token: str | None = None
        self.dispatcher = Dispatcher()
        self.listeners: list[Listener] = []
        self._stopping: asyncio.Event | None = None
        self._sweeper: asyncio.Task[None] | None = None

        self._contexts: Contexts | None = None
        self._processes: ProcessTable | None = None
        self._shells: Shells | None = None
        from guestd.snapshot import SnapshotState

        self.snapshot = SnapshotState(self)
        from guestd.children import Children
        from guestd.children.cgroups import WorkloadCgroup

        self.workload = WorkloadCgroup(config.workload)
        self.children = Children(self.workload, config.policy.workload_ids)
        self._kernel_dir: str | None = None

        from guestd.ops import code, files, process, shell, system
        from guestd.ops import exec as exec_ops
        from guestd.ops import snapshot as snapshot_ops

        system.register(self)
        exec_ops.register(self)
        files.register(self)
        process.register(self)
        shell.register(self)
        code.register(self)
        snapshot_ops.register(self)

    # -- connections ------------------------------------------------------------------
    def connection_opened(self, conn: Connection) -> bool:
        if len(self.connections) >= self.config.limits.max_connections:
            # Peers that never said hello must not lock the host out: the oldest of them
            # makes room. Only when every slot has a handshaken peer is the newcomer refused.
            silent = [c for c in self.connections if c.awaiting_hello]
            if not silent:
                return False
            oldest = min(silent, key=lambda c: c.opened_at)
            self.connections.discard(oldest)
            oldest.refuse(
                GuestdError(
                    ErrorCode.LIMIT,
                    "connection slots are full; the oldest connection without a hello was closed",
                    details={"limit": "max_connections"},
                )
            )
        self.connections.add(conn)
        return True

    def connection_closed(self, conn: Connection) -> None:
        self.connections.discard(conn)

    def drop_connections(self, keep: Connection | None) -> int:
        """Close every connection but ``keep`` (after a restore: they are from before the snapshot)."""
        dropped = 0
        for c in list(self.connections):
            if c is not keep:
                c.close()
                dropped += 1
        return dropped

    def check_token(self, token: Any) -> str | None:
        """None when the peer may proceed, else the reason it may not."""
        if self.token is None:
            return None
        import hmac  # only when a token is configured: it pulls in OpenSSL's hashlib

        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
            return "missing or wrong access token"
        return None

    def hello_body(self, conn: Connection) -> dict[str, Any]:
        return {
            "version": conn.version,
            "server": f"guestd/{__version__}",
            "capabilities": self.dispatcher.capabilities(),
            "ops": self.dispatcher.ops(),
            "limits": self.config.limits.as_dict(),
            "stream_window": conn.stream_window,
            "max_frame": conn.peer_max_frame,
            "boot_id": self.boot_id,
            "session": conn.session_id,
        }

    async def run_in_io(self, fn: Any, *args: Any) -> Any:
        """Run blocking file-system work off the event loop, so a slow disk never stalls ping."""
        if self._io is None:
            from concurrent.futures import ThreadPoolExecutor

            self._io = ThreadPoolExecutor(max_workers=self.config.io_threads, thread_name_prefix="guestd-io")
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    # -- background processes -----------------------------------------------------------
    def has_processes(self) -> bool:
        return self._processes is not None

    def processes(self) -> ProcessTable:
        if self._processes is None:
            from guestd.processes import ProcessTable

            self._processes = ProcessTable(self)
        return self._processes

    def has_shells(self) -> bool:
        return self._shells is not None

    def shells(self) -> Shells:
        if self._shells is None:
            from guestd.shells import Shells

            self._shells = Shells(self)
        return self._shells

    # -- code contexts ------------------------------------------------------------------
    def has_contexts(self) -> bool:
        return self._contexts is not None

    def contexts(self) -> Contexts:
        """The code-context manager; created (and jupyter_client imported) on first use."""
        if self._contexts is None:
            from guestd.contexts import Contexts

            self._contexts = Contexts(self)
            self._contexts.ensure_pool()
        return self._contexts

    def runtime_dir(self) -> str:
        if not self.config.runtime_dir:
            base = "/run/guestd" if os.geteuid() == 0 and os.path.isdir("/run") else None
            if base is None:
                import tempfile

                base = os.path.join(tempfile.gettempdir(), f"guestd-{os.geteuid()}")
            self.config.runtime_dir = base
        os.makedirs(self.config.runtime_dir, mode=0o700, exist_ok=True)
        return self.config.runtime_dir

    def kernel_dir(self) -> str:
        """Private (0700) home of kernel connection files and ipc sockets."""
        if self._kernel_dir is None:
            d = os.path.join(self.runtime_dir(), "kernels")
            os.makedirs(d, mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)
            self._kernel_dir = d
        return self._kernel_dir

    async def acquire_in_io(self, fn: Any, release: Any, *args: Any) -> Any:
        """Like run_in_io for calls that create a resource (an fd, a temp file).

        Cancelling the awaiting task cannot stop the thread, so if we are cancelled
        while it runs, ``release`` is applied to whatever it produces afterwards.
        """
        fut = asyncio.ensure_future(self.run_in_io(fn, *args))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:

            def cleanup(done: asyncio.Future[Any]) -> None:
                if not done.cancelled() and done.exception() is None:
                    release(done.result())

            fut.add_done_callback(cleanup)
            raise

    # -- lifecycle --------------------------------------------------------------------
    async def serve(self, ready_fd: int | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        for addr in self.config.listen:
            listener = await listen(self, parse_listen(addr))
            self.listeners.append(listener)
            log.info("listening on %s", listener.address)
        if os.geteuid() == 0:
            self.workload.setup()
        if os.listdir(self.kernel_dir()):  # a previous guestd may have crashed and left kernels
            from guestd.contexts import reap_orphan_kernels

            orphans = reap_orphan_kernels(self.kernel_dir())
            if orphans:
                log.warning("killed %d kernel(s) left by a previous guestd", orphans)
        if self.config.code_prewarm and self.config.code_pool > 0:
            self.contexts()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        loop.add_signal_handler(signal.SIGPIPE, lambda: None)
        self.children.reaper.enable()
        # uvloop owns SIGCHLD, so orphans are swept on a timer and after every exit; emptied
        # leaf cgroups of finished runs are removed on the same tick.
        self._sweeper = loop.create_task(self.children.run_periodic())
        if ready_fd is not None:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)
        await self._stopping.wait()
        await self.shutdown()

    def stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def shutdown(self) -> None:
        log.info("shutting down")
        for listener in self.listeners:
            listener.close()
        requests = [ctx for c in self.connections for ctx in c.requests.values() if ctx.task is not None]
        tasks = [ctx.task for ctx in requests if ctx.task is not None]
        for ctx in requests:
            ctx.cancel("shutdown")
        if tasks:
            # Exec handlers kill their process trees on cancel; give them their grace.
            await asyncio.wait(tasks, timeout=5.0)
        for c in list(self.connections):
            c.close()
        await self.children.shutdown()  # every run, and what finished runs left behind
        if self._contexts is not None:
            await self._contexts.shutdown()
        if self._processes is not None:
            await self._processes.shutdown()
        if self._shells is not None:
            await self._shells.shutdown()
        if self._io is not None:
            self._io.shutdown(wait=False, cancel_futures=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="guestd", description="guestd: the in-guest sandbox agent")
    p.add_argument("--config", default=None, metavar="FILE", help="TOML config file; flags override it")
    p.add_argument(
        "--listen",
        action="append",
        default=[],
        metavar="ADDR",
        help=f"unix:PATH, vsock:PORT (default port {DEFAULT_VSOCK_PORT}) or serial:DEVICE; repeatable",
    )
    p.add_argument(
        "--allow-cid",
        action="append",
        type=int,
        default=[],
        metavar="CID",
        help="vsock peer CID allowed to connect (repeatable; default: 2, the host)",
    )
    p.add_argument("--max-frame", type=int, default=None, help="max frame payload bytes")
    p.add_argument("--max-inflight", type=int, default=None, help="max requests in flight per connection")
    p.add_argument("--max-connections", type=int, default=None)
    p.add_argument("--token-file", default=None, help="file holding an access token clients must present")
    p.add_argument("--runtime-dir", default="", help="private state directory (default /run/guestd as root)")
    p.add_argument("--code-pool", type=int, default=None, help="pre-started kernels kept ready (default 1; 0 disables)")
    p.add_argument("--code-prewarm", action="store_true", help="fill the kernel pool at start-up, not on first use")
    p.add_argument("--max-contexts", type=int, default=None)
    p.add_argument("--max-processes", type=int, default=None, help="live background processes")
    p.add_argument("--max-kept-processes", type=int, default=None, help="kept background processes, finished included")
    p.add_argument("--process-retention", type=float, default=None, help="seconds a finished process stays attachable")
    p.add_argument("--max-shells", type=int, default=None)
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")
    p.add_argument(
        "--simulate-privileged",
        action="store_true",
        help="record CRNG/clock/hostname/machine-id changes instead of making them (tests on a host)",
    )
    p.add_argument("--ready-fd", type=int, default=None, help="write 'ready' to this fd once listening")
    p.add_argument("--workspace", default=None, help="working directory (created if missing)")
    p.add_argument("--log-level", default=None)
    p.add_argument("--version", action="version", version=f"guestd {__version__}")
    return p


def config_from_args(ns: argparse.Namespace) -> Config:
    cfg = Config()
    if ns.config:
        load_config_file(ns.config, cfg)
    limits = cfg.limits
    for name in (
        "max_frame",
        "max_inflight",
        "max_connections",
        "max_contexts",
        "max_processes",
        "max_kept_processes",
        "max_shells",
    ):
        if getattr(ns, name) is not None:
            setattr(limits, name, getattr(ns, name))
    if ns.listen:
        cfg.listen = ns.listen
    if not cfg.listen:
        cfg.listen = [f"vsock:{DEFAULT_VSOCK_PORT}"]
    if ns.allow_cid:
        cfg.allowed_cids = set(ns.allow_cid)
    if ns.no_uvloop:
        cfg.use_uvloop = False
    if ns.runtime_dir:
        cfg.runtime_dir = ns.runtime_dir
    if ns.code_pool is not None:
        cfg.code_pool = ns.code_pool
    if ns.code_prewarm:
        cfg.code_prewarm = True
    if ns.process_retention is not None:
        cfg.process_retention_s = ns.process_retention
    if ns.token_file:
        cfg.token_file = ns.token_file
    if ns.workspace:
        cfg.workspace = ns.workspace
    if ns.log_level:
        cfg.log_level = ns.log_level
    if ns.simulate_privileged:
        cfg.simulate_privileged = True
    return cfg


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    take_private_env()
    try:
        cfg = config_from_args(ns)
        for addr in cfg.listen:
            parse_listen(addr)
    except ValueError as exc:
        print(f"guestd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, str(cfg.log_level).upper(), logging.INFO),
        format="%(asctime)s guestd[%(process)d] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if cfg.workspace:
        created = not os.path.isdir(cfg.workspace)
        os.makedirs(cfg.workspace, exist_ok=True)
        try:
            ids = cfg.policy.workload_ids()
        except Exception as exc:
            print(f"guestd: {exc}", file=sys.stderr)
            return 2
        if created and ids is not None:
            os.chown(cfg.workspace, *ids)  # the workload user must be able to work in its workspace
        os.chdir(cfg.workspace)  # the default cwd of everything the workload runs
    from guestd.children import raise_fd_limit

    raise_fd_limit()  # two pipes per run and a socket per connection; children get the old limit back
    tune_malloc()  # bulk transfers reuse warm heap instead of page-faulting fresh mmaps
    daemon = Daemon(cfg)
    if cfg.token_file:
        with open(cfg.token_file) as f:
            daemon.token = f.read().strip()
    if cfg.use_uvloop:
        import uvloop

        runner: Any = uvloop.run
    else:
        runner = asyncio.run
    try:
        runner(daemon.serve(ns.ready_fd))
    except OSError as exc:
        log.error("cannot serve: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
