"""Ports on the client: TCP relays into the guest as asyncio transports, host-side forwards, and
the reverse forwards that let the guest reach the one host destination the host named.

A relay stream (``port.connect``, ``port.accept``) is a request whose data events and INPUT
frames carry TCP bytes under the protocol's credit. :class:`RelayTransport` is an
``asyncio.Transport`` over such a request, so any asyncio protocol runs on it: the
``StreamReader``/``StreamWriter`` pair of :meth:`PortsAPI.open_port`, or a splice onto a host
socket (:class:`PortForward`, :class:`ReverseForward`).

What the guest can make this client hold is bounded by what the client grants: stream bytes
by the credit (granted back only as the protocol on top reads; a paused reader stops the
grants), events by the connection's per-request bounds. A reverse forward connects only to the
destination given when it was set up; the guest's ``accepted`` events carry a number and
nothing else this client reads, and at most ``MAX_REVERSE_STREAMS`` run at once per forward.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from guestd.client.connection import Call, ClientConnection, GuestProtocolError
from guestd.client.params import present
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.session import Stream

if TYPE_CHECKING:
    from guestd.wire.types import PortWaitReply

RELAY_HIGH_WATER = 1024 * 1024  # bytes written to a relay and not yet sent before the writer pauses
RELAY_LOW_WATER = 256 * 1024
JOIN_LIMIT = 64 * 1024  # queued writes joined into one INPUT frame while they fit this
CLOSE_GRACE_S = 10.0  # after close(): how long the guest side may take to end before it is reset
CONNECT_MARGIN = 10.0  # on top of the guest's connect_timeout_s: the trip there and back
DEFAULT_CONNECT_TIMEOUT_S = 10.0  # port.connect's schema default, for the client's own deadline
MAX_REVERSE_STREAMS = 64  # connections one reverse forward relays at once; more are refused
REVERSE_CONNECT_TIMEOUT = 10.0  # connecting to a reverse forward's host destination
OLD_GUEST_CUT = 4096  # listeners a guestd before port.list's total listed at most, without a total


def _relay_exception(err: BaseException | None) -> Exception | None:
    """What the protocol on a relay sees when the stream ended with ``err``."""
    if err is None:
        return None
    if isinstance(err, GuestdError) and err.details.get("reason") == "reset":
        return ConnectionResetError(errno.ECONNRESET, err.message)
    return err if isinstance(err, Exception) else ConnectionAbortedError(str(err))


class RelayCall(Call):
    """A request whose events feed a :class:`RelayTransport`."""

    __slots__ = ("relay",)

    def __init__(self, conn: ClientConnection, stream: Stream) -> None:
        super().__init__(conn, stream)
        self.relay: RelayTransport | None = None

    def on_event(self, body: dict[str, Any], size: int) -> None:
        if self.relay is None:
            raise GuestProtocolError(f"guest sent an event for {self.op} before it was set up")
        self.relay.on_event(body)

    def on_credit(self) -> None:
        super().on_credit()
        if self.relay is not None:
            self.relay.wake()

    def finish(self, body: dict[str, Any] | None, err: BaseException | None) -> None:
        super().finish(body, err)
        if not self.future.cancelled():
            self.future.exception()  # nobody awaits it: the relay reports the outcome to its protocol
        if self.relay is not None:
            self.relay.on_finish(err)


class RelayTransport(asyncio.Transport):
    """An ``asyncio.Transport`` over one relay request (both directions under its credit)."""

    def __init__(self, call: RelayCall, protocol: asyncio.BaseProtocol, peer: tuple[str, int]) -> None:
        super().__init__({"peername": peer})
        self._call = call
        self._conn = call.conn
        self._protocol: Any = protocol
        self._loop = call.conn.loop
        self._out: deque[bytes] = deque()
        self._out_size = 0
        self._high, self._low = RELAY_HIGH_WATER, RELAY_LOW_WATER
        self._writing_paused = False
        self._eof_wanted = False
        self._eof_sent = False
        self._eof_received = False
        self._closing = False
        self._finished = False
        self._made = False
        self._reading_paused = False
        self._owed = 0
        self._wake = asyncio.Event()
        self.connected: asyncio.Future[None] = self._loop.create_future()
        self._pump: asyncio.Task[None] | None = None
        self._grace: asyncio.TimerHandle | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self.timed_out: GuestdError | None = None  # the guest side did not connect in time
        call.relay = self

    # -- from the connection -------------------------------------------------------------
    def on_event(self, body: dict[str, Any]) -> None:
        ev = body.get("ev")
        if ev == "connected":
            if self.connected.done():
                raise GuestProtocolError("guest sent connected twice")
            self._stop_deadline()
            self.connected.set_result(None)
            self.start()  # now, not when the opener resumes: data may follow in this same read
            return
        if not self.connected.done():
            raise GuestProtocolError(f"guest sent {ev!r} before connected")
        if ev == "data":
            data = body.get("data")
            if not isinstance(data, bytes):
                raise GuestProtocolError("relay data event without data")
            if self._eof_received:
                raise GuestProtocolError("guest sent relay data after its eof")
            if self._closing or not self._made:
                self._conn.grant(self._call.stream, len(data))  # nobody reads any more: drop it
                return
            self._protocol.data_received(data)
            if self._reading_paused:
                self._owed += len(data)  # granted when the reader resumes
            else:
                self._conn.grant(self._call.stream, len(data))
        elif ev == "eof":
            self._eof_received = True
            if self._made and not self._closing and not self._protocol.eof_received():
                self.close()

    def on_finish(self, err: BaseException | None) -> None:
        if self._finished:
            return
        self._finished = True
        self._stop_deadline()
        if self._grace is not None:
            self._grace.cancel()
        if self._pump is not None:
            self._pump.cancel()
        if not self.connected.done():
            self.connected.set_exception(err or GuestProtocolError("relay ended before it connected"))
            self.connected.exception()  # retrieved here too: the opener may have given up already
            return
        self._lose(_relay_exception(err))

    def _lose(self, exc: Exception | None) -> None:
        self._closing = True
        self._eof_wanted = True
        if self._made:
            self._made = False
            self._loop.call_soon(self._protocol.connection_lost, exc)

    def wake(self) -> None:
        self._wake.set()  # credit came: a sender waiting for it goes on (none yet: nothing to send)

    # -- set-up --------------------------------------------------------------------------
    def start(self) -> None:
        """The guest connected: hand the transport to its protocol (which may start writing)."""
        self._made = True
        self._protocol.connection_made(self)

    def start_deadline(self, deadline: float) -> None:
        """Abort the relay (``timed_out`` says so) unless the guest side connects within
        ``deadline`` seconds."""
        self._deadline = self._loop.call_later(deadline, self._expire, deadline)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, deadline: float) -> None:
        self._deadline = None
        if not self.connected.done():
            self.timed_out = GuestdError(
                ErrorCode.TIMEOUT, f"{self._call.op}: not connected within {deadline} s (cancelled)"
            )
            self.abort()  # cancels `connected`

    def _kick(self) -> None:
        """Something waits to go out (data, eof) or may now: wake the sender, started on first
        use, so a stream that never sends (a connect check, a download) runs no task for it.
        It may run before the guest side is connected: what a forward's host connection sends
        first goes right behind the request, within the credit every stream starts with, and
        guestd holds it until its socket is open (one round trip for a connect and a first
        request, not two)."""
        self._wake.set()
        if self._pump is None and not self._finished:
            self._pump = self._loop.create_task(self._send())

    async def _send(self) -> None:
        call, session, stream = self._call, self._conn.session, self._call.stream
        try:
            while not self._finished:
                self._wake.clear()
                if self._out:
                    room = session.data_room(stream, {})
                    if room <= 0:
                        if not stream.open:
                            return
                        await self._wake.wait()
                        continue
                    piece = self._take(room)
                    self._conn.check_open()
                    session.send_input_data(stream, {}, piece)
                    self._conn.flush()
                    if self._writing_paused and self._out_size <= self._low:
                        self._writing_paused = False
                        self._protocol.resume_writing()
                    await self._conn.drain()
                    continue
                if self._eof_wanted and not self._eof_sent:
                    self._eof_sent = True
                    await call.send_input({"eof": True})
                    continue
                await self._wake.wait()
        except GuestdError:
            return  # the connection is gone; on_finish tells the protocol

    def _take(self, room: int) -> bytes:
        out = self._out
        first = out[0]
        if len(first) > room:
            out[0] = first[room:]
            piece = first[:room]
        else:
            out.popleft()
            piece = first
            # Small writes are joined into one frame; large ones go as they are (joining them
            # copied every byte of a bulk transfer once more).
            limit = min(room, JOIN_LIMIT)
            if out and len(first) + len(out[0]) <= limit:
                parts = [first]
                n = len(first)
                while out and n + len(out[0]) <= limit:
                    part = out.popleft()
                    parts.append(part)
                    n += len(part)
                piece = b"".join(parts)
        self._out_size -= len(piece)
        return piece

    # -- asyncio.Transport -----------------------------------------------------------------
    def get_protocol(self) -> Any:
        return self._protocol

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof_wanted and not self._closing:
            raise RuntimeError("write() after write_eof()")
        if self._closing or not data:
            return
        if not self._out and self._send_now(data):
            return
        self._out.append(bytes(data))
        self._out_size += len(data)
        self._kick()
        if not self._writing_paused and self._out_size > self._high:
            self._writing_paused = True
            self._protocol.pause_writing()

    def _send_now(self, data: bytes | bytearray | memoryview) -> bool:
        """Send ``data`` as one INPUT frame from write() itself when nothing waits before it,
        the credit takes it whole and the connection is not paused (as a socket transport
        writes at once): a request through a relay costs no wake-up of the sender task (a
        loop iteration) on its way out. Anything else goes the sender's way (_send)."""
        conn, stream = self._conn, self._call.stream
        if self._finished or conn.closed or conn._gate.paused or not stream.open:
            return False
        if conn.session.data_room(stream, {}) < len(data):
            return False
        conn.session.send_input_data(stream, {}, bytes(data))
        conn.flush()
        return True

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self._eof_wanted = True
        self._kick()

    def get_write_buffer_size(self) -> int:
        return self._out_size

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high = RELAY_HIGH_WATER if high is None else high
        self._low = self._high // 4 if low is None else low

    def is_reading(self) -> bool:
        return not self._reading_paused

    def pause_reading(self) -> None:
        self._reading_paused = True

    def resume_reading(self) -> None:
        self._reading_paused = False
        if self._owed and not self._finished:
            owed, self._owed = self._owed, 0
            self._conn.grant(self._call.stream, owed)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Send what is buffered, then eof; the guest side gets ``CLOSE_GRACE_S`` to end too
        (what it still sends is dropped), then it is reset. The protocol's ``connection_lost``
        comes when the stream has ended. Before the guest side is connected (a forward whose
        host connection sent and left), the same: it gets the bytes and eof once it is."""
        if self._closing:
            return
        self._closing = True
        self._eof_wanted = True
        self._kick()
        if not self._finished:
            self._grace = self._loop.call_later(CLOSE_GRACE_S, self.abort)
        else:
            self._lose(None)

    def abort(self) -> None:
        """Reset the guest side now (a cancel: guestd closes the guest socket with RST)."""
        if self._finished:
            self._lose(None)
            return
        self._finished = True
        self._stop_deadline()
        if self._pump is not None:
            self._pump.cancel()
        if self._grace is not None:
            self._grace.cancel()
        self._conn._drop(self._call)
        if not self.connected.done():
            self.connected.cancel()
        self._lose(None)


def start_relay(
    op: Literal["port.connect", "port.accept"],
    conn: ClientConnection,
    args: dict[str, Any],
    protocol_factory: Callable[[], asyncio.BaseProtocol],
    peer: tuple[str, int],
    deadline: float,
) -> RelayTransport:
    """Send a relay request and return its transport at once. Its ``connected`` is done when
    the guest side is (``connection_made`` is called on the protocol at that moment, before
    any data arrives); it fails with the guest's error, or is cancelled after ``deadline``
    seconds (then ``timed_out`` is set) or by :meth:`RelayTransport.abort`. The request goes
    out first: the protocol and the transport are made while it travels."""
    conn.check_open()
    stream = conn.session.start(op, args)
    conn.flush()
    call = RelayCall(conn, stream)
    conn.calls[call.id] = call
    transport = RelayTransport(call, protocol_factory(), peer)
    transport.start_deadline(deadline)
    return transport


async def open_relay(
    op: Literal["port.connect", "port.accept"],
    conn: ClientConnection,
    args: dict[str, Any],
    protocol_factory: Callable[[], asyncio.BaseProtocol],
    peer: tuple[str, int],
    deadline: float,
) -> RelayTransport:
    """:func:`start_relay`, returning once the guest side is connected. A plain await on
    ``connected``: wait_for(shield(...)) chained three futures, each one more pass of the
    event loop between the guest's ``connected`` and the opener (bench/relay.py)."""
    transport = start_relay(op, conn, args, protocol_factory, peer, deadline)
    try:
        await transport.connected
    except asyncio.CancelledError:
        if transport.timed_out is not None:
            raise transport.timed_out from None
        transport.abort()
        raise
    return transport


