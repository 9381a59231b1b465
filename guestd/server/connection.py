"""One client connection: handshake, request routing, streams, cancellation.

The connection is an asyncio.Protocol so that frames are decoded straight from
``data_received`` and inline ops (ping) are answered without creating a task.
It only needs ``write``/``close``/``get_extra_info`` and flow-control callbacks from
its transport, so sockets and the serial/vsock fd transport look the same.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from guestd.flow import WriteGate
from guestd.wire.errors import ErrorCode, GuestdError, too_large
from guestd.wire.frames import (
    HEADER_SIZE,
    Frame,
    FrameDecoder,
    FramingError,
    Kind,
    OversizeFrame,
    encode_data_frame,
    encode_frame,
)
from guestd.wire.messages import decode_body, split_request
from guestd.wire.schema import HELLO_CLIENT, SUPPORTED_VERSIONS, WINDOW_BODY, validate

if TYPE_CHECKING:
    from guestd.server.daemon import Daemon

log = logging.getLogger("guestd.connection")

SERIAL_STALL_S = 1.0


class RequestContext:
    """What a handler sees of its request: stream sending with credit, input, cancel."""

    __slots__ = (
        "_credit",
        "_credit_waiter",
        "_input",
        "_input_granted",
        "accepts_input",
        "conn",
        "id",
        "input_handler",
        "op",
        "task",
    )

    def __init__(self, conn: Connection, req_id: int, op: str, accepts_input: bool) -> None:
        self.conn = conn
        self.id = req_id
        self.op = op
        self.task: asyncio.Task[None] | None = None
        self._credit = conn.stream_window
        self._credit_waiter: asyncio.Future[None] | None = None
        self.accepts_input = accepts_input
        self._input: asyncio.Queue[dict[str, Any]] | None = None
        # Handlers that react to INPUT synchronously (exec signals) set this instead of reading ``input``.
        self.input_handler: Callable[[dict[str, Any]], None] | None = None
        # Input bytes the client may still send before we grant more.
        self._input_granted = conn.stream_window if accepts_input else 0

    # -- server -> client stream ------------------------------------------------------
    async def send_event(self, body: dict[str, Any]) -> None:
        """Send one small, non-data EVENT (it needs no credit)."""
        self.conn.send(Kind.EVENT, self.id, body)
        await self.conn.drain()

    async def send_data_event(self, fields: dict[str, Any], data: bytes) -> None:
        """Send one data EVENT within the client's WINDOW credit."""
        await self.wait_credit()
        self._credit -= len(data)
        self.conn.send_data(Kind.EVENT, self.id, fields, data)
        await self.conn.drain()

    def has_credit(self) -> bool:
        return self._credit > 0

    async def wait_credit(self) -> None:
        while self._credit <= 0:
            self._credit_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._credit_waiter
            finally:
                self._credit_waiter = None

    def take_credit(self, nbytes: int) -> None:
        self._credit -= nbytes

    def grant(self, nbytes: int) -> None:
        self._credit += nbytes
        w = self._credit_waiter
        if self._credit > 0 and w is not None and not w.done():
            w.set_result(None)

    # -- client -> server input -------------------------------------------------------
    @property
    def input(self) -> asyncio.Queue[dict[str, Any]]:
        if self._input is None:
            self._input = asyncio.Queue()
        return self._input

    def push_input(self, body: dict[str, Any]) -> None:
        data = body.get("data")
        if isinstance(data, bytes):
            self._input_granted -= len(data)
            if self._input_granted < 0:
                # The client ignored flow control: fail this request, not the connection.
                if self.task is not None:
                    self.task.cancel(msg="window")
                return
        if self.input_handler is not None:
            self.input_handler(body)
        else:
            self.input.put_nowait(body)

    def ack_input(self, nbytes: int) -> None:
        """Tell the client it may send ``nbytes`` more (after we consumed them)."""
        if nbytes > 0:
            self._input_granted += nbytes
            self.conn.send(Kind.WINDOW, self.id, {"bytes": nbytes})


