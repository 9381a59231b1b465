"""Client side of one connection: framing, id allocation, demultiplexing, flow control.

Everything the guest sends is treated as hostile: frames above the negotiated
size, malformed bodies, stream data beyond the credit we granted, or replies of
the wrong shape end the connection with :class:`GuestProtocolError`, and every
wait has a deadline.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, cast

from guestd import __version__
from guestd.flow import WriteGate
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.frames import (
    DEFAULT_MAX_FRAME,
    FrameDecoder,
    FramingError,
    Kind,
    OversizeFrame,
    encode_data_frame,
    encode_frame,
)
from guestd.wire.messages import decode_body
from guestd.wire.schema import HELLO_SERVER, OPS_BY_NAME, PROTOCOL_VERSION, validate

DEFAULT_WINDOW = 4 * 1024 * 1024
MAX_PENDING_EVENTS = 4096  # non-data events queued per stream before we call it abuse


class GuestProtocolError(GuestdError):
    """The guest broke the protocol; the connection is closed."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.PROTOCOL_ERROR, message)


class ConnectionClosed(GuestdError):
    def __init__(self, message: str = "connection closed") -> None:
        super().__init__(ErrorCode.CANCELLED, message)


class Call:
    """One request in flight. Streams queue their events here within our credit.

    Plain requests (ping, stat, ...) only use ``future``; the event queue and the
    input-credit waiter are made on first use, so the common path stays cheap.
    """

    __slots__ = ("_events", "_waiter", "conn", "future", "id", "input_credit", "op", "queued_small", "unacked")

    def __init__(self, conn: ClientConnection, req_id: int, op: str) -> None:
        self.conn = conn
        self.id = req_id
        self.op = op
        self.future: asyncio.Future[dict[str, Any]] = conn.loop.create_future()
        self._events: deque[dict[str, Any]] | None = None
        self._waiter: asyncio.Future[None] | None = None  # a consumer or an input sender waits here
        self.unacked = 0  # stream bytes received but not yet consumed
        self.queued_small = 0
        self.input_credit = conn.stream_window

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self, timeout: float | None) -> None:
        self._waiter = self.conn.loop.create_future()
        try:
            await asyncio.wait_for(self._waiter, timeout)
        except TimeoutError:
            raise GuestdError(ErrorCode.TIMEOUT, f"{self.op}: no progress within {timeout} s") from None
        finally:
            self._waiter = None

    def on_event(self, body: dict[str, Any]) -> None:
        data = body.get("data")
        if isinstance(data, bytes):
            self.unacked += len(data)
            if self.unacked > self.conn.stream_window + self.conn.max_frame:
                raise GuestProtocolError(f"guest sent {self.unacked} stream bytes beyond the granted window")
        else:
            self.queued_small += 1
            if self.queued_small > MAX_PENDING_EVENTS:
                raise GuestProtocolError("guest flooded a stream with events")
        if self._events is None:
            self._events = deque()
        self._events.append(body)
        self._wake()

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
            await self._wait(timeout)
        body = self._events.popleft()
        data = body.get("data")
        if isinstance(data, bytes):
            self.unacked -= len(data)
            if not self.future.done():
                self.conn.send(Kind.WINDOW, self.id, {"bytes": len(data)})
        else:
            self.queued_small -= 1
        return body

    async def iter_events(self, timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
        while True:
            ev = await self.next_event(timeout)
            if ev is None:
                return
            yield ev

    def grant_input(self, n: int) -> None:
        self.input_credit += n
        self._wake()

    async def send_input(self, body: dict[str, Any], timeout: float | None = None) -> None:
        """Send one INPUT frame; a ``data`` chunk waits for the guest's WINDOW credit."""
        data = body.get("data")
        if isinstance(data, bytes):
            while self.input_credit <= 0 and not self.future.done():
                await self._wait(timeout)
            if self.future.done():
                return
            self.input_credit -= len(data)
            fields = {k: v for k, v in body.items() if k != "data"}
            self.conn.send_data(Kind.INPUT, self.id, fields, data)
        else:
            if self.future.done():
                return
            self.conn.send(Kind.INPUT, self.id, body)
        await self.conn.drain()

    def cancel(self) -> None:
        self.conn.send(Kind.CANCEL, self.id, {})


class ClientConnection(asyncio.Protocol):
    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, stream_window: int = DEFAULT_WINDOW) -> None:
        self.max_frame = max_frame
        self.stream_window = stream_window
        self.decoder = FrameDecoder(max_frame)
        self.transport: asyncio.Transport | None = None
        self.calls: dict[int, Call] = {}
        self.hello: dict[str, Any] | None = None
        self.loop = asyncio.get_running_loop()
        self._hello_future: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self._next_id = 1
        self._closed_exc: BaseException | None = None
        self._gate = WriteGate()

    # -- set-up ---------------------------------------------------------------------
    @classmethod
    async def open(
        cls,
        sock: socket.socket,
        *,
        timeout: float,
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
            await asyncio.wait_for(proto._handshake(token), timeout)
        except TimeoutError:
            proto.close()
            raise GuestdError(ErrorCode.TIMEOUT, f"no handshake reply within {timeout} s") from None
        except BaseException:
            proto.close()
            raise
        return proto

    async def _handshake(self, token: str | None) -> None:
        hello: dict[str, Any] = {
            "versions": [PROTOCOL_VERSION],
            "client": f"guestd-client/{__version__}",
            "max_frame": self.max_frame,
            "stream_window": self.stream_window,
            "time_ns": time.time_ns(),  # lets a guest that missed a restore notice its stale clock
        }
        if token is not None:
            hello["token"] = token
        self.send(Kind.HELLO, 0, hello)
        body = await self._hello_future
        self.hello = validate(HELLO_SERVER, body)
        # The server may lower, never raise, what we offered.
        self.stream_window = min(self.stream_window, self.hello["stream_window"])

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its API.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=2 * 1024 * 1024)

    def data_received(self, data: bytes) -> None:
        self.decoder.feed(data)
        try:
            while True:
                frame = self.decoder.next_frame()
                if frame is None:
                    return
                if isinstance(frame, OversizeFrame):
                    raise GuestProtocolError(f"guest sent a {frame.length}-byte frame (max {self.max_frame})")
                self._on_frame(frame.kind, frame.id, frame.payload)
        except FramingError as exc:
            self._abort(GuestProtocolError(str(exc)))
        except GuestdError as exc:
            self._abort(exc if isinstance(exc, GuestProtocolError) else GuestProtocolError(exc.message))

    def _on_frame(self, kind: int, req_id: int, payload: bytes) -> None:
        body = decode_body(payload)
        if kind == Kind.HELLO:
            if not self._hello_future.done():
                self._hello_future.set_result(body)
            return
        if kind == Kind.ERROR and req_id == 0:
            err = GuestdError.from_body(body)
            if not self._hello_future.done():
                self._hello_future.set_exception(err)
            self._abort(err)
            return
        call = self.calls.get(req_id)
        if call is None:
            return  # a late frame for a call we gave up on
        if kind == Kind.RESPONSE:
            del self.calls[req_id]
            spec = OPS_BY_NAME.get(call.op)
            try:
                checked = validate(spec.result, body) if spec is not None else body
            except GuestdError as err:
                call.finish(None, GuestProtocolError(f"malformed {call.op} reply: {err.message}"))
                return
            call.finish(checked, None)
        elif kind == Kind.ERROR:
            del self.calls[req_id]
            call.finish(None, GuestdError.from_body(body))
        elif kind == Kind.EVENT:
            call.on_event(body)
        elif kind == Kind.WINDOW:
            n = body.get("bytes")
            if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= self.stream_window * 4:
                call.grant_input(n)

    def connection_lost(self, exc: Exception | None) -> None:
        self._abort(ConnectionClosed(f"connection lost: {exc}" if exc else "connection closed by guest"))

    def pause_writing(self) -> None:
        self._gate.pause()

    def resume_writing(self) -> None:
        self._gate.resume()

    async def drain(self) -> None:
        if self._closed_exc is not None:
            raise self._closed_exc
        await self._gate.wait()

    def _abort(self, exc: BaseException) -> None:
        if self._closed_exc is None:
            self._closed_exc = exc
        if not self._hello_future.done():
            self._hello_future.set_exception(exc)
        calls, self.calls = self.calls, {}
        for call in calls.values():
            call.finish(None, exc)
        self._gate.release_all()
        if self.transport is not None:
            self.transport.close()

    # -- API ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed_exc is not None

    def close(self) -> None:
        self._abort(ConnectionClosed("closed by client"))

    def send(self, kind: int, req_id: int, body: dict[str, Any]) -> None:
        if self._closed_exc is not None:
            raise self._closed_exc
        assert self.transport is not None
        self.transport.write(encode_frame(kind, req_id, body))

    def send_data(self, kind: int, req_id: int, fields: dict[str, Any], data: bytes) -> None:
        if self._closed_exc is not None:
            raise self._closed_exc
        assert self.transport is not None
        head, body = encode_data_frame(kind, req_id, fields, data)
        self.transport.write(head)
        self.transport.write(body)

    def _alloc_id(self) -> int:
        while True:
            rid = self._next_id
            self._next_id = rid + 1 if rid < 0xFFFFFFFF else 1
            if rid not in self.calls:
                return rid

    def start(self, op: str, args: dict[str, Any]) -> Call:
        if self._closed_exc is not None:
            raise self._closed_exc
        call = Call(self, self._alloc_id(), op)
        self.calls[call.id] = call
        self.send(Kind.REQUEST, call.id, {"op": op, "args": args})
        return call

    async def wait(self, call: Call, timeout: float | None) -> dict[str, Any]:
        """Await the final reply; on our deadline cancel the request in the guest too."""
        handle = None
        if timeout is not None:
            handle = asyncio.get_running_loop().call_later(timeout, self._expire, call, timeout)
        try:
            return await call.future
        except asyncio.CancelledError:
            self._forget(call)
            raise
        finally:
            if handle is not None:
                handle.cancel()

    def _expire(self, call: Call, timeout: float) -> None:
        if call.future.done():
            return
        if self.calls.get(call.id) is call:
            del self.calls[call.id]
            try:
                call.cancel()
            except GuestdError:
                pass
        call.finish(None, GuestdError(ErrorCode.TIMEOUT, f"{call.op}: no reply within {timeout} s (request cancelled)"))

    def _forget(self, call: Call) -> None:
        if self.calls.get(call.id) is call:
            try:
                call.cancel()
            except GuestdError:
                pass
            del self.calls[call.id]
            call.future.cancel()
            call._wake()

    async def request(self, op: str, args: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        return await self.wait(self.start(op, args), timeout)