# --------------------------------------------------------------------------- splices


class Splice(asyncio.Protocol):
    """One end of a pipe between two transports: what it receives goes to the other end, a
    full other end pauses this one's reading, eof and close travel across. ``closed`` is done
    once its transport is gone.

    What arrives before the other end is there (not linked yet, or still connecting) waits
    here, and this end reads no more until it is: a pause asked for in ``connection_made``
    does not hold on uvloop, which starts reading right after it, and a destination may
    speak first (a banner) before its relay is open. At most one read waits."""

    def __init__(self, on_made: Callable[[Splice], None] | None = None) -> None:
        self.transport: Any = None
        self.peer: Splice | None = None
        self.eof = False
        self.lost = False
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._on_made = on_made
        self._early: list[bytes] = []  # received before the other end was there

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        peer = self.peer
        if peer is not None and not peer.lost:
            early, peer._early = peer._early, []
            for data in early:
                self.transport.write(data)
            if peer.eof:
                self.transport.write_eof()
        if self._on_made is not None:
            self._on_made(self)

    def _peer(self) -> Any:
        """The other end's transport while it is open, else None."""
        peer = self.peer
        if peer is None or peer.lost or peer.transport is None:
            return None
        return peer.transport

    def data_received(self, data: bytes) -> None:
        peer = self._peer()
        if peer is not None:
            peer.write(data)
        elif self.peer is None or not self.peer.lost:  # the other end is not there yet
            self._early.append(data)
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        peer = self._peer()
        if peer is not None:
            peer.write_eof()
            if self.peer is not None and self.peer.eof:
                self.transport.close()
                peer.close()
        return True

    def pause_writing(self) -> None:
        peer = self._peer()
        if peer is not None:
            peer.pause_reading()

    def resume_writing(self) -> None:
        peer = self._peer()
        if peer is not None:
            peer.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.closed.done():
            self.closed.set_result(None)
        peer = self._peer()
        if peer is not None:
            if exc is not None:
                peer.abort()
            else:
                peer.close()

    def abort(self) -> None:
        if not self.lost and self.transport is not None:
            self.transport.abort()


