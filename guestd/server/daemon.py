"""The daemon object: configuration, dispatcher, admission, connections, lifecycle, and ``main``.

It names no capability: what guestd serves is composed at the package root
(``guestd/capabilities.py``), which declares the capabilities, registers the ones needed at
start and hooks them into the admission chain.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

from guestd import __version__
from guestd.config import DEFAULT_VSOCK_PORT, Config, Limits, load_config_file, take_private_env
from guestd.server.admission import AdmissionChain, Admitted, bound_bulk_replies, os_paths
from guestd.server.dispatch import Dispatcher
from guestd.server.options import parse_command_line
from guestd.server.pacing import StartPacer
from guestd.server.transports import Listener, listen, parse_listen, refuse_live_unix_socket
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.server.host import HostedConnection
    from guestd.services import Services
    from guestd.wire.schema import OpSpec

log = logging.getLogger("guestd")
SETTLE_AFTER_S = 1.0  # after-first-reply work runs this long after listening when nobody asks first

Register = Callable[["Services"], None]  # a capability's register(services)


def read_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


class Daemon:
    """Transports, connections, lifecycle; the capabilities get a narrow Services of it, the
    connections a ConnectionHost (guestd/server/host.py)."""

    def __init__(self, config: Config, compose: Callable[[Daemon], None] | None = None) -> None:
        """``compose`` declares and registers the capabilities (default: guestd.capabilities.compose)."""
        self.config = config
        self.started_mono = time.monotonic()
        self.boot_id = read_boot_id()
        self.connections: set[HostedConnection] = set()
        self.token: str | None = None
        self.dispatcher = Dispatcher()
        self.listeners: list[Listener] = []
        self._stopping: asyncio.Event | None = None
        self._sweeper: asyncio.Task[None] | None = None
        # Policy first: a refused op registers no capability and starts nothing.
        self.admission = AdmissionChain(self.dispatcher)
        self.admission.add("policy", check=config.policy.check_op, before_route=True)
        self.admission.add("first_request", check=self._first_request, before_route=True)
        # Workload ops start a few per loop iteration, so a flood of them never holds a ping
        # back; first after the route, so the capabilities' gates are checked at the turn.
        self.pacer = StartPacer(self.dispatcher.routes)
        self.admission.add("pace", check=self.pacer.check)
        # ConnectionHost.admit, with no call between
        self.admit: Callable[[str, Hashable], Admitted] = self.admission.admit

        from guestd.children import Children
        from guestd.children.cgroups import WorkloadCgroup
        from guestd.services import Services

        self.workload = WorkloadCgroup(config.workload)
        self.children = Children(self.workload, config.policy.workload_ids)
        self.services = Services(config, self.children, self.workload, self.dispatcher, self)

        self.services.require = self.require
        self._unregistered: dict[str, Register] = {}
        self.before_start: list[Callable[[], None]] = []  # at serve(), before the capabilities' on_start
        self._listening = False
        self._settled = False
        if compose is None:
            from guestd.capabilities import compose as compose_guestd  # the composition root

            compose = compose_guestd
        compose(self)
        # The server's own steps come last, innermost: a reply held whole is built a few at a
        # time per connection (its route's bulk_reply), and path arguments reach handlers as os strs.
        self.admission.add("bulk_reply", wrap=bound_bulk_replies)
        self.admission.add("paths", wrap=os_paths)

    # -- capabilities ---------------------------------------------------------------------
    def declare(self, capability: str, register: Register) -> None:
        """Serve ``capability``'s ops from now on; ``register`` registers them at its first
        request (or when another capability needs it)."""
        self._unregistered[capability] = register
        self.dispatcher.declare(capability, functools.partial(self.require, capability))

    def load_before(self, op: str, load: Callable[[], None]) -> None:
        """Run ``load`` before ``op`` is served the first time (after its own capability's)."""
        self.dispatcher.load_before(op, load)

    def require(self, capability: str) -> None:
        """Register a declared capability (on its first request, or when another one needs it)."""
        register = self._unregistered.pop(capability, None)
        if register is None:
            return
        hooks = len(self.services.on_start)
        try:
            register(self.services)
        except BaseException:
            self._unregistered[capability] = register  # tried again at the next request
            raise
        if self._listening:  # start-up hooks of a capability registered after start-up
            for start in self.services.on_start[hooks:]:
                start()

    def require_all(self) -> None:
        for capability in list(self._unregistered):
            self.require(capability)

    # -- connections (ConnectionHost) ---------------------------------------------------------
    @property
    def limits(self) -> Limits:
        return self.config.limits

    @property
    def op_specs(self) -> Mapping[str, OpSpec]:
        return self.dispatcher.specs

    def connection_opened(self, conn: HostedConnection) -> bool:
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

    def connection_closed(self, conn: HostedConnection) -> None:
        self.connections.discard(conn)

    def connection_count(self) -> int:
        return len(self.connections)

    def drop_connections(self, keep: Any) -> int:
        """Close every connection but ``keep`` (after a restore: they are from before the snapshot)."""
        dropped = 0
        for c in list(self.connections):
            if c is not keep:
                c.close()
                dropped += 1
        return dropped

    def check_peer(self, sock: Any) -> str | None:
        return self.config.policy.peer_allowed(sock)

    def check_token(self, token: Any) -> str | None:
        """None when the peer may proceed, else the reason it may not."""
        if self.token is None:
            return None
        import hmac  # only when a token is configured: it pulls in OpenSSL's hashlib

        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
            return "missing or wrong access token"
        return None

    def hello_body(self, conn: HostedConnection) -> dict[str, Any]:
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

    def on_hello(self, hello: Mapping[str, Any]) -> None:
        self.admission.hello(hello)

    # -- lifecycle --------------------------------------------------------------------
    async def serve(self, ready_fd: int | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        # Before anything is set up: a path another live guestd serves is refused, not taken over.
        for addr in self.config.listen:
            address = parse_listen(addr)
            if address.scheme == "unix":
                refuse_live_unix_socket(address.path)
        # Before any listener: no run may start before the workload cgroup (and its leaves) is set.
        if os.geteuid() == 0:
            self.workload.setup()  # ends what a previous guestd's runs left
        for prepare in self.before_start:
            prepare()
        for start in self.services.on_start:
            start()
        for addr in self.config.listen:
            listener = await listen(parse_listen(addr), self, self.config.allowed_cids)
            self.listeners.append(listener)
            log.info("listening on %s", listener.address)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        loop.add_signal_handler(signal.SIGPIPE, lambda: None)
        self.children.reaper.enable()
        # uvloop owns SIGCHLD, so orphans are swept on a timer and after every exit; emptied
        # leaf cgroups of finished runs are removed on the same tick.
        self._sweeper = loop.create_task(self.children.run_periodic())
        lag = None
        if os.environ.get("GUESTD_LOOP_LAG"):  # the bench's loop-lag instrument (guestd/looplag.py)
            from guestd.looplag import start_from_env

            lag = start_from_env(loop)
        # What start-up made lives as long as guestd: full collections need not walk it again
        # (a gen-2 pause was 25-40 ms of CPU under an exec flood).
        gc.freeze()
        gc.enable()  # guestd/__main__.py turned collection off for the start-up
        self._listening = True
        loop.call_later(SETTLE_AFTER_S, self.settle)
        if ready_fd is not None:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)
        await self._stopping.wait()
        if lag is not None:
            lag.write()
        await self.shutdown()

    def _first_request(self, op: str) -> None:
        """An admission step until guestd settles: a request passed the policy, so the work a
        first reply must not wait for may start (soon: after this reply is written)."""
        if not self._settled:
            asyncio.get_running_loop().call_soon(self.settle)

    def settle(self) -> None:
        if self._settled:
            return
        self._settled = True
        self.admission.remove("first_request")  # its work is done: later requests skip it
        for work in self.services.after_first_reply:
            work()

    def stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def shutdown(self) -> None:
        log.info("shutting down")
        for listener in self.listeners:
            listener.close()
        tasks = [task for c in list(self.connections) for task in c.cancel_requests("shutdown")]
        if tasks:
            # Exec handlers kill their process trees on cancel; give them their grace.
            await asyncio.wait(tasks, timeout=5.0)
        for c in list(self.connections):
            c.close()
        await self.children.shutdown()  # every run, and what finished runs left behind
        for stop in self.services.on_shutdown:
            await stop()
        self.services.close_io()


def config_from_args(ns: Any) -> Config:
    """The Config the options of ``parse_command_line`` ask for."""
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
    if ns.in_guest:
        cfg.in_guest = True
    return cfg


def tune_memory() -> None:
    """Bulk transfers reuse warm heap instead of page-faulting fresh mmaps (guestd/memtune.py).
    Done after the first reply: no transfer comes before a first request."""
    from guestd.memtune import tune_malloc

    tune_malloc()


def main(argv: list[str] | None = None) -> int:
    ns = parse_command_line(sys.argv[1:] if argv is None else argv)
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
    daemon = Daemon(cfg)
    daemon.services.after_first_reply.append(tune_memory)
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
    stuck = daemon.services.io_threads_stuck(grace_s=2.0)
    if stuck:
        # Python's exit joins every worker thread; one stuck in the kernel would hold it forever.
        log.warning("exiting with %d file ops stuck in a file system that does not answer", stuck)
        logging.shutdown()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
