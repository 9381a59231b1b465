"""What a capability package may use: the narrow services object, and the shape of a request.

Each capability (``guestd.exec``, ``files``, ``processes``, ``shells``, ``code``, ``snapshot``,
``system``) keeps its engine and its handlers together and gets one ``Services`` in its
``register(services)``. It imports nothing above itself: not the daemon, not the server, not
another capability. What capabilities need of each other goes through hooks registered here
(a restore re-seeds shells and kernels; a snapshot lists busy work; shutdown ends managers).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from guestd.children import Children, ExitInfo
    from guestd.children.cgroups import RunCgroup, WorkloadCgroup
    from guestd.config import Config
    from guestd.output.capture import OutputRing
    from guestd.output.spill import Spill
    from guestd.output.stream import CreditedStream
    from guestd.wire.types import ChangeReportRecord, ReportedChangesFields


# What a capability sees of the server and of other capabilities: shapes for type checkers only,
# never built at run time (with the output stream's, ~0.35 ms of guestd's start). Capabilities
# import them from here under TYPE_CHECKING; the server's classes implement them.
if TYPE_CHECKING:

    class Request(CreditedStream, Protocol):
        """One request in flight, as a handler sees it (guestd.server.connection implements it).

        Its data events within the client's credit (``active``, ``data_room``, ``push_data``,
        ``wait_credit``, ``drain``, ``write_paused``) are :class:`CreditedStream`'s: a handler hands
        its request to the output pump (guestd.output.pump) or the port relay, which pace it; what
        a handler does with the request itself is below."""

        # -- events (small ones need no credit; data is split to the credit and max_frame) --
        async def send_event(self, body: dict[str, Any]) -> None: ...

        def post_event(self, body: dict[str, Any]) -> None: ...

        async def send_data_event(self, fields: Mapping[str, Any], data: bytes | bytearray) -> None: ...

        async def wait_room(self, fields: Mapping[str, Any], nbytes: int) -> None:
            """Until one data event may carry ``nbytes`` whole (a grep line, a watched path)."""
            ...

        @property
        def max_frame(self) -> int: ...

        # -- input, signals, the point of no return ------------------------------------------
        @property
        def input(self) -> asyncio.Queue[dict[str, Any]]: ...

        # Set, INPUT bodies go to it as they arrive (on the loop, in frame order) instead of ``input``.
        input_handler: Callable[[dict[str, Any]], None] | None

        def handle_signals(self, handler: Callable[[Any], None]) -> None: ...

        def stop_taking_data(self) -> None: ...

        def ack_input(self, nbytes: int) -> None: ...

        def commit(self) -> None: ...

        @property
        def connection(self) -> object:
            """The connection the request came on (opaque: a restore keeps it open)."""
            ...

    Handler = Callable[[Request, Any], Awaitable[Mapping[str, Any]]]

    InlineHandler = Callable[[Any], Mapping[str, Any]]

    class Registry(Protocol):
        """Where a capability registers its ops (guestd.server.dispatch.Dispatcher)."""

        def add(
            self,
            op: str,
            handler: Handler | None = None,
            *,
            inline: InlineHandler | None = None,
            bulk_reply: bool = False,
            control: bool = False,
        ) -> None: ...

        def capabilities(self) -> list[str]: ...

        def ops(self) -> list[str]: ...

    class Host(Protocol):
        """The little of the daemon that system.info and snapshot.restore report or change."""

        boot_id: str
        started_mono: float
        token: str | None

        def connection_count(self) -> int: ...

        def drop_connections(self, keep: Any) -> int: ...

    class ChangeFeed(Protocol):
        """Changes under the workspace (the files capability provides it; exec and shell.run use
        it for ``report_changes``): a cursor now, and the report of what changed since one."""

        async def begin(self) -> int: ...

        async def report(self, cursor: int) -> ChangeReportRecord: ...

    class AdoptedRun(Protocol):
        """A running command handed to the process table (``on_timeout: "detach"``): what the table
        needs of it. ``guestd.children.Child`` is one (exec); a shell job is another (guestd.shells)."""

        pid: int
        status: int | None
        stdin: int | None
        pty: int | None
        cgroup: RunCgroup | None

        @property
        def running(self) -> bool: ...

        def watch(self, on_exit: Callable[[], None] | None = None, poll_s: float = 0.05) -> None: ...

        def signal(self, sig: int) -> None: ...

        def close_fd(self, name: str) -> None: ...

        def release(self) -> None: ...

        def exit_info(self) -> ExitInfo: ...

    class Adopter(Protocol):
        """How exec and shells give a timed-out command to the process table (guestd.processes)."""

        def check(self) -> None:
            """Raise the typed ``limit`` error when no more live processes may be adopted."""
            ...

        def adopt(
            self,
            command: str,
            run: AdoptedRun,
            fds: dict[str, int],
            rings: dict[str, OutputRing],
            spills: dict[str, Spill] | None = None,
        ) -> str:
            """Own ``run`` from now on (its output fds, rings holding its output from byte 0, and
            with ``spills`` the files holding every byte: written and closed by the table now); its id."""
            ...

    class KeptRuns(Protocol):
        """Where ``keep: true`` runs go (guestd.runs' table, set by guestd.processes)."""

        async def keep(
            self, ctx: Request | None, op: str, target: str, what: str, run: Callable[[], Awaitable[Any]]
        ) -> Any:
            """Run ``run()`` as a kept run; its reply with ``run_id`` (the request may go away first)."""
            ...


R = TypeVar("R")
# A reply that may carry a change report (exec, shell.run: the schema's reported_changes group).
ReportsChanges = TypeVar("ReportsChanges", bound="ReportedChangesFields")
C = TypeVar("C", bound=Callable[..., Any])
P = TypeVar("P")


_OP_MARK = "_guestd_op"


def op(name: str, *, bulk_reply: bool = False, inline: bool = False, control: bool = False) -> Callable[[C], C]:
    """Mark a capability's method as the handler of the op ``name`` (``inline``: it answers
    at once, without a task; ``bulk_reply``: its reply is held whole, see the server's
    admission chain; ``control``: cheap and bounded whatever the workload does, so it starts
    at once instead of in its turn behind workload ops, guestd.server.pacing); :func:`add_ops`
    registers every marked method of a capability."""

    def mark(method: C) -> C:
        setattr(method, _OP_MARK, (name, bulk_reply, inline, control))
        return method

    return mark


def add_ops(registry: Registry, capability: object) -> None:
    """Register each method of ``capability`` marked with :func:`op`, in the order its class
    defines them, bound to ``capability``."""
    for attribute, member in vars(type(capability)).items():
        mark: tuple[str, bool, bool, bool] | None = getattr(member, _OP_MARK, None)
        if mark is None:
            continue
        name, bulk_reply, inline, control = mark
        bound = getattr(capability, attribute)
        if inline:
            registry.add(name, inline=bound)
        else:
            registry.add(name, bound, bulk_reply=bulk_reply, control=control)


class Writes:
    """File writes in flight: files count them, snapshot.prepare waits for them to settle."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def started(self) -> None:
        self.count += 1
        self.idle.clear()

    def finished(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.idle.set()

    async def landing(self, work: Awaitable[R]) -> R:
        """Await ``work`` (a write in an I/O thread), counted in flight until the work itself is
        done: when the request is cancelled its thread may still be writing, and
        snapshot.prepare must not call that settled."""
        self.started()
        return await run_on(work, lambda _: self.finished())


_running_on: set[asyncio.Future[Any]] = set()  # work whose awaiter may be gone, held until it ends


async def run_on(work: Awaitable[R], on_done: Callable[[asyncio.Future[R]], None]) -> R:
    """Await ``work`` in a task of its own, held until it ends: cancelling the awaiter raises
    CancelledError in it as usual, and ``work`` runs on to its end; ``on_done`` gets it then
    (its exception read, so a failure nobody awaits any more is never "never retrieved")."""
    task = asyncio.ensure_future(work)
    _running_on.add(task)

    def done(f: asyncio.Future[R]) -> None:
        _running_on.discard(f)
        if not f.cancelled():
            f.exception()
        on_done(f)

    task.add_done_callback(done)
    return await asyncio.shield(task)


async def to_the_end(teardown: Coroutine[Any, Any, R]) -> R:
    """Await ``teardown`` (a kill, the wait for the exit, the release of what the run held) so
    that it runs to its end even when the awaiting request is cancelled (:func:`run_on`).
    Written inline, the cancel would land in its wait for the exit and skip the release after
    it: the fds, the pidfd and the leaf of a process that was slow to die (asleep in the
    kernel, on a frozen or hung file system) stayed forever."""
    return await run_on(teardown, _log_failed_teardown)


def _log_failed_teardown(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        import logging

        logging.getLogger("guestd").warning("a teardown failed: %r", task.exception())


def derive(entropy: bytes, label: str, n: int = 32) -> bytes:
    """Per-consumer seed material: different for every context/session, all from the host's entropy."""
    import hashlib  # lazily, like everything here: idle guestd memory should not pay for OpenSSL

    return hashlib.blake2b(entropy, digest_size=n, person=b"guestd-restore", salt=label.encode()[:16]).digest()


# A restore hook gets the restore's entropy and returns what it did, as report fields.
RestoreHook = Callable[[bytes], Awaitable[dict[str, list[str]]]]
BusyReport = Callable[[], dict[str, list[str]]]
ShutdownHook = Callable[[], Awaitable[None]]


class Provided(Generic[P]):
    """A slot of :class:`Services` that one capability fills for others (``services.adopter =
    table``). Read while it is empty, it registers its provider first (``Services.require``)."""

    def __init__(self, provider: str) -> None:
        self.provider = provider  # the capability that sets it
        self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, services: Services, owner: type | None = None) -> P | None:
        if getattr(services, self.slot) is None:
            services.require(self.provider)
        value: P | None = getattr(services, self.slot)
        return value

    def __set__(self, services: Services, value: P | None) -> None:
        setattr(services, self.slot, value)