def link(a: Splice, b: Splice) -> None:
    a.peer, b.peer = b, a


# --------------------------------------------------------------------------- forwards


class PortForward:
    """A host listener whose connections are relayed to a guest port (``kubectl port-forward``).
    Each host connection is one ``port.connect`` stream; a guest side that cannot be reached
    resets the host connection. ``close()`` stops listening and resets open connections."""

    def __init__(self, conn: ClientConnection, guest_port: int, args: dict[str, Any], connect_deadline: float) -> None:
        self._conn = conn
        self.guest_port = guest_port
        self._args = args
        self._deadline = connect_deadline
        self._server: asyncio.AbstractServer | None = None
        self._open: set[Splice] = set()  # guest ends, connecting or connected
        self.local_address = ""
        self.local_port = 0
        self.connections = 0  # host connections accepted so far
        self.errors: list[GuestdError] = []  # why connections could not be relayed (the last 16)

    async def start(self, local_address: str, local_port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accepted, host=local_address, port=local_port)
        sockname = self._server.sockets[0].getsockname()
        self.local_address, self.local_port = sockname[0], sockname[1]

    def _accepted(self) -> Splice:
        self.connections += 1
        return Splice(on_made=self._made)

    def _made(self, host: Splice) -> None:
        """A host connection: its ``port.connect`` goes out now, and what the host sends goes
        right behind it while the guest side connects (within the credit a stream starts
        with; guestd holds it until its socket is open), so a connect and a first request
        cost one round trip, not two. Callbacks, no task per connection."""
        guest = Splice()
        link(host, guest)  # before the relay opens: guest bytes may arrive with its connected event
        try:
            transport = start_relay(
                "port.connect", self._conn, dict(self._args), lambda: guest, ("guest", self.guest_port), self._deadline
            )
        except GuestdError as err:  # the connection to guestd is gone
            self._failed(host, err)
            return
        guest.transport = transport  # the host's bytes, eof and close go to it from now on
        self._open.add(guest)
        transport.connected.add_done_callback(functools.partial(self._connected, host, guest, transport))

    def _connected(
        self, host: Splice, guest: Splice, transport: RelayTransport, connected: asyncio.Future[None]
    ) -> None:
        if not connected.cancelled() and connected.exception() is None:
            guest.closed.add_done_callback(lambda _: self._open.discard(guest))
            return
        self._open.discard(guest)
        # Refused, unreachable, timed out (cancelled by the deadline), or aborted by close().
        err = transport.timed_out if connected.cancelled() else connected.exception()
        self._failed(host, err if isinstance(err, GuestdError) else None)

    def _failed(self, host: Splice, err: GuestdError | None) -> None:
        if err is not None:
            self.errors = [*self.errors[-15:], err]
        host.abort()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for guest in list(self._open):
            guest.abort()
            if guest.peer is not None:
                guest.peer.abort()
        self._open.clear()
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> PortForward:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ReverseForward:
    """Guest -> host: guestd listens on ``guest_port`` in the guest, and every connection to it is
    relayed to ``destination`` on the host side, the only place this forward ever connects to.
    ``close()`` stops the guest listener and resets the relayed connections."""

    def __init__(
        self, conn: ClientConnection, call: Call, destination: tuple[str, int], connect_timeout: float
    ) -> None:
        self._conn = conn
        self._call = call
        self.destination = destination
        self._connect_timeout = connect_timeout
        self.forward_id = ""
        self.guest_port = 0
        self.relayed = 0  # guest connections relayed to the destination
        self.refused = 0  # guest connections reset (destination unreachable, too many at once)
        self._active: set[Splice] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[None] | None = None

    async def start(self, deadline: float | None) -> None:
        ev = await self._call.next_event(deadline)
        if ev is None:
            await self._conn.wait(self._call, deadline)  # raises the guest's error
            raise GuestProtocolError("port.reverse ended without listening")
        if ev.get("ev") != "listening" or not isinstance(ev.get("forward"), str) or not isinstance(ev.get("port"), int):
            raise GuestProtocolError("port.reverse: the first event must be listening")
        self.forward_id, self.guest_port = ev["forward"], ev["port"]
        self._reader = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        try:
            while True:
                ev = await self._call.next_event(None)
                if ev is None:
                    return
                n = ev.get("conn")
                if ev.get("ev") == "accepted" and isinstance(n, int) and not isinstance(n, bool):
                    task = asyncio.get_running_loop().create_task(self._claim(n))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        except GuestdError:
            return

    async def _claim(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        host: Splice | None = None
        if len(self._active) < MAX_REVERSE_STREAMS:
            host_end = Splice()
            try:
                host_port, port = self.destination
                await asyncio.wait_for(
                    loop.create_connection(lambda: host_end, host=host_port, port=port), self._connect_timeout
                )
                host = host_end
            except (OSError, TimeoutError):
                host = None
        if host is None:
            self.refused += 1
            try:
                await self._conn.request("port.accept", {"forward": self.forward_id, "conn": n, "refuse": True}, 30.0)
            except GuestdError:
                pass
            return
        host.transport.pause_reading()
        guest = Splice()
        link(host, guest)
        self._active.add(host)
        try:
            await open_relay(
                "port.accept",
                self._conn,
                {"forward": self.forward_id, "conn": n},
                lambda: guest,
                ("guest", self.guest_port),
                30.0,
            )
        except GuestdError:
            self.refused += 1
            self._active.discard(host)
            host.transport.abort()
            return
        self.relayed += 1
        if host.lost:
            guest.abort()
        else:
            host.transport.resume_reading()
        await host.closed
        self._active.discard(host)

    async def close(self, *, deadline: float = 30.0) -> None:
        try:
            await self._call.send_input({"eof": True}, deadline)
            await self._conn.wait(self._call, deadline)
        except GuestdError:
            self._conn._forget(self._call)
        finally:
            for task in [*self._tasks, *([self._reader] if self._reader else [])]:
                task.cancel()
            for host in list(self._active):
                if host.peer is not None:
                    host.peer.abort()
                host.abort()
            self._active.clear()

    async def __aenter__(self) -> ReverseForward:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# --------------------------------------------------------------------------- discovery


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket in the guest."""

    port: int
    address: str
    family: str
    pid: int | None = None
    command: str | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.family, self.address, self.port)

    @classmethod
    def from_body(cls, rec: dict[str, Any]) -> Listener:
        return cls(rec["port"], rec["address"], rec["family"], rec.get("pid"), rec.get("command"))


@dataclass(frozen=True)
class PortWait:
    """``port_wait``'s answer: ready before the deadline, how long it took, the last HTTP status."""

    ready: bool
    elapsed_s: float
    http_status: int | None = None

    @classmethod
    def from_body(cls, body: PortWaitReply) -> PortWait:
        return cls(body["ready"], body["elapsed_s"], body.get("http_status"))


@dataclass(frozen=True)
class PortList:
    """``port_list``'s answer: the listeners (iterate it like a list of :class:`Listener`), and
    whether that is all of them. The guest lists at most 4096, lowest ports first: ``total``
    counts every listening socket it found, ``truncated`` says some were left out (ask with
    ``ports`` for the ones you care about: that answer is whole). ``owners_truncated``: the
    guest's search for owning processes stopped at its budget, so a missing ``pid`` may exist."""

    listeners: tuple[Listener, ...]
    total: int
    truncated: bool
    owners_truncated: bool = False

    def __iter__(self) -> Iterator[Listener]:
        return iter(self.listeners)

    def __getitem__(self, index: int) -> Listener:
        return self.listeners[index]

    def __len__(self) -> int:
        return len(self.listeners)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> PortList:
        listeners = tuple(Listener.from_body(rec) for rec in body["listeners"])
        # An older guestd sends neither, and cut its list at OLD_GUEST_CUT without saying.
        total, truncated = body.get("total"), body.get("truncated")
        if total is None:
            total = len(listeners)
        if truncated is None:
            truncated = len(listeners) >= OLD_GUEST_CUT
        if total < len(listeners):
            raise GuestProtocolError(f"the guest listed {len(listeners)} listeners of a total of {total}")
        return cls(listeners, total, bool(truncated), bool(body.get("owners_truncated")))


def _order(listener: Listener) -> tuple[int, int, int]:
    """Where the guest sorts ``listener`` (port, family, address): what a cut list leaves out."""
    try:
        address = int(ipaddress.ip_address(listener.address))
    except ValueError:
        address = 0
    return (listener.port, 0 if listener.family == "ipv4" else 1, address)


class PortWatch:
    """``("added" | "removed", Listener)`` as listeners come and go (async iterator); the first
    poll reports every current listener as added.

    After each answer ``total`` and ``truncated`` say what the guest found. A cut answer lists
    the lowest ports only: a known listener beyond its last entry is not reported removed (the
    guest did not say), and one that appears there is reported once the list reaches it. Watch
    with ``ports`` to see those ports whole however many listeners the others have."""

    def __init__(
        self, conn: ClientConnection, interval_s: float | None, poll_s: float, ports: list[int] | None
    ) -> None:
        self._conn = conn
        self._interval_s = interval_s
        self._poll_s = poll_s
        self._ports = ports
        self._known: dict[tuple[str, str, int], Listener] = {}
        self._digest: str | None = None
        self._pending: deque[tuple[str, Listener]] = deque()
        self._closed = False
        self.total = 0
        self.truncated = False

    def __aiter__(self) -> PortWatch:
        return self

    async def __anext__(self) -> tuple[str, Listener]:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            await self._poll()
        return self._pending.popleft()

    async def aclose(self) -> None:
        self._closed = True
        self._pending.clear()

    async def _poll(self) -> None:
        args = present(timeout_s=self._poll_s, digest=self._digest, interval_s=self._interval_s, ports=self._ports)
        body = await self._conn.request("port.watch", args, self._poll_s + CONNECT_MARGIN)
        self._digest = body["digest"]
        if not body["changed"]:
            return
        listing = PortList.from_body(body)
        self.total, self.truncated = listing.total, listing.truncated
        now = {listener.key: listener for listener in listing}
        last = max((_order(x) for x in listing), default=None) if listing.truncated else None
        for key, listener in list(self._known.items()):
            if key in now:
                continue
            if last is not None and _order(listener) > last:
                continue  # beyond the cut: the guest did not say whether it is still there
            del self._known[key]
            self._pending.append(("removed", listener))
        for key, listener in now.items():
            if key not in self._known:
                self._known[key] = listener
                self._pending.append(("added", listener))


# --------------------------------------------------------------------------- the client's methods


def _connect_deadline(connect_timeout_s: float | None) -> float:
    return (DEFAULT_CONNECT_TIMEOUT_S if connect_timeout_s is None else connect_timeout_s) + CONNECT_MARGIN


class PortsAPI:
    """:class:`~guestd.client.AsyncClient`'s port methods (a mixin: the client's ``_conn``)."""

    _conn: ClientConnection

    async def open_port(
        self, port: int, *, address: str | None = None, connect_timeout_s: float | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TCP connection to ``port`` in the guest (``address``: 127.0.0.1 unless given), as
        asyncio streams. Refused and unreachable are ``unavailable`` errors
        (``details.reason``), a connect slower than ``connect_timeout_s`` is ``timeout``; once
        open, a reset in the guest reaches the reader as ``ConnectionResetError``."""
        loop = asyncio.get_running_loop()
        reader: asyncio.StreamReader | None = None

        def streams() -> asyncio.StreamReaderProtocol:
            nonlocal reader
            reader = asyncio.StreamReader(loop=loop)
            return asyncio.StreamReaderProtocol(reader, loop=loop)

        args = present(port=port, address=address, connect_timeout_s=connect_timeout_s)
        transport = await open_relay(
            "port.connect", self._conn, args, streams, ("guest", port), _connect_deadline(connect_timeout_s)
        )
        assert reader is not None
        return reader, asyncio.StreamWriter(transport, transport.get_protocol(), reader, loop)

    async def port_forward(
        self,
        guest_port: int,
        *,
        local_port: int = 0,
        local_address: str = "127.0.0.1",
        address: str | None = None,
        connect_timeout_s: float | None = None,
    ) -> PortForward:
        """Listen on ``local_address:local_port`` on this host (0: a free port, see
        ``.local_port``) and relay each connection to ``guest_port`` in the guest."""
        args = present(port=guest_port, address=address, connect_timeout_s=connect_timeout_s)
        forward = PortForward(self._conn, guest_port, args, _connect_deadline(connect_timeout_s))
        await forward.start(local_address, local_port)
        return forward

    async def reverse_forward(
        self,
        guest_port: int,
        destination: tuple[str, int],
        *,
        address: str | None = None,
        accept_timeout_s: float | None = None,
        connect_timeout: float = REVERSE_CONNECT_TIMEOUT,
        deadline: float | None = 30.0,
    ) -> ReverseForward:
        """Let the guest reach ``destination`` (host, port) from this host: guestd listens on
        ``guest_port`` (0: a free one, see ``.guest_port``) on a guest loopback address, and
        each connection made to it is relayed to ``destination``, the only place it may go.
        Needs ``[ports] reverse = true`` in guestd's config. ``connect_timeout`` bounds each
        connect to the destination; ``deadline`` the set-up."""
        args = present(port=guest_port, address=address, accept_timeout_s=accept_timeout_s)
        call = self._conn.start("port.reverse", args)
        forward = ReverseForward(self._conn, call, destination, connect_timeout)
        try:
            await forward.start(deadline)
        except BaseException:
            self._conn._forget(call)
            raise
        return forward

    async def port_list(self, *, ports: list[int] | None = None, deadline: float | None = 30.0) -> PortList:
        """The guest's listening TCP sockets, with the process holding each where guestd sees it;
        ``ports``: those ports only. At most 4096 are listed: see ``total`` and ``truncated``."""
        body = await self._conn.request("port.list", present(ports=ports), deadline)
        return PortList.from_body(body)

    async def port_wait(
        self,
        port: int,
        *,
        address: str | None = None,
        timeout_s: float | None = None,
        http: bool | None = None,
        path: str | None = None,
        deadline: float | None = None,
    ) -> PortWait:
        """Until ``port`` in the guest accepts connections (with ``http``, until a GET of
        ``path`` answers 2xx/3xx), at most ``timeout_s`` (guest default 30 s); ``ready`` false
        when it did not in time."""
        args = present(port=port, address=address, timeout_s=timeout_s, http=http, path=path)
        if deadline is None:
            deadline = (30.0 if timeout_s is None else timeout_s) + CONNECT_MARGIN
        body: PortWaitReply = await self._conn.request("port.wait", args, deadline)  # type: ignore[assignment]
        return PortWait.from_body(body)

    def watch_ports(
        self, *, interval_s: float | None = None, poll_s: float = 30.0, ports: list[int] | None = None
    ) -> PortWatch:
        """``("added" | "removed", Listener)`` as listeners appear and disappear in the guest
        (every current one is ``added`` first); ``ports``: those ports only. The guest looks every
        ``interval_s``; each long poll lasts at most ``poll_s``. The iterator's ``total`` and
        ``truncated`` say whether the guest's last answer was whole (:class:`PortWatch`)."""
        return PortWatch(self._conn, interval_s, poll_s, ports)
