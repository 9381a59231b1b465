"""A capability without a daemon: real :class:`~guestd.services.Services` over a recording op
registry and a fake host, and a fake request whose credit the test sets, so a capability's
handlers can be unit-tested in milliseconds beside the real-process tests::

    services = fake_services(tmp_path)
    files_handlers.register(services)
    reply = asyncio.run(call(services, "file.stat", {"path": str(tmp_path)}))

``call`` checks the args against the schema as the server does (defaults filled, bounds
checked, ``path`` arguments given to the handler as os strs). What the fake cannot give (the
child-process component, the workload cgroup) fails loudly when a handler reaches for it: such a
capability belongs to the real-process tests. Never imported by the daemon.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

from guestd.config import Config
from guestd.services import Services
from guestd.wire.paths import path_from_wire

if TYPE_CHECKING:  # shapes for type checkers only (guestd/services.py)
    from guestd.services import Handler, InlineHandler
from guestd.wire.schema import OPS_BY_NAME, validate_args

__all__ = ["FakeRequest", "FakeStream", "RecordingRegistry", "call", "fake_services"]


class RecordingRegistry:
    """The ops a capability registered (guestd.services.Registry), by name."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}
        self.inline: dict[str, InlineHandler] = {}
        self.bulk_reply: set[str] = set()
        self.control: set[str] = set()

    def add(
        self,
        op: str,
        handler: Handler | None = None,
        *,
        inline: InlineHandler | None = None,
        bulk_reply: bool = False,
        control: bool = False,
    ) -> None:
        if op not in OPS_BY_NAME:
            raise AssertionError(f"{op!r} is not an op of the schema")
        if op in self.handlers or op in self.inline:
            raise AssertionError(f"{op!r} registered twice")
        if handler is not None:
            self.handlers[op] = handler
        if inline is not None:
            self.inline[op] = inline
        if bulk_reply:
            self.bulk_reply.add(op)
        if control:
            self.control.add(op)

    def capabilities(self) -> list[str]:
        return sorted({OPS_BY_NAME[op].capability for op in self.ops()})

    def ops(self) -> list[str]:
        return sorted({*self.handlers, *self.inline})


class FakeHost:
    """The little of the daemon system.info and snapshot.restore read (guestd.services.Host)."""

    def __init__(self) -> None:
        self.boot_id = "fake-boot"
        self.started_mono = time.monotonic()
        self.token: str | None = None
        self.dropped = 0

    def connection_count(self) -> int:
        return 1

    def drop_connections(self, keep: Any) -> int:
        self.dropped += 1
        return 0