class Services:
    """What the daemon gives every capability. A plain class, not a dataclass: a dataclass
    compiles its generated methods at every start (~1-2 ms of CPU each here)."""

    # What one capability provides to others.
    changes: Provided[ChangeFeed] = Provided("files")  # the workspace's change feed
    adopter: Provided[Adopter] = Provided("process")  # where on_timeout "detach" hands runs
    runs: Provided[KeptRuns] = Provided("process")  # keep: true runs (guestd.runs, set by guestd.processes)

    def __init__(self, config: Config, children: Children, workload: WorkloadCgroup, ops: Registry, host: Host) -> None:
        self.config = config
        self.children = children
        self.workload = workload
        self.ops = ops
        self.host = host
        self.writes = Writes()
        self.on_restore: list[RestoreHook] = []
        self.busy: list[BusyReport] = []
        self.on_shutdown: list[ShutdownHook] = []
        self.on_start: list[Callable[[], None]] = []
        # Work a first reply must not wait for (the code kernel pool's pre-warming): run once
        # guestd has answered its first request, or soon after it listens when nobody asks.
        self.after_first_reply: list[Callable[[], None]] = []
        self.info: list[Callable[[], dict[str, Any]]] = []  # fields for system.info
        # Registers a capability the daemon declared but has not registered yet (no-op when it is).
        self.require: Callable[[str], None] = lambda capability: None
        self._changes: ChangeFeed | None = None
        self._adopter: Adopter | None = None
        self._runs: KeptRuns | None = None
        self._io: ThreadPoolExecutor | None = None
        self._kernel_dir: str | None = None

    async def changes_cursor(self, wanted: bool) -> int | None:
        """``report_changes``: the change journal's cursor before a run (None: not wanted)."""
        if not wanted:
            return None
        changes = self.changes
        if changes is None:
            from guestd.wire.errors import ErrorCode, GuestdError

            raise GuestdError(
                ErrorCode.UNAVAILABLE, "no change feed in this guestd", details={"field": "report_changes"}
            )
        return await changes.begin()

    async def with_changes(self, cursor: int | None, reply: ReportsChanges) -> ReportsChanges:
        """``reply`` with ``changes`` since ``cursor`` added (unchanged when cursor is None)."""
        changes = self._changes
        if cursor is not None and changes is not None:
            reply["changes"] = await changes.report(cursor)
        return reply

    def runtime_dir(self) -> str:
        """guestd's private state directory (made on first use)."""
        cfg = self.config
        if not cfg.runtime_dir:
            base = "/run/guestd" if os.geteuid() == 0 and os.path.isdir("/run") else None
            if base is None:
                import tempfile

                base = os.path.join(tempfile.gettempdir(), f"guestd-{os.geteuid()}")
            cfg.runtime_dir = base
        os.makedirs(cfg.runtime_dir, mode=0o700, exist_ok=True)
        return cfg.runtime_dir

    def kernel_dir(self) -> str:
        """Private (0700) home of kernel connection files and ipc sockets."""
        if self._kernel_dir is None:
            d = os.path.join(self.runtime_dir(), "kernels")
            os.makedirs(d, mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)
            self._kernel_dir = d
        return self._kernel_dir

    async def run_in_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking file-system work off the event loop, so a slow disk never stalls ping."""
        if self._io is None:
            from concurrent.futures import ThreadPoolExecutor

            self._io = ThreadPoolExecutor(max_workers=self.config.io_threads, thread_name_prefix="guestd-io")
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def acquire_in_io(self, fn: Callable[..., Any], release: Callable[[Any], None], *args: Any) -> Any:
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

    def close_io(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=False, cancel_futures=True)

    def io_threads_stuck(self, grace_s: float) -> int:
        """After close_io: wait up to ``grace_s`` for the I/O threads to finish; how many did not.
        A thread stuck in the kernel on a file system that stops answering (a hung FUSE or NFS
        server) cannot be interrupted, and Python's exit would wait for it forever."""
        if self._io is None:
            return 0
        end = time.monotonic() + grace_s
        threads = list(self._io._threads)
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        return sum(t.is_alive() for t in threads)
