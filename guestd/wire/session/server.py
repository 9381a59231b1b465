"""The session core's server half: the hello handshake and its negotiated limits, request
admission (ids, in-flight bound, args checked against the schema), input guarded by credit,
and exactly one final frame per request."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from guestd.wire.errors import ErrorCode, GuestdError, too_large
from guestd.wire.frames import HEADER_SIZE, Frame, FramingError, OversizeFrame, encode_frame
from guestd.wire.messages import decode_body, split_request
from guestd.wire.schema import ERROR_ONLY, HELLO_CLIENT, SUPPORTED_VERSIONS, OpSpec, validate, validate_args
from guestd.wire.session.core import (
    _AWAIT_HELLO,
    _CANCEL,
    _CLOSED,
    _ERROR,
    _EVENT,
    _HELLO,
    _HELLO_PENDING,
    _INPUT,
    _OPEN,
    _REQUEST,
    _RESPONSE,
    _WINDOW,
    MIN_MAX_FRAME,
    MIN_STREAM_WINDOW,
    Session,
)
from guestd.wire.session.events import (
    CancelRequested,
    ConnectionFailed,
    HelloReceived,
    InputReceived,
    RequestAborted,
    RequestReceived,
    SessionReset,
    Stream,
)


class ServerSession(Session):
    """The server's half: admits requests, guards input, guarantees one final frame each."""

    def __init__(
        self,
        *,
        ops: Mapping[str, OpSpec],
        max_frame: int,
        stream_window: int,
        max_inflight: int,
        limits: object | None = None,
        serial: bool = False,
    ) -> None:
        super().__init__(max_frame=max_frame, stream_window=stream_window)
        self.ops = ops
        self.limits = limits  # guestd's Limits: what ``le_limit`` constraints compare against
        self.limit_max_frame = max_frame
        self.limit_stream_window = stream_window
        self.max_inflight = max_inflight
        self.serial = serial  # serial links resync on bad framing and accept a new hello
        self.version: int | None = None
        self._pending_hello: dict[str, Any] | None = None

    # -- handshake -----------------------------------------------------------------------
    def accept_hello(self, make_reply: Callable[[ServerSession], dict[str, Any]]) -> None:
        """Put the pending hello into effect (after the adapter's token and peer checks) and
        answer it; then call :meth:`resume` for the frames that came after it."""
        hello = self._pending_hello
        if self.phase is not _HELLO_PENDING or hello is None:
            raise AssertionError("no hello is pending")
        self._pending_hello = None
        self.version = max(v for v in hello["versions"] if v in SUPPORTED_VERSIONS)
        if hello["max_frame"] is not None:
            self.peer_max_frame = max(MIN_MAX_FRAME, min(hello["max_frame"], self.limit_max_frame))
        if hello["stream_window"] is not None:
            self.stream_window = max(MIN_STREAM_WINDOW, min(hello["stream_window"], self.limit_stream_window))
        self.phase = _OPEN
        self._send(_HELLO, 0, make_reply(self))

    def refuse(self, error: GuestdError) -> None:
        """End the connection with a connection-level ERROR (id 0); the adapter then closes."""
        if self.phase is not _CLOSED:
            self._send(_ERROR, 0, error.to_body())
            self.phase = _CLOSED
            self._pending_hello = None

    def _refuse(self, error: GuestdError) -> None:
        """The peer's frames ended the connection: refuse it and report it as an event."""
        if self.phase is not _CLOSED:
            self.refuse(error)
            self._events.append(ConnectionFailed(error))

    def reset_peer(self) -> tuple[Stream, ...]:
        """Serial links: the host went away; forget its requests and partial frame, await a new hello."""
        self.decoder.reset()
        return self._forget_host()

    def _forget_host(self) -> tuple[Stream, ...]:
        dropped = tuple(self.streams.values())
        for stream in dropped:
            self._end(stream)
        self.phase = _AWAIT_HELLO
        self._pending_hello = None
        self.version = None
        self.peer_max_frame = self.limit_max_frame
        self.stream_window = self.limit_stream_window
        return dropped

    def _on_hello(self, frame: Frame) -> None:
        if self.phase is _OPEN:
            if not self.serial:
                self._send(_ERROR, 0, GuestdError(ErrorCode.PROTOCOL_ERROR, "hello sent twice").to_body())
                return
            # On a serial port a new hello means a new host session: forget the old one's requests.
            self._events.append(SessionReset(self._forget_host()))
        try:
            body = decode_body(frame.payload)
        except GuestdError as err:
            if err.details.get("reason") == "invalid_utf8":  # a map, with a str that is not UTF-8 in it
                self._refuse(GuestdError(ErrorCode.BAD_REQUEST, f"bad hello: {err.message}", details=err.details))
            else:  # not a msgpack map at all: not a hello, a failed handshake
                self._refuse(GuestdError(ErrorCode.PROTOCOL_ERROR, f"hello payload: {err.message}"))
            return
        try:
            hello = validate(HELLO_CLIENT, body)
        except GuestdError as err:
            self._refuse(GuestdError(ErrorCode.BAD_REQUEST, f"bad hello: {err.message}", details=err.details))
            return
        if not any(v in SUPPORTED_VERSIONS for v in hello["versions"]):
            self._refuse(
                GuestdError(
                    ErrorCode.UNSUPPORTED_VERSION,
                    f"no common protocol version; server speaks {list(SUPPORTED_VERSIONS)}",
                    details={"supported": list(SUPPORTED_VERSIONS)},
                )
            )
            return
        # Frames after the hello wait in the decoder until it is accepted or refused.
        self.phase = _HELLO_PENDING
        self._pending_hello = hello
        self._events.append(HelloReceived(hello))

    # -- frames from the client ----------------------------------------------------------
    def _on_framing_error(self, exc: FramingError) -> None:
        if self.serial:
            self.decoder.resync()  # a serial line can carry noise; find the next header
            return
        self._refuse(GuestdError(ErrorCode.PROTOCOL_ERROR, str(exc)))

    def _on_oversize(self, frame: OversizeFrame) -> None:
        err = too_large(
            "max_frame", frame.length, f"frame of {frame.length} bytes exceeds max_frame {self.limit_max_frame}"
        )
        if frame.kind == _HELLO:
            self._refuse(err)
        elif frame.kind == _REQUEST:
            if frame.id == 0:
                self._refuse(_reserved_id_error())
            elif self.phase is not _OPEN:
                self._send(_ERROR, frame.id, _before_hello_error().to_body())
            elif frame.id in self.streams:
                self._refuse(_in_flight_error(frame.id))
            else:
                self._send(_ERROR, frame.id, err.to_body())
        elif frame.kind == _INPUT:
            stream = self.streams.get(frame.id)
            if stream is not None and stream.accepts_input:
                self._abort(stream, too_large("max_frame", frame.length, "an input frame exceeded max_frame"))

    def _on_frame(self, frame: Frame) -> None:
        kind = frame.kind
        if kind == _REQUEST:
            self._on_request(frame)
        elif kind == _INPUT:
            self._on_input(frame)
        elif kind == _WINDOW:
            self._on_window(frame)
        elif kind == _CANCEL:
            stream = self.streams.get(frame.id)
            if stream is not None:
                self._events.append(CancelRequested(stream))
        elif kind == _HELLO:
            self._on_hello(frame)
        # Other kinds are ignored so that later protocol revisions can add them.

    def _on_request(self, frame: Frame) -> None:
        req_id = frame.id
        if req_id == 0:
            # Id 0 is the connection's own: an answer there would read as a fatal error,
            # so a request on it is one: the client has lost track of its ids.
            self._refuse(_reserved_id_error())
            return
        if self.phase is not _OPEN:
            self._send(_ERROR, req_id, _before_hello_error().to_body())
            return
        if req_id in self.streams:
            # Like HTTP/2's reused stream id, a connection error: an answer on that id could not be
            # told from the original's final frame, so the client has lost track of its ids.
            self._refuse(_in_flight_error(req_id))
            return
        if len(self.streams) >= self.max_inflight:
            self._send(
                _ERROR,
                req_id,
                GuestdError(
                    ErrorCode.LIMIT,
                    f"more than {self.max_inflight} requests in flight",
                    details={"limit": "max_inflight", "value": self.max_inflight},
                ).to_body(),
            )
            return
        try:
            op, raw_args = split_request(decode_body(frame.payload))
            spec = self.ops.get(op)
            if spec is None:
                raise GuestdError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}", details={"op": op})
            args = validate_args(spec, raw_args, self.limits)
        except GuestdError as err:
            self._send(_ERROR, req_id, _relative_to_args(err).to_body())
            return
        stream = Stream(req_id, op, spec, self.stream_window, 0)
        if stream.accepts_input:
            stream.receive_allowance = self.stream_window
        self.streams[req_id] = stream
        self._events.append(RequestReceived(stream, args))

    def _on_input(self, frame: Frame) -> None:
        stream = self.streams.get(frame.id)
        if stream is None or not stream.accepts_input:
            return  # the request ended (or takes no input, or no more): late input is dropped by design
        assert stream.spec is not None
        try:
            body = validate(stream.spec.input, decode_body(frame.payload))
        except GuestdError as err:
            self._abort(
                stream, GuestdError(ErrorCode.BAD_REQUEST, f"bad input frame: {err.message}", details=err.details)
            )
            return
        if not self._take_data(stream, body):
            self._abort(
                stream,
                GuestdError(
                    ErrorCode.LIMIT,
                    "client sent input beyond its credit",
                    details={"limit": "stream_window", "over": -stream.receive_allowance},
                ),
            )
            return
        self._events.append(InputReceived(stream, {k: v for k, v in body.items() if v is not None}))

    def _on_bad_window(self, stream: Stream, err: GuestdError) -> None:
        # Malformed like malformed input: it ends its request (PROTOCOL.md 5).
        self._abort(
            stream,
            GuestdError(
                ErrorCode.BAD_REQUEST,
                f"bad window frame: {err.message}",
                details={**err.details, "field": "bytes"},
            ),
        )

    def _abort(self, stream: Stream, err: GuestdError) -> None:
        if self._end(stream):
            self._send(_ERROR, stream.id, err.to_body())
            self._events.append(RequestAborted(stream, err))

    # -- what handlers send --------------------------------------------------------------
    def close_input(self, stream: Stream) -> None:
        """The handler is past its point of no return (an upload committing): input that
        still arrives is ignored instead of failing a request whose outcome is decided."""
        stream.accepts_input = False

    def send_event(self, stream: Stream, body: Mapping[str, Any]) -> bool:
        """Queue a non-data EVENT; False when the request already ended (the event is dropped)."""
        if not stream.open or self.phase is not _OPEN:
            return False
        frame = encode_frame(_EVENT, stream.id, body)
        if len(frame) - HEADER_SIZE > self.peer_max_frame:
            raise too_large("max_frame", len(frame) - HEADER_SIZE, "event larger than the client's max_frame")
        self._queue(frame)
        return True

    def send_data(self, stream: Stream, fields: Mapping[str, Any], data: bytes | bytearray) -> bool:
        """Queue one data EVENT of at most ``data_room`` bytes; False when the request already ended."""
        return self._send_data(_EVENT, stream, fields, data)

    def ack_input(self, stream: Stream, nbytes: int) -> None:
        """The handler consumed ``nbytes`` of input: the client may send that much more."""
        self.grant(stream, nbytes)

    def respond(self, stream: Stream, result: Mapping[str, Any]) -> bool:
        """Send the request's final RESPONSE, once. A result that cannot be encoded or does
        not fit the client's max_frame becomes a typed ERROR instead."""
        if not self._end(stream):
            return False
        if self.phase is not _OPEN:
            return True
        if stream.spec is not None and stream.spec.final == ERROR_ONLY:
            err = GuestdError(ErrorCode.INTERNAL, f"{stream.op} never answers, but its handler returned")
            self._send(_ERROR, stream.id, err.to_body())
            return True
        try:
            frame = encode_frame(_RESPONSE, stream.id, result)
        except (TypeError, ValueError, OverflowError) as exc:  # UnicodeEncodeError is a ValueError
            err = GuestdError(
                ErrorCode.INTERNAL,
                f"the reply could not be encoded: {type(exc).__name__}: {exc}",
                details={"stage": "encode"},
            )
            self._send(_ERROR, stream.id, err.to_body())
            return True
        if len(frame) - HEADER_SIZE > self.peer_max_frame:
            err = too_large("max_frame", len(frame) - HEADER_SIZE, "reply larger than the client's max_frame")
            self._send(_ERROR, stream.id, err.to_body())
            return True
        self._queue(frame)
        return True

    def fail(self, stream: Stream, error: GuestdError) -> bool:
        """Send the request's final ERROR, once; False when it already ended."""
        if not self._end(stream):
            return False
        if self.phase is _OPEN:
            self._send(_ERROR, stream.id, error.to_body())
        return True

    def forget(self, stream: Stream) -> None:
        """Drop a request with no final frame (connection lost)."""
        self._end(stream)


def _relative_to_args(err: GuestdError) -> GuestdError:
    """A str that is not UTF-8 is located in the whole payload (``args.path``); fields of a
    request are named as in its args (``path``), like every other bad_request."""
    name = err.details.get("field")
    if isinstance(name, str) and name.startswith("args."):
        return GuestdError(
            err.code, err.message.replace(repr(name), repr(name[5:])), details={**err.details, "field": name[5:]}
        )
    return err


def _in_flight_error(req_id: int) -> GuestdError:
    return GuestdError(
        ErrorCode.PROTOCOL_ERROR,
        f"request id {req_id} is already in flight",
        details={"field": "id", "reason": "in_flight"},
    )


def _reserved_id_error() -> GuestdError:
    return GuestdError(
        ErrorCode.PROTOCOL_ERROR, "request id 0 is reserved", details={"field": "id", "reason": "reserved"}
    )


def _before_hello_error() -> GuestdError:
    return GuestdError(ErrorCode.PROTOCOL_ERROR, "send hello before any request")