class _Unavailable:
    """A component the fake does not have: any use of it says which and why."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> NoReturn:
        raise AssertionError(
            f"fake services have no {self._name} ({self._name}.{attribute} was used): "
            "test this capability against a real guestd (guestd.testing.start_guestd)"
        )


def fake_services(runtime_dir: str | Path, config: Config | None = None) -> Services:
    """Services for unit tests: ``config`` (default: the defaults) with its runtime dir in
    ``runtime_dir`` (which the test owns), ops recorded in ``services.ops`` (a
    :class:`RecordingRegistry`), no child-process component and no workload cgroup."""
    cfg = config or Config()
    cfg.runtime_dir = str(runtime_dir)
    children: Any = _Unavailable("child-process component")
    workload: Any = _Unavailable("workload cgroup")
    return Services(cfg, children, workload, RecordingRegistry(), FakeHost())


class FakeStream:
    """A request's credited data side (guestd.output.stream.CreditedStream) whose client grants
    credit only when the test says so (:meth:`grant`); data events land in ``sent`` as
    ``(ev, bytes)``. ``max_frame`` bounds one event as the real session does."""

    def __init__(self, credit: int = 0, max_frame: int = 1 << 20) -> None:
        self.credit = credit
        self.max_frame = max_frame
        self.active = True
        self.write_paused = False
        self.sent: list[tuple[str, bytes]] = []
        self.drain_error: Exception | None = None  # drain raises it: the connection is closing
        self.on_wait_credit: Callable[[], None] | None = None  # runs in each wait_credit
        self._waiters: list[asyncio.Future[None]] = []

    def data_room(self, fields: Mapping[str, Any]) -> int:
        return min(self.credit, self.max_frame) if self.active else 0

    def push_data(self, fields: Mapping[str, Any], data: bytes | bytearray) -> None:
        assert self.active and 0 < len(data) <= self.data_room(fields), "a data event beyond the credit"
        self.credit -= len(data)
        self.sent.append((fields["ev"], bytes(data)))

    async def wait_credit(self) -> None:
        if self.on_wait_credit is not None:
            self.on_wait_credit()
        while self.active and self.credit <= 0:
            await self._wait()

    async def drain(self) -> None:
        if self.drain_error is not None:
            raise self.drain_error
        while self.active and self.write_paused:
            await self._wait()

    def grant(self, nbytes: int) -> None:
        self.credit += nbytes
        self._wake()

    def set_write_paused(self, paused: bool) -> None:
        self.write_paused = paused
        self._wake()

    def end(self) -> None:
        """The request's final frame went out (or the client cancelled)."""
        self.active = False
        self._wake()

    def data(self, ev: str = "stdout") -> bytes:
        """Every data byte of the events named ``ev``, in order."""
        return b"".join(d for e, d in self.sent if e == ev)

    async def _wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class FakeRequest(FakeStream):
    """A request as a handler sees it (guestd.services.Request): its data as :class:`FakeStream`
    (credit 1 GiB unless given), its other events in ``events``, INPUT bodies the test puts in
    ``input``."""

    def __init__(self, credit: int = 1 << 30, max_frame: int = 1 << 20) -> None:
        super().__init__(credit, max_frame)
        self.events: list[dict[str, Any]] = []
        self._input: asyncio.Queue[dict[str, Any]] | None = None
        self.input_handler: Callable[[dict[str, Any]], None] | None = None
        self.signal_handler: Callable[[Any], None] | None = None
        self.acked = 0
        self.committed = False
        self.taking_data = True

    # -- events ---------------------------------------------------------------------------
    async def send_event(self, body: dict[str, Any]) -> None:
        self.events.append(dict(body))

    def post_event(self, body: dict[str, Any]) -> None:
        self.events.append(dict(body))

    async def send_data_event(self, fields: Mapping[str, Any], data: bytes | bytearray) -> None:
        rest = bytes(data)
        while rest:
            await self.wait_credit()
            if not self.active:
                return
            room = self.data_room(fields)
            self.push_data(fields, rest[:room])
            rest = rest[room:]

    async def wait_room(self, fields: Mapping[str, Any], nbytes: int) -> None:
        while self.active and self.data_room(fields) < nbytes:
            await self._wait()

    # -- input, signals, the point of no return -------------------------------------------
    @property
    def input(self) -> asyncio.Queue[dict[str, Any]]:
        if self._input is None:
            self._input = asyncio.Queue()
        return self._input

    def handle_signals(self, handler: Callable[[Any], None]) -> None:
        self.signal_handler = handler

    def stop_taking_data(self) -> None:
        self.taking_data = False

    def ack_input(self, nbytes: int) -> None:
        self.acked += nbytes

    def commit(self) -> None:
        self.committed = True

    @property
    def connection(self) -> object:
        return self


async def call(
    services: Services, op: str, args: dict[str, Any], request: FakeRequest | None = None
) -> Mapping[str, Any]:
    """Run the registered handler of ``op`` as the server would: args checked against the
    schema (defaults filled), ``path`` arguments as os strs; the reply as the handler gave it."""
    registry = cast(RecordingRegistry, services.ops)
    spec = OPS_BY_NAME[op]
    checked = validate_args(spec, dict(args), services.config.limits)
    for f in spec.args:
        if f.type.rstrip("?") == "path" and checked.get(f.name) is not None:
            checked[f.name] = path_from_wire(checked[f.name])
    if op in registry.inline:
        return registry.inline[op](checked)
    if op not in registry.handlers:
        raise AssertionError(f"{op!r} is not registered (registered: {registry.ops()})")
    return await registry.handlers[op](request or FakeRequest(), checked)
