"""One client connection: the asyncio adapter around the sans-I/O ``ServerSession``.

The session core (``guestd/wire/session.py``) owns every protocol rule: handshake,
ids, credit, frame sizes and the one-final-frame guarantee. This adapter moves
bytes between the transport and the core, runs each request's handler as a task,
and applies backpressure: while the transport's write buffer is above its
high-water mark it stops reading, so a peer that sends requests and never reads
the replies cannot make guestd buffer without bound.

It is an asyncio.BufferedProtocol so that the kernel reads frames straight into the
session's decoder (``get_buffer``/``buffer_updated``; transports that hand out bytes call
``data_received``), and inline ops (ping) are answered without creating a task.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from guestd.flow import WriteGate, widen_send_buffer
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.session import (
    CancelRequested,
    ConnectionFailed,
    CreditGranted,
    Event,
    HelloReceived,
    InputReceived,
    Phase,
    RequestAborted,
    RequestReceived,
    ServerSession,
    SessionReset,
    Stream,
)

if TYPE_CHECKING:
    from guestd.server.daemon import Daemon

log = logging.getLogger("guestd.connection")

SERIAL_STALL_S = 1.0
WRITE_HIGH_WATER = 2 * 1024 * 1024  # unsent bytes per connection before we stop reading from it
MAX_EARLY_SIGNALS = 16  # signals kept for a handler that has not started yet
BULK_REPLIES = 4  # replies held whole in memory (file.read, <= limits.max_read each) built at once per connection


class RequestContext:
    """What a handler sees of its request: stream sending with credit, input, cancel."""

    __slots__ = (
        "_credit_waiters",
        "_early_signals",
        "_input",
        "cancel_reason",
        "cancel_shielded",
        "conn",
        "id",
        "input_handler",
        "op",
        "signal_handler",
        "stream",
        "takes_data",
        "task",
    )

    def __init__(self, conn: Connection, stream: Stream) -> None:
        self.conn = conn
        self.stream = stream  # the core's handle: identity, not the id, decides what it acts on
        self.id = stream.id
        self.op = stream.op
        self.task: asyncio.Task[None] | None = None
        self._credit_waiters: list[asyncio.Future[None]] = []
        self._input: asyncio.Queue[dict[str, Any]] | None = None
        # Handlers that react to INPUT synchronously (exec signals) set this instead of reading ``input``.
        self.input_handler: Callable[[dict[str, Any]], None] | None = None
        self.signal_handler: Callable[[Any], None] | None = None
        self._early_signals: list[Any] = []
        self.takes_data = True
        # Set by a handler past its point of no return (an upload committing): a client
        # cancel then no longer interrupts it, and the reply says what really happened.
        self.cancel_shielded = False
        self.cancel_reason: str | None = None

    @property
    def active(self) -> bool:
        """False once the request's final frame went out (e.g. the core refused its input)."""
        return self.stream.open

    @property
    def connection(self) -> Connection:
        return self.conn

    @property
    def write_paused(self) -> bool:
        """The connection's unsent output is over its mark: producers should wait (drain)."""
        return self.conn.write_paused

    async def drain(self) -> None:
        """Until the connection takes more output, or this request has ended (its final frame
        sent, or its connection gone): a producer never waits for a client that has left."""
        if not self.stream.open:
            return  # ended: nothing of it is sent any more, so nothing waits for the peer
        if not self.conn.write_paused:
            await self.conn.drain()  # returns at once (or raises: the connection is closing)
            return
        ended = asyncio.get_running_loop().create_future()
        self._credit_waiters.append(ended)
        drained = asyncio.ensure_future(self.conn.drain())
        try:
            await asyncio.wait((drained, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if ended in self._credit_waiters:
                self._credit_waiters.remove(ended)
            if not drained.done():
                drained.cancel()
        if drained.done() and not drained.cancelled():
            drained.result()  # the connection closed: raise as conn.drain() does

    # -- server -> client stream ------------------------------------------------------
    async def send_event(self, body: dict[str, Any]) -> None:
        """Send one small, non-data EVENT (it needs no credit)."""
        self.post_event(body)
        await self.conn.drain()

    def post_event(self, body: dict[str, Any]) -> None:
        """Queue one non-data EVENT without waiting for the transport."""
        if self.conn.session.send_event(self.stream, body):
            self.conn.flush()

    async def send_data_event(self, fields: Mapping[str, Any], data: bytes | bytearray) -> None:
        """Send ``data`` as data EVENTs, each within the client's credit and max_frame.

        When ``fields`` has an ``offset`` it is the offset of ``data``'s first byte, and
        each frame carries the offset of its own first byte.
        """
        session = self.conn.session
        fields = dict(fields)
        view = memoryview(data)
        while view:
            room = session.data_room(self.stream, fields)
            if room <= 0:
                if not self.active:
                    return
                await self.wait_credit()
                continue
            piece = data if room >= len(view) and len(view) == len(data) else bytes(view[:room])
            session.send_data(self.stream, fields, piece)
            self.conn.flush()
            view = view[len(piece) :]
            if "offset" in fields:
                fields["offset"] += len(piece)
            await self.conn.drain()

    @property
    def max_frame(self) -> int:
        """The largest frame payload the client takes: replies and events must fit it."""
        return self.conn.session.peer_max_frame

    def data_room(self, fields: Mapping[str, Any]) -> int:
        """Data bytes the next frame may carry now (0: out of credit, or the request ended)."""
        return self.conn.session.data_room(self.stream, fields)

    def push_data(self, fields: Mapping[str, Any], data: bytes | bytearray) -> None:
        """Queue one data EVENT of at most :meth:`data_room` bytes without waiting."""
        if self.conn.session.send_data(self.stream, fields, data):
            self.conn.flush()

    async def wait_credit(self) -> None:
        """Until the client grants credit (or the request ends). Several tasks of one
        request may wait at once (exec's reader and its final drain); each is woken."""
        while self.stream.open and self.stream.send_credit <= 0:
            waiter = asyncio.get_running_loop().create_future()
            self._credit_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._credit_waiters:
                    self._credit_waiters.remove(waiter)

    async def wait_room(self, fields: Mapping[str, Any], nbytes: int) -> None:
        """Until one data EVENT with ``fields`` may carry ``nbytes`` whole (or the request
        ends): for events whose data must not be split (a grep line, a watched path)."""
        while self.stream.open and self.conn.session.data_room(self.stream, fields) < nbytes:
            waiter = asyncio.get_running_loop().create_future()
            self._credit_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._credit_waiters:
                    self._credit_waiters.remove(waiter)

    def on_credit(self) -> None:
        waiters, self._credit_waiters = self._credit_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def end(self) -> None:
        """The request is over (final frame sent, or forgotten with its connection): every task
        still waiting for its credit or its connection's drain (a shielded final drain, a
        paused reader) wakes, sees the stream closed and drops what is left instead of
        holding its session, context or process for a client that will never read."""
        self.on_credit()

    # -- client -> server input -------------------------------------------------------
    @property
    def input(self) -> asyncio.Queue[dict[str, Any]]:
        if self._input is None:
            self._input = asyncio.Queue()
        return self._input

    def push_input(self, body: dict[str, Any]) -> None:
        # A signal never waits behind data (a process that does not read its stdin must
        # still be interruptible), nor for the handler to start: it goes to the signal
        # handler at once, or is kept for it.
        signal = body.pop("signal", None)
        if signal is not None:
            if self.signal_handler is not None:
                self.signal_handler(signal)
            elif len(self._early_signals) < MAX_EARLY_SIGNALS:
                self._early_signals.append(signal)
        if not body or (body.get("data") == b"" and not body.get("eof")):
            return  # nothing left to deliver (empty data frames cost no credit: never queue them)
        if self.input_handler is not None:
            self.input_handler(body)
        elif self.takes_data:
            self.input.put_nowait(body)

    def handle_signals(self, handler: Callable[[Any], None]) -> None:
        """Apply INPUT signals with ``handler`` from now on; signals that arrived before
        (in the same read as the request, say) are applied first, not lost."""
        self.signal_handler = handler
        early, self._early_signals = self._early_signals, []
        for signal in early:
            handler(signal)

    def stop_taking_data(self) -> None:
        """The handler reads no more data or eof (stdin given whole, or closed): later ones
        are dropped instead of queued for nobody."""
        self.takes_data = False
        if self._input is not None:
            while not self._input.empty():
                self._input.get_nowait()

    def ack_input(self, nbytes: int) -> None:
        """Tell the client it may send ``nbytes`` more (after we consumed them)."""
        self.conn.session.ack_input(self.stream, nbytes)
        self.conn.flush()

    def commit(self) -> None:
        """Past the point of no return (an upload's eof taken): a client cancel no longer
        interrupts the request and later input is ignored, so the reply reports what
        really happened."""
        self.cancel_shielded = True
        self.conn.session.close_input(self.stream)

    def cancel(self, reason: str) -> None:
        if self.task is not None and not self.task.done():
            self.cancel_reason = self.cancel_reason or reason
            self.task.cancel(msg=reason)


Handler = Callable[[RequestContext, Any], Awaitable[Mapping[str, Any]]]

_CANCEL_ERRORS = {
    "cancel": "request cancelled",
    "shutdown": "guestd is shutting down",
}


class Connection(asyncio.BufferedProtocol):
    def __init__(self, daemon: Daemon, transport_name: str, serial: bool = False) -> None:
        self.daemon = daemon
        self.limits = daemon.config.limits
        self.transport_name = transport_name
        self.serial = serial
        self.session_id = os.urandom(8).hex()
        self.session = ServerSession(
            ops=daemon.dispatcher.specs,
            max_frame=self.limits.max_frame,
            stream_window=self.limits.stream_window,
            max_inflight=self.limits.max_inflight,
            limits=self.limits,
            serial=serial,
        )
        self.transport: asyncio.BaseTransport | None = None
        self.peer = "?"
        self.opened_at = time.monotonic()
        self.requests: dict[Stream, RequestContext] = {}
        self._bulk_replies = asyncio.Semaphore(BULK_REPLIES)
        self._gate = WriteGate()
        self._closing = False
        self._last_fed = 0.0  # loop time of the last bytes, for serial stall detection
        self._stall_handle: asyncio.TimerHandle | None = None
        self._hello_timer: asyncio.TimerHandle | None = None
        self._hello_just_accepted = False

    # -- what the rest of the daemon reads -------------------------------------------------
    @property
    def version(self) -> int | None:
        return self.session.version

    @property
    def stream_window(self) -> int:
        return self.session.stream_window

    @property
    def peer_max_frame(self) -> int:
        return self.session.peer_max_frame

    @property
    def awaiting_hello(self) -> bool:
        return self.session.phase is Phase.AWAIT_HELLO and not self.serial

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.peer = str(transport.get_extra_info("peername") or "?")
        self._closing = False
        set_limits = getattr(transport, "set_write_buffer_limits", None)
        if set_limits is not None:
            set_limits(high=WRITE_HIGH_WATER)
        widen_send_buffer(transport.get_extra_info("socket"))
        if not self.daemon.connection_opened(self):
            self.refuse(GuestdError(ErrorCode.LIMIT, "too many connections", details={"limit": "max_connections"}))
            return
        refused = self.daemon.config.policy.peer_allowed(transport.get_extra_info("socket"))
        if refused is not None:
            self.refuse(GuestdError(ErrorCode.PERMISSION_DENIED, refused, details={"policy": "allowed_uids"}))
            return
        if not self.serial:
            # A peer that never says hello must not hold a connection slot.
            timeout = self.limits.hello_timeout_s
            self._hello_timer = asyncio.get_running_loop().call_later(timeout, self._hello_expired, timeout)

    def _hello_expired(self, timeout: float) -> None:
        self._hello_timer = None
        if self.session.phase is Phase.AWAIT_HELLO:
            self.refuse(
                GuestdError(ErrorCode.TIMEOUT, f"no hello within {timeout} s", details={"limit": "hello_timeout_s"})
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        for handle in (self._stall_handle, self._hello_timer):
            if handle is not None:
                handle.cancel()
        self._cancel_all("connection lost")
        self._gate.release_all()
        self.daemon.connection_closed(self)

    def _cancel_all(self, reason: str) -> None:
        for ctx in list(self.requests.values()):
            self.session.forget(ctx.stream)
            ctx.cancel(reason)
            ctx.end()
        self.requests.clear()

    def peer_reset(self) -> None:
        """A serial peer went away: drop its requests and partial frame; await a new hello."""
        self.session.reset_peer()
        self._cancel_all("connection lost")

    def _stall_check(self) -> None:
        # A partial frame with no bytes for SERIAL_STALL_S: its sender is gone (a host
        # that disconnected mid-frame without the port reporting hang-up). Forget it so
        # the next host's hello is not swallowed as the rest of the old frame.
        self._stall_handle = None
        decoder = self.session.decoder
        if not decoder.buffered or self._closing:
            return
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self._last_fed
        if quiet < SERIAL_STALL_S:
            self._stall_handle = loop.call_later(SERIAL_STALL_S - quiet, self._stall_check)
            return
        log.warning("serial: dropped a %d-byte partial frame after %.1f s of silence", decoder.buffered, quiet)
        decoder.reset()

    @property
    def write_paused(self) -> bool:
        return self._gate.paused

    def pause_writing(self) -> None:
        # The peer is not reading: stop reading its requests too, so replies cannot pile up.
        self._gate.pause()
        pause = getattr(self.transport, "pause_reading", None)
        if pause is not None and not self._closing:
            pause()

    def resume_writing(self) -> None:
        self._gate.resume()
        resume = getattr(self.transport, "resume_reading", None)
        if resume is not None and not self._closing:
            resume()

    async def drain(self) -> None:
        if self._closing:
            raise ConnectionResetError("connection closed")
        await self._gate.wait()
        if self._closing:
            raise ConnectionResetError("connection closed")

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.session.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self.serial:
            self._fed()
        self._on_events(self.session.buffer_updated(nbytes))
        self.flush()

    def data_received(self, data: bytes) -> None:
        if self.serial:
            self._fed()
        self._on_events(self.session.receive_data(data))
        self.flush()

    def _fed(self) -> None:
        loop = asyncio.get_running_loop()
        self._last_fed = loop.time()
        if self._stall_handle is None:
            self._stall_handle = loop.call_later(SERIAL_STALL_S, self._stall_check)

    def eof_received(self) -> bool | None:
        return None  # close the transport

    # -- sending ------------------------------------------------------------------------
    def flush(self) -> None:
        """Hand what the session queued to the transport."""
        if not self.session.has_output:
            return
        out = self.session.data_to_send()
        if self.transport is None or self._closing:
            return
        write = self.transport.write  # type: ignore[attr-defined]
        for chunk in out:
            write(chunk)

    def refuse(self, error: GuestdError) -> None:
        """End the connection with a connection-level error (id 0).

        A peer that does not read (output is still buffered after the error went to the
        transport) is cut off at once rather than closed gracefully: a graceful close
        waits for the buffer to drain, which would keep its slot, fd and buffer forever.
        """
        self.session.refuse(error)
        self.flush()
        transport = self.transport
        unread = transport is not None and transport.get_write_buffer_size() > 0  # type: ignore[attr-defined]
        self.close()
        if unread and transport is not None:
            transport.abort()  # type: ignore[attr-defined]

    def close(self) -> None:
        if self.transport is not None and not self._closing:
            self.flush()
            self._closing = True
            self.transport.close()

    # -- events from the session --------------------------------------------------------
    def _on_events(self, events: list[Event]) -> None:
        # A loop, not recursion: each accepted hello releases the frames behind it, which
        # may hold another hello (a serial host starting over), and so on.
        while events:
            for event in events:
                if self._closing:
                    return  # refused or closed: nothing after that may take effect
                try:
                    self._on_event(event)
                except Exception:  # a bug must cost one request, never the daemon
                    log.exception("handling %s failed", type(event).__name__)
                    if isinstance(event, RequestReceived):
                        self.session.fail(
                            event.stream, GuestdError(ErrorCode.INTERNAL, "internal error handling frame")
                        )
            events = self.session.resume() if self.session.phase is Phase.OPEN and self._hello_just_accepted else []
            self._hello_just_accepted = False

    def _on_event(self, event: Event) -> None:
        if isinstance(event, RequestReceived):
            self._on_request(event)
        elif isinstance(event, InputReceived):
            ctx = self.requests.get(event.stream)
            if ctx is not None:
                ctx.push_input(event.body)
        elif isinstance(event, CreditGranted):
            ctx = self.requests.get(event.stream)
            if ctx is not None:
                ctx.on_credit()
        elif isinstance(event, CancelRequested):
            ctx = self.requests.get(event.stream)
            if ctx is not None and not ctx.cancel_shielded:
                ctx.cancel("cancel")
        elif isinstance(event, RequestAborted):
            # The core already sent the final ERROR; the handler only has to stop.
            ctx = self.requests.pop(event.stream, None)
            if ctx is not None:
                ctx.cancel("aborted")
                ctx.end()
        elif isinstance(event, HelloReceived):
            self._on_hello(event.hello)
        elif isinstance(event, SessionReset):
            log.info("serial: new host session")
            for stream in event.dropped:
                ctx = self.requests.pop(stream, None)
                if ctx is not None:
                    ctx.cancel("connection lost")
        elif isinstance(event, ConnectionFailed):
            self.close()

    def _on_hello(self, hello: dict[str, Any]) -> None:
        # Nothing in a hello takes effect before the token check passes, and the frames
        # after it wait in the session until then.
        refused = self.daemon.check_token(hello.get("token"))
        if refused is not None:
            self.refuse(GuestdError(ErrorCode.PERMISSION_DENIED, refused))
            return
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self.session.accept_hello(lambda _session: self.daemon.hello_body(self))
        self._hello_just_accepted = True  # _on_events then releases the frames behind the hello
        self.daemon.snapshot.check_host_time(hello.get("time_ns"))

    def _on_request(self, event: RequestReceived) -> None:
        stream, args = event.stream, event.args
        daemon = self.daemon
        try:
            daemon.config.policy.check_op(stream.op)
        except GuestdError as err:
            self.session.fail(stream, err)
            return
        daemon.replied()  # runs after this callback, once the reply of an inline op is written
        try:
            # The core admitted only ops that are served; a declared capability registers now.
            route = daemon.dispatcher.route(stream.op)
        except GuestdError as err:
            self.session.fail(stream, err)
            return
        gate = daemon.snapshot.gate(stream.op)
        if route.inline is not None and gate is None:
            try:
                self.session.respond(stream, route.inline(args))
            except GuestdError as err:
                self.session.fail(stream, err)
            return
        handler: Handler = route.handler if route.handler is not None else _as_handler(route.inline)
        ctx = RequestContext(self, stream)
        self.requests[stream] = ctx
        ctx.task = asyncio.get_running_loop().create_task(self._run(ctx, handler, args, gate, route.bulk_reply))
        ctx.task.add_done_callback(lambda _task: self._task_done(ctx))

    async def _run(
        self,
        ctx: RequestContext,
        handler: Handler,
        args: dict[str, Any],
        gate: asyncio.Event | None,
        bulk_reply: bool,
    ) -> None:
        try:
            if gate is not None:
                await gate.wait()  # a restore (or a quiescing prepare) is in progress
            if bulk_reply:
                # A reply held in memory in full (file.read): at most a few are built at
                # once per connection, and none while the client is not reading.
                async with self._bulk_replies:
                    await self.drain()
                    result = await handler(ctx, args)
                    self.session.respond(ctx.stream, result)
                    self.flush()
                    return
            result = await handler(ctx, args)
        except asyncio.CancelledError:
            self._finish_cancelled(ctx)
            if ctx.cancel_reason == "shutdown":
                raise
            return
        except GuestdError as err:
            self.session.fail(ctx.stream, err)
        except OSError as exc:
            self.session.fail(ctx.stream, GuestdError.from_os_error(exc))
        except Exception as exc:
            log.exception("op %s failed", ctx.op)
            self.session.fail(ctx.stream, GuestdError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        else:
            self.session.respond(ctx.stream, result)
        self.flush()

    def _finish_cancelled(self, ctx: RequestContext) -> None:
        reason = ctx.cancel_reason or "cancel"
        message = _CANCEL_ERRORS.get(reason, "request cancelled")
        self.session.fail(ctx.stream, GuestdError(ErrorCode.CANCELLED, message, details={"reason": reason}))
        self.flush()

    def _task_done(self, ctx: RequestContext) -> None:
        # A task cancelled before it first ran never executes _run's handlers: the
        # final frame is sent here, so every request ends with exactly one. The handle
        # is the request's own: a newer request that reuses the id is never touched.
        if self.requests.get(ctx.stream) is ctx:
            del self.requests[ctx.stream]
        if ctx.stream.open:
            self._finish_cancelled(ctx)
        ctx.end()


def _as_handler(inline: Any) -> Handler:
    async def handler(ctx: RequestContext, args: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = inline(args)
        return result

    return handler
