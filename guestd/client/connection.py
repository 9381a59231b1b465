"""Client side of one connection: the asyncio adapter around the sans-I/O ``ClientSession``.

The session core (``guestd/wire/session.py``) owns the protocol rules it shares with
the server: framing, ids, credit and frame sizes. Everything the guest sends is
treated as hostile: frames above the negotiated size, malformed bodies, stream data
beyond the credit we granted, or replies of the wrong shape end the connection with
:class:`GuestProtocolError`, and every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

from guestd import __version__
from guestd.flow import WriteGate, widen_send_buffer
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.frames import DEFAULT_MAX_FRAME
from guestd.wire.schema import OPS_BY_NAME, PROTOCOL_VERSION
from guestd.wire.session import (
    ClientSession,
    ConnectionFailed,
    CreditGranted,
    ErrorReceived,
    Event,
    EventReceived,
    HelloAccepted,
    PeerViolation,
    ResponseReceived,
    Stream,
)

DEFAULT_WINDOW = 4 * 1024 * 1024
MAX_PENDING_EVENTS = 4096  # non-data events queued per stream before we call it abuse
MAX_PENDING_EVENT_BYTES = 16 * 1024 * 1024  # and their payload bytes

GuestProtocolError = PeerViolation  # the guest broke the protocol; the connection is closed


class ConnectionClosed(GuestdError):
    def __init__(self, message: str = "connection closed") -> None:
        super().__init__(ErrorCode.CANCELLED, message)


def _event_cost(body: dict[str, Any], size: int) -> tuple[int, int]:
    """(events, bytes) a queued event counts against the client's bounds: its payload
    beyond the data the credit covers, and one event unless it carries data."""
    data = body.get("data")
    data_len = len(data) if isinstance(data, bytes) else 0
    return (0 if data_len else 1), size - data_len


class Call:
    """One request in flight. Streams queue their events here within our credit.

    Plain requests (ping, stat, ...) only use ``future``; the event queue and the
    waiters are made on first use, so the common path stays cheap. A consumer of
    events and a sender of input wait on separate futures, so one never steals the
    other's wake-up (a stdin writer and an output reader of one exec run together).
    """

    __slots__ = (
        "_credit_waiter",
        "_event_waiter",
        "_events",
        "conn",
        "future",
        "id",
        "op",
        "queued_bytes",
        "queued_small",
        "stream",
    )

    def __init__(self, conn: ClientConnection, stream: Stream) -> None:
        self.conn = conn
        self.stream = stream
        self.id = stream.id
        self.op = stream.op
        self.future: asyncio.Future[dict[str, Any]] = conn.loop.create_future()
        self._events: deque[tuple[dict[str, Any], int]] | None = None  # (body, payload bytes)
        self._event_waiter: asyncio.Future[None] | None = None
        self._credit_waiter: asyncio.Future[None] | None = None
        self.queued_small = 0
        self.queued_bytes = 0

    def _wake(self) -> None:
        for w in (self._event_waiter, self._credit_waiter):
            if w is not None and not w.done():
                w.set_result(None)

    async def _wait(self, which: str, timeout: float | None) -> None:
        waiter = self.conn.loop.create_future()
        setattr(self, which, waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            raise GuestdError(ErrorCode.TIMEOUT, f"{self.op}: no progress within {timeout} s") from None
        finally:
            setattr(self, which, None)

    def on_event(self, body: dict[str, Any], size: int) -> None:
        # Data bytes are bounded by the credit the session enforces; everything else an event
        # carries (its other fields, an event with empty data) by count and bytes here.
        count, extra = _event_cost(body, size)
        self.queued_small += count
        self.queued_bytes += extra
        if self.queued_small > MAX_PENDING_EVENTS or self.queued_bytes > MAX_PENDING_EVENT_BYTES:
            raise GuestProtocolError("guest flooded a stream with events nobody has read yet")
        if self._events is None:
            self._events = deque()
        self._events.append((body, size))
        w = self._event_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def finish(self, body: dict[str, Any] | None, err: BaseException | None) -> None:
        if not self.future.done():
            if err is not None:
                self.future.set_exception(err)
            else:
                assert body is not None
                self.future.set_result(body)
        self._wake()

    async def next_event(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Next stream event, or None once the call has finished (then await ``future``)."""
        while not self._events:
            if self.future.done():
                return None
            await self._wait("_event_waiter", timeout)
        body, size = self._events.popleft()
        count, extra = _event_cost(body, size)
        self.queued_small -= count
        self.queued_bytes -= extra
        data = body.get("data")
        if isinstance(data, bytes) and data and not self.future.done():
            self.conn.grant(self.stream, len(data))
        return body

    async def iter_events(self, timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
        while True:
            ev = await self.next_event(timeout)
            if ev is None:
                return
            yield ev

    def on_credit(self) -> None:
        w = self._credit_waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def send_input(self, body: dict[str, Any], timeout: float | None = None) -> int:
        """Send INPUT; ``data`` is cut into frames within the guest's credit and max_frame.
        Returns the data bytes sent: fewer than given when the request ended first (its final
        frame came: the rest was never sent).

        ``timeout`` bounds each wait, for credit and for the transport alike.
        """
        session = self.conn.session
        data = body.get("data")
        if not isinstance(data, bytes):
            if not self.future.done():
                self.conn.check_open()
                session.send_input(self.stream, body)
                self.conn.flush()
                await self.conn.drain(timeout)
            return 0
        fields = {k: v for k, v in body.items() if k != "data"}
        view = memoryview(data)
        while view and not self.future.done():
            self.conn.check_open()
            room = session.data_room(self.stream, fields)
            if room <= 0:
                if not self.stream.open:
                    break
                await self._wait("_credit_waiter", timeout)
                continue
            piece = data if room >= len(view) and len(view) == len(data) else bytes(view[:room])
            session.send_input_data(self.stream, fields, piece)
            self.conn.flush()
            view = view[len(piece) :]
            await self.conn.drain(timeout)
        return len(data) - len(view)

    def cancel(self) -> None:
        """Ask the guest to cancel; the call stays registered for its final reply. That reply
        (the guest's ``cancelled`` error, or ``closed by client`` when the connection closes
        first) may never be awaited by a caller who only wanted the run stopped, so it is
        marked retrieved here: no "Future exception was never retrieved" at exit. A caller
        that does await the future still gets the exception."""
        self.future.add_done_callback(_mark_retrieved)
        self.conn.session.cancel(self.stream, forget=False)
        self.conn.flush()


def _mark_retrieved(future: asyncio.Future[dict[str, Any]]) -> None:
    if not future.cancelled():
        future.exception()


class ClientConnection(asyncio.BufferedProtocol):
    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, stream_window: int = DEFAULT_WINDOW) -> None:
        self.session = ClientSession(ops=OPS_BY_NAME, max_frame=max_frame, stream_window=stream_window)
        self.transport: asyncio.Transport | None = None
        self.calls: dict[int, Call] = {}
        self.hello: dict[str, Any] | None = None
        self.loop = asyncio.get_running_loop()
        self._hello_future: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self._closed_exc: BaseException | None = None
        self._gate = WriteGate()

    # -- set-up ---------------------------------------------------------------------
    @classmethod
    async def open(
        cls,
        sock: socket.socket,
        *,
        handshake_timeout: float,
        token: str | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        stream_window: int = DEFAULT_WINDOW,
    ) -> ClientConnection:
        loop = asyncio.get_running_loop()
        if sock.family == socket.AF_UNIX:
            _, proto = await loop.create_unix_connection(lambda: cls(max_frame, stream_window), sock=sock)
        else:
            _, proto = await loop.create_connection(lambda: cls(max_frame, stream_window), sock=sock)
        try:
            await asyncio.wait_for(proto._handshake(token), handshake_timeout)
        except TimeoutError:
            proto.close()
            raise GuestdError(ErrorCode.TIMEOUT, f"no handshake reply within {handshake_timeout} s") from None
        except BaseException:
            proto.close()
            raise
        return proto

    async def _handshake(self, token: str | None) -> None:
        hello: dict[str, Any] = {
            "versions": [PROTOCOL_VERSION],
            "client": f"guestd-client/{__version__}",
            "max_frame": self.session.announced_max_frame,
            "stream_window": self.session.stream_window,
            "time_ns": time.time_ns(),  # lets a guest that missed a restore notice its stale clock
        }
        if token is not None:
            hello["token"] = token
        self.session.send_hello(hello)
        self.flush()
        self.hello = await self._hello_future

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its API.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=2 * 1024 * 1024)
        widen_send_buffer(self.transport.get_extra_info("socket"))  # uploads: see guestd/flow.py

    def get_buffer(self, sizehint: int) -> memoryview:
        # The kernel reads the guest's frames straight into the session's decoder.
        return self.session.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._on_events(self.session.buffer_updated, nbytes)

    def data_received(self, data: bytes) -> None:
        self._on_events(self.session.receive_data, data)

    def _on_events(self, receive: Callable[[Any], list[Event]], arg: Any) -> None:
        try:
            for event in receive(arg):
                self._on_event(event)
        except GuestdError as exc:
            self._abort(exc if isinstance(exc, GuestProtocolError) else GuestProtocolError(exc.message))
        self.flush()

    def _on_event(self, event: object) -> None:
        if isinstance(event, ResponseReceived):
            call = self.calls.pop(event.id, None)
            if call is not None:
                call.finish(event.body, None)
        elif isinstance(event, EventReceived):
            call = self.calls.get(event.id)
            if call is not None:
                call.on_event(event.body, event.size)
        elif isinstance(event, ErrorReceived):
            call = self.calls.pop(event.id, None)
            if call is not None:
                call.finish(None, event.error)
        elif isinstance(event, CreditGranted):
            call = self.calls.get(event.stream.id)
            if call is not None and call.stream is event.stream:
                call.on_credit()
        elif isinstance(event, HelloAccepted):
            if not self._hello_future.done():
                self._hello_future.set_result(event.hello)
        elif isinstance(event, ConnectionFailed):
            self._abort(event.error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._abort(ConnectionClosed(f"connection lost: {exc}" if exc else "connection closed by guest"))

    def pause_writing(self) -> None:
        self._gate.pause()

    def resume_writing(self) -> None:
        self._gate.resume()

    async def drain(self, timeout: float | None = None) -> None:
        """Until the transport takes more; a guest that stops reading costs ``timeout``, not forever."""
        self.check_open()
        if not self._gate.paused:
            return
        try:
            await asyncio.wait_for(self._gate.wait(), timeout)
        except TimeoutError:
            raise GuestdError(ErrorCode.TIMEOUT, f"the guest read nothing for {timeout} s") from None
        self.check_open()

    def check_open(self) -> None:
        if self._closed_exc is not None:
            raise self._closed_exc

    def _abort(self, exc: BaseException) -> None:
        if self._closed_exc is None:
            self._closed_exc = exc
        if not self._hello_future.done():
            self._hello_future.set_exception(exc)
        calls, self.calls = self.calls, {}
        for call in calls.values():
            call.finish(None, exc)
            # The connection's error reaches every caller through check_open as well; a call
            # whose caller is elsewhere (an upload failing in drain) must not log it again
            # when collected: that log, run by the GC inside CPython 3.11's ast.parse, breaks it.
            _mark_retrieved(call.future)
        self._gate.release_all()
        if self.transport is not None:
            self.transport.close()

    # -- API ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed_exc is not None

    def close(self) -> None:
        """Close the connection; every call still in flight ends with ``closed by client``.
        Those errors are marked retrieved: a call nobody awaits any more (an abandoned
        stream iterator, a generator finalized after the close) is no "never retrieved"
        warning, while a caller awaiting one still gets it."""
        self._abort(ConnectionClosed("closed by client"))

    def flush(self) -> None:
        if not self.session.has_output:
            return
        out = self.session.data_to_send()
        if self.transport is not None and self._closed_exc is None:
            if len(out) == 1:
                self.transport.write(out[0])  # the common case (a request), without writelines' list walk
            else:
                self.transport.writelines(out)

    def grant(self, stream: Stream, nbytes: int) -> None:
        self.session.grant(stream, nbytes)
        self.flush()

    def start(self, op: str, args: dict[str, Any]) -> Call:
        self.check_open()
        call = Call(self, self.session.start(op, args))
        self.calls[call.id] = call
        self.flush()
        return call

    async def wait(self, call: Call, deadline: float | None) -> dict[str, Any]:
        """Await the final reply; on our deadline cancel the request in the guest too."""
        handle = None
        if deadline is not None:
            handle = asyncio.get_running_loop().call_later(deadline, self._expire, call, deadline)
        try:
            return await call.future
        except asyncio.CancelledError:
            self._forget(call)
            raise
        finally:
            if handle is not None:
                handle.cancel()

    def _expire(self, call: Call, deadline: float) -> None:
        if call.future.done():
            return
        self._drop(call)
        call.finish(
            None, GuestdError(ErrorCode.TIMEOUT, f"{call.op}: no reply within {deadline} s (request cancelled)")
        )

    def _drop(self, call: Call) -> None:
        """Cancel ``call`` in the guest and ignore whatever it still sends."""
        if self.calls.get(call.id) is call:
            del self.calls[call.id]
            if self._closed_exc is None:
                self.session.cancel(call.stream, forget=True)
                self.flush()

    def _forget(self, call: Call) -> None:
        if self.calls.get(call.id) is call:
            self._drop(call)
            call.future.cancel()
            call._wake()
        elif call.future.done():
            _mark_retrieved(call.future)  # its caller gave up with an error of its own

    async def request(self, op: str, args: dict[str, Any], deadline: float | None) -> dict[str, Any]:
        return await self.wait(self.start(op, args), deadline)
