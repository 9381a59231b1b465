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

What it needs of the server is a :class:`~guestd.server.host.ConnectionHost` (the daemon is
one): limits, ops, a slot, the peer and token checks, the hello, and the admission chain that
every request passes first (guestd/server/admission.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from guestd.flow import WriteGate, widen_send_buffer
from guestd.server.admission import REPLIED
from guestd.server.request import RequestContext
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
    from guestd.server.admission import Gate
    from guestd.server.host import ConnectionHost
    from guestd.server.request import Handler

log = logging.getLogger("guestd.connection")

SERIAL_STALL_S = 1.0
WRITE_HIGH_WATER = 2 * 1024 * 1024  # unsent bytes per connection before we stop reading from it


_CANCEL_ERRORS = {
    "cancel": "request cancelled",
    "shutdown": "guestd is shutting down",
}


class Connection(asyncio.BufferedProtocol):
    def __init__(self, host: ConnectionHost, transport_name: str, serial: bool = False) -> None:
        self.host = host
        self._admit = host.admit  # every request goes through it: looked up once
        self.limits = host.limits
        self.transport_name = transport_name
        self.serial = serial
        self.session_id = os.urandom(8).hex()
        self.session = ServerSession(
            ops=host.op_specs,
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
        self.step_state: dict[object, Any] = {}  # what admission steps keep per connection
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
        if not self.host.connection_opened(self):
            self.refuse(GuestdError(ErrorCode.LIMIT, "too many connections", details={"limit": "max_connections"}))
            return
        refused = self.host.check_peer(transport.get_extra_info("socket"))
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
        self.host.connection_closed(self)

    def cancel_requests(self, reason: str) -> list[asyncio.Task[None]]:
        """Cancel every request running (guestd shutting down); their tasks, to wait for."""
        tasks = []
        for ctx in list(self.requests.values()):
            if ctx.task is not None:
                tasks.append(ctx.task)
                ctx.cancel(reason)
        return tasks

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
        refused = self.host.check_token(hello.get("token"))
        if refused is not None:
            self.refuse(GuestdError(ErrorCode.PERMISSION_DENIED, refused))
            return
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self.session.accept_hello(lambda _session: self.host.hello_body(self))
        self._hello_just_accepted = True  # _on_events then releases the frames behind the hello
        self.host.on_hello(hello)

    def _on_request(self, event: RequestReceived) -> None:
        stream = event.stream
        try:
            # The admission chain (guestd/server/admission.py): policy, the route (the core admitted
            # only ops that are served; a declared capability registers now), the gates.
            route, handler, gate = self._admit(stream.op, self)
        except GuestdError as err:
            self.session.fail(stream, err)
            return
        inline = route.inline
        if inline is not None and gate is None:
            try:
                self.session.respond(stream, inline(event.args))
            except GuestdError as err:
                self.session.fail(stream, err)
            return
        ctx = RequestContext(self, stream)
        self.requests[stream] = ctx
        ctx.task = asyncio.get_running_loop().create_task(self._run(ctx, handler, event.args, gate))
        ctx.task.add_done_callback(lambda _task: self._task_done(ctx))

    async def _run(self, ctx: RequestContext, handler: Handler, args: dict[str, Any], gate: Gate | None) -> None:
        try:
            if gate is not None:
                await gate.wait()  # e.g. a restore (or a quiescing prepare) is in progress
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
            if result is not REPLIED:  # a step that sent it itself (the bulk-reply bound)
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