class Connection(asyncio.Protocol):
    def __init__(self, daemon: Daemon, transport_name: str, serial: bool = False) -> None:
        self.daemon = daemon
        self.limits = daemon.config.limits
        self.transport_name = transport_name
        self.serial = serial  # serial links resync instead of closing on bad framing
        self.session = os.urandom(8).hex()
        self.decoder = FrameDecoder(self.limits.max_frame)
        self.transport: asyncio.BaseTransport | None = None
        self.peer = "?"
        self.version: int | None = None
        self.peer_max_frame = self.limits.max_frame
        self.stream_window = self.limits.stream_window
        self.inflight: dict[int, RequestContext] = {}
        self._gate = WriteGate()
        self._closing = False
        self._last_fed = 0.0  # loop time of the last bytes, for serial stall detection
        self._stall_handle: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.peer = str(transport.get_extra_info("peername") or "?")
        self._closing = False
        set_limits = getattr(transport, "set_write_buffer_limits", None)
        if set_limits is not None:
            set_limits(high=2 * 1024 * 1024)
        if not self.daemon.connection_opened(self):
            self._fatal(ErrorCode.LIMIT, "too many connections", {"limit": "max_connections"})
            return
        refused = self.daemon.config.policy.peer_allowed(transport.get_extra_info("socket"))
        if refused is not None:
            self._fatal(ErrorCode.PERMISSION_DENIED, refused, {"policy": "allowed_uids"})

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if self._stall_handle is not None:
            self._stall_handle.cancel()
        self._cancel_all()
        self._gate.release_all()
        self.daemon.connection_closed(self)

    def _cancel_all(self) -> None:
        for ctx in list(self.inflight.values()):
            if ctx.task is not None:
                ctx.task.cancel()
        self.inflight.clear()

    def peer_reset(self) -> None:
        """A serial peer went away: drop its requests and partial frame; await a new hello."""
        self._cancel_all()
        self.decoder.reset()
        self.version = None

    def _stall_check(self) -> None:
        # A partial frame with no bytes for SERIAL_STALL_S: its sender is gone (a host
        # that disconnected mid-frame without the port reporting hang-up). Forget it so
        # the next host's hello is not swallowed as the rest of the old frame.
        self._stall_handle = None
        if not self.decoder.buffered or self._closing:
            return
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self._last_fed
        if quiet < SERIAL_STALL_S:
            self._stall_handle = loop.call_later(SERIAL_STALL_S - quiet, self._stall_check)
            return
        log.warning("serial: dropped a %d-byte partial frame after %.1f s of silence", self.decoder.buffered, quiet)
        self.decoder.reset()

    @property
    def write_paused(self) -> bool:
        return self._gate.paused

    def pause_writing(self) -> None:
        self._gate.pause()

    def resume_writing(self) -> None:
        self._gate.resume()

    async def drain(self) -> None:
        if self._closing:
            raise ConnectionResetError("connection closed")
        await self._gate.wait()
        if self._closing:
            raise ConnectionResetError("connection closed")

    def data_received(self, data: bytes) -> None:
        self.decoder.feed(data)
        if self.serial:
            loop = asyncio.get_running_loop()
            self._last_fed = loop.time()
            if self._stall_handle is None:
                self._stall_handle = loop.call_later(SERIAL_STALL_S, self._stall_check)
        self._drain_frames()

    def _drain_frames(self) -> None:
        while not self._closing:
            try:
                frame = self.decoder.next_frame()
            except FramingError as exc:
                if self.serial:
                    dropped = self.decoder.resync()
                    log.warning("serial: %s; resynced, dropped %d bytes", exc, dropped)
                    continue
                self._fatal(ErrorCode.PROTOCOL_ERROR, str(exc))
                return
            if frame is None:
                return
            if isinstance(frame, OversizeFrame):
                self._on_oversize(frame)
                continue
            try:
                self._on_frame(frame)
            except Exception:  # a bug must cost one request, never the daemon
                log.exception("frame handling failed")
                if frame.kind == Kind.REQUEST:
                    self.send_error(frame.id, GuestdError(ErrorCode.INTERNAL, "internal error handling frame"))

    def eof_received(self) -> bool | None:
        return None  # close the transport

    # -- sending ------------------------------------------------------------------------
    def send(self, kind: int, req_id: int, body: dict[str, Any]) -> None:
        if self._closing or self.transport is None:
            return
        data = encode_frame(kind, req_id, body)
        if len(data) - HEADER_SIZE > self.peer_max_frame:
            if kind == Kind.EVENT:
                raise AssertionError("event larger than the peer's max_frame")
            err = too_large("max_frame", len(data) - HEADER_SIZE, "reply larger than the client's max_frame")
            data = encode_frame(Kind.ERROR, req_id, err.to_body())
        self.transport.write(data)  # type: ignore[attr-defined]

    def send_data(self, kind: int, req_id: int, fields: dict[str, Any], data: bytes) -> None:
        """Send ``{**fields, "data": data}`` without copying ``data`` into a frame buffer."""
        if self._closing or self.transport is None:
            return
        head, body = encode_data_frame(kind, req_id, fields, data)
        self.transport.write(head)  # type: ignore[attr-defined]
        self.transport.write(body)  # type: ignore[attr-defined]

    def send_error(self, req_id: int, err: GuestdError) -> None:
        self.send(Kind.ERROR, req_id, err.to_body())

    def _fatal(self, code: ErrorCode, message: str, details: dict[str, Any] | None = None) -> None:
        self.send_error(0, GuestdError(code, message, details=details))
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self._closing:
            self._closing = True
            self.transport.close()

    # -- receiving ----------------------------------------------------------------------
    def _on_oversize(self, frame: OversizeFrame) -> None:
        err = too_large(
            "max_frame", frame.length, f"frame of {frame.length} bytes exceeds max_frame {self.limits.max_frame}"
        )
        if frame.kind == Kind.REQUEST:
            self.send_error(frame.id, err)
        elif frame.kind == Kind.INPUT:
            ctx = self.inflight.get(frame.id)
            if ctx is not None and ctx.task is not None:
                ctx.task.cancel(msg="oversize")
        elif frame.kind == Kind.HELLO:
            self._fatal(ErrorCode.TOO_LARGE, "oversize hello")

    def _on_frame(self, frame: Frame) -> None:
        kind = frame.kind
        if kind == Kind.REQUEST:
            self._on_request(frame)
        elif kind == Kind.INPUT:
            ctx = self.inflight.get(frame.id)
            if ctx is None or not ctx.accepts_input:
                return  # finished or never streaming: late input is dropped by design
            try:
                ctx.push_input(decode_body(frame.payload))
            except GuestdError:
                if ctx.task is not None:
                    ctx.task.cancel(msg="bad input")
        elif kind == Kind.WINDOW:
            ctx = self.inflight.get(frame.id)
            if ctx is None:
                return
            try:
                n = validate(WINDOW_BODY, decode_body(frame.payload))["bytes"]
            except GuestdError:
                return
            ctx.grant(n)
        elif kind == Kind.CANCEL:
            ctx = self.inflight.get(frame.id)
            if ctx is not None and ctx.task is not None:
                ctx.task.cancel(msg="cancel")
        elif kind == Kind.HELLO:
            self._on_hello(frame)
        # Unknown kinds are ignored so that later protocol revisions can add them.

    def _on_hello(self, frame: Frame) -> None:
        if self.version is not None:
            if not self.serial:
                self.send_error(0, GuestdError(ErrorCode.PROTOCOL_ERROR, "hello sent twice"))
                return
            # On a serial port a new hello means a new host session: drop the old one's requests.
            log.info("serial: new host session")
            self._cancel_all()
            self.version = None
        try:
            hello = validate(HELLO_CLIENT, decode_body(frame.payload))
        except GuestdError as err:
            self._fatal(
                ErrorCode(err.code) if err.code in ErrorCode._value2member_map_ else ErrorCode.BAD_REQUEST,
                f"bad hello: {err.message}",
            )
            return
        common = [v for v in hello["versions"] if v in SUPPORTED_VERSIONS]
        if not common:
            self.send_error(
                0,
                GuestdError(
                    ErrorCode.UNSUPPORTED_VERSION,
                    f"no common protocol version; server speaks {list(SUPPORTED_VERSIONS)}",
                    details={"supported": list(SUPPORTED_VERSIONS)},
                ),
            )
            self.close()
            return
        if hello["max_frame"] is not None:
            self.peer_max_frame = max(64 * 1024, min(hello["max_frame"], self.limits.max_frame))
        if hello["stream_window"] is not None:
            # A sender may overshoot its credit by one chunk; receivers allow for that.
            self.stream_window = max(64 * 1024, min(hello["stream_window"], self.limits.stream_window))
        self.daemon.snapshot.check_host_time(hello.get("time_ns"))
        auth = self.daemon.check_token(hello.get("token"))
        if auth is not None:
            self._fatal(ErrorCode.PERMISSION_DENIED, auth)
            return
        self.version = max(common)
        self.send(Kind.HELLO, 0, self.daemon.hello_body(self))

    def _on_request(self, frame: Frame) -> None:
        req_id = frame.id
        if self.version is None:
            self.send_error(req_id, GuestdError(ErrorCode.PROTOCOL_ERROR, "send hello before any request"))
            return
        if req_id in self.inflight:
            self.send_error(req_id, GuestdError(ErrorCode.BAD_REQUEST, f"request id {req_id} is already in flight"))
            return
        if len(self.inflight) >= self.limits.max_inflight:
            self.send_error(
                req_id,
                GuestdError(
                    ErrorCode.LIMIT,
                    f"more than {self.limits.max_inflight} requests in flight",
                    details={"limit": "max_inflight", "value": self.limits.max_inflight},
                ),
            )
            return
        try:
            op, raw_args = split_request(decode_body(frame.payload))
            route = self.daemon.dispatcher.lookup(op)
            args = validate(route.spec.args, raw_args)
            self.daemon.config.policy.check_op(op)
        except GuestdError as err:
            self.send_error(req_id, err)
            return
        gate = self.daemon.snapshot.gate(op)
        if route.inline is not None and gate is None:
            try:
                self.send(Kind.RESPONSE, req_id, route.inline(args))
            except GuestdError as err:
                self.send_error(req_id, err)
            return
        handler = route.handler if route.handler is not None else _as_handler(route.inline)
        ctx = RequestContext(self, req_id, op, accepts_input=bool(route.spec.input))
        self.inflight[req_id] = ctx
        ctx.task = asyncio.get_running_loop().create_task(self._run(ctx, handler, args, gate))

    async def _run(self, ctx: RequestContext, handler: Any, args: dict[str, Any], gate: asyncio.Event | None) -> None:
        try:
            if gate is not None:
                await gate.wait()  # a restore (or a quiescing prepare) is in progress
            result = await handler(ctx, args)
        except asyncio.CancelledError as exc:
            reason = str(exc.args[0]) if exc.args else "cancel"
            if reason == "window":
                err = GuestdError(
                    ErrorCode.LIMIT, "client sent input beyond its window", details={"limit": "stream_window"}
                )
            elif reason == "oversize":
                err = too_large("max_frame", 0, "an input frame exceeded max_frame")
            elif reason == "bad input":
                err = GuestdError(ErrorCode.BAD_REQUEST, "an input frame was not a valid msgpack map")
            else:
                err = GuestdError(ErrorCode.CANCELLED, "request cancelled")
            self._finish(ctx, err)
            if reason == "shutdown":
                raise
            return
        except GuestdError as err:
            self._finish(ctx, err)
            return
        except OSError as exc:
            self._finish(ctx, GuestdError.from_os_error(exc))
            return
        except Exception as exc:
            log.exception("op %s failed", ctx.op)
            self._finish(ctx, GuestdError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
            return
        if self.inflight.get(ctx.id) is ctx:
            del self.inflight[ctx.id]
            self.send(Kind.RESPONSE, ctx.id, result)

    def _finish(self, ctx: RequestContext, err: GuestdError) -> None:
        if self.inflight.get(ctx.id) is ctx:
            del self.inflight[ctx.id]
            self.send_error(ctx.id, err)


def _as_handler(inline: Any) -> Any:
    async def handler(ctx: RequestContext, args: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = inline(args)
        return result

    return handler
