"""Sans-I/O session core: the protocol's rules for one connection, for both ends.

Bytes in, events out; calls in, bytes out (the shape of h11's ``Connection`` and
websockets' ``Protocol``). ``ServerSession`` and ``ClientSession`` share framing,
the in-flight table, credit in both directions and the frame-size rules; the
asyncio adapters in ``guestd/server/connection.py`` and ``guestd/client/connection.py``
only move bytes and run tasks. Nothing here does I/O or knows about the event loop,
so every rule is unit-tested without sockets (tests/test_session.py).

Rules this module owns (PROTOCOL.md sections 3-6):

* Every request ends with exactly one final frame (RESPONSE or ERROR). When the
  core refuses a request's input it sends the final ERROR itself, at once, and
  reports :class:`RequestAborted` so the handler stops; anything the handler
  sends later for that id is dropped.
* No frame exceeds the peer's negotiated ``max_frame``: data is cut to
  :meth:`Session.data_room`, which is the smaller of the stream's credit and the
  room left in one frame after its other fields.
* Credit is strict in both directions: a data frame may carry at most the
  sender's remaining credit for that stream; one byte more is a violation
  (``limit`` for the request on the server, a protocol error on the client).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, NamedTuple

from guestd.wire.errors import ErrorCode, GuestdError, too_large
from guestd.wire.frames import (
    HEADER_SIZE,
    MAX_ID,
    Frame,
    FrameDecoder,
    FramingError,
    Kind,
    OversizeFrame,
    encode_data_frame,
    encode_frame,
    pack,
)
from guestd.wire.messages import decode_body, decoded_size, split_request
from guestd.wire.schema import (
    ERROR_ONLY,
    HELLO_CLIENT,
    HELLO_SERVER,
    SUPPORTED_VERSIONS,
    WINDOW_BODY,
    OpSpec,
    validate,
    validate_args,
)

# Floors of the negotiated values: a hello reply alone is ~900 bytes, and a window
# smaller than one read would turn every stream into a stop-and-go of tiny frames.
MIN_MAX_FRAME = 64 * 1024
MIN_STREAM_WINDOW = 64 * 1024

# Bytes a data frame's body spends on its "data" key and a bin32 header.
_DATA_KEY_OVERHEAD = 5 + 5


def data_overhead(fields: Mapping[str, Any]) -> int:
    """Payload bytes of a data frame ``{**fields, "data": ...}`` that are not data."""
    size = 1  # fixmap header (data frames have at most 15 fields)
    for key, value in fields.items():
        size += len(pack(key)) + len(pack(value))
    return size + _DATA_KEY_OVERHEAD


class Phase(Enum):
    AWAIT_HELLO = "await_hello"
    HELLO_PENDING = "hello_pending"  # server: a hello is being checked; later frames wait in the decoder
    OPEN = "open"
    CLOSED = "closed"


# Enum member lookups cost ~100 ns each in CPython 3.11 and the session makes a dozen per
# frame: the hot paths compare against these plain module names instead.
_HELLO, _REQUEST, _RESPONSE, _ERROR, _EVENT, _INPUT, _WINDOW, _CANCEL = (
    int(Kind.HELLO),
    int(Kind.REQUEST),
    int(Kind.RESPONSE),
    int(Kind.ERROR),
    int(Kind.EVENT),
    int(Kind.INPUT),
    int(Kind.WINDOW),
    int(Kind.CANCEL),
)
_AWAIT_HELLO, _HELLO_PENDING, _OPEN, _CLOSED = Phase.AWAIT_HELLO, Phase.HELLO_PENDING, Phase.OPEN, Phase.CLOSED


# ----------------------------------------------------------------------------- streams


class Stream:
    """One request in flight, as either end sees it; the handle every per-request call takes.

    ``send_credit``: bytes of data this end may still send on the stream.
    ``receive_allowance``: bytes of data the peer may still send before this end grants more.
    ``open`` turns false once the request ended, so a handle kept by a late handler can
    never act on a newer request that reuses the id.
    """

    __slots__ = ("accepts_input", "expects_events", "id", "op", "open", "receive_allowance", "send_credit", "spec")

    def __init__(self, req_id: int, op: str, spec: OpSpec | None, send_credit: int, receive_allowance: int) -> None:
        self.id = req_id
        self.op = op
        self.spec = spec
        self.send_credit = send_credit
        self.receive_allowance = receive_allowance
        self.accepts_input = bool(spec is not None and spec.input)
        self.expects_events = bool(spec is None or spec.events)  # the client narrows it per request
        self.open = True


# ----------------------------------------------------------------------------- events
# Immutable, typed records of what the peer did, in the order it did it. NamedTuples, not
# dataclasses: twelve frozen slotted dataclasses cost ~190 KiB of guestd's idle memory
# (generated code objects), NamedTuples ~35 KiB.


class HelloReceived(NamedTuple):
    """Server: a well-formed client hello with a common version. Nothing has taken
    effect yet, and frames after it wait until the adapter, having checked the token
    and peer, calls ``accept_hello`` (then ``resume``) or ``refuse``."""

    hello: dict[str, Any]


class SessionReset(NamedTuple):
    """Server, serial links only: a new host sent a hello; every request of the old one is gone."""

    dropped: tuple[Stream, ...]


class RequestReceived(NamedTuple):
    stream: Stream
    args: dict[str, Any]

    @property
    def id(self) -> int:
        return self.stream.id

    @property
    def op(self) -> str:
        return self.stream.op


class InputReceived(NamedTuple):
    stream: Stream
    body: dict[str, Any]


class CreditGranted(NamedTuple):
    """The peer granted ``nbytes`` more stream credit."""

    stream: Stream
    nbytes: int


class CancelRequested(NamedTuple):
    stream: Stream


class RequestAborted(NamedTuple):
    """Server: the core already sent the request's final ERROR; its handler must stop."""

    stream: Stream
    error: GuestdError


class HelloAccepted(NamedTuple):
    """Client: the server's validated hello; negotiated values are in effect."""

    hello: dict[str, Any]


class ResponseReceived(NamedTuple):
    id: int
    body: dict[str, Any]


class ErrorReceived(NamedTuple):
    id: int
    error: GuestdError


class EventReceived(NamedTuple):
    id: int
    body: dict[str, Any]
    size: int  # payload bytes, for the client's bound on queued events


class ConnectionFailed(NamedTuple):
    """The connection cannot continue; the adapter flushes what is queued and closes."""

    error: GuestdError


Event = (
    HelloReceived
    | SessionReset
    | RequestReceived
    | InputReceived
    | CreditGranted
    | CancelRequested
    | RequestAborted
    | HelloAccepted
    | ResponseReceived
    | ErrorReceived
    | EventReceived
    | ConnectionFailed
)


class PeerViolation(GuestdError):
    """The peer broke the protocol; the connection is closed."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.PROTOCOL_ERROR, message)


# ----------------------------------------------------------------------------- shared core


class Session:
    """Framing, output queue, in-flight table and the data-frame rules of both ends."""

    def __init__(self, *, max_frame: int, stream_window: int) -> None:
        self.max_frame = max_frame  # the largest payload we accept
        self.peer_max_frame = max_frame  # the largest payload we may send (set by the handshake)
        self.stream_window = stream_window  # initial credit per stream (set by the handshake)
        self.decoder = FrameDecoder(max_frame)
        self.phase = _AWAIT_HELLO
        self.streams: dict[int, Stream] = {}
        self._out: list[bytes | bytearray] = []
        self._events: list[Event] = []

    # -- output --------------------------------------------------------------------------
    def data_to_send(self) -> list[bytes | bytearray]:
        """Bytes queued since the last call, in order (write them with ``writelines``)."""
        out, self._out = self._out, []
        return out

    @property
    def has_output(self) -> bool:
        return bool(self._out)

    def _queue(self, data: bytes | bytearray) -> None:
        self._out.append(data)

    def _send(self, kind: int, req_id: int, body: dict[str, Any]) -> None:
        self._queue(encode_frame(kind, req_id, body))

    def _fail_connection(self, error: GuestdError) -> None:
        if self.phase is _CLOSED:
            return
        self.phase = _CLOSED
        self._events.append(ConnectionFailed(error))

    def _end(self, stream: Stream) -> bool:
        """Take ``stream`` out of the in-flight table; False when it had already ended."""
        if not stream.open:
            return False
        stream.open = False
        if self.streams.get(stream.id) is stream:
            del self.streams[stream.id]
        return True

    # -- input ---------------------------------------------------------------------------
    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes from the peer; returns the events they complete, in order."""
        if self.phase is not _CLOSED and data:
            self.decoder.feed(data)
            self._drain_frames()
        events, self._events = self._events, []
        return events

    def get_buffer(self) -> memoryview:
        """Where the transport should read the peer's next bytes to (asyncio's
        BufferedProtocol); then call :meth:`buffer_updated`. Bytes read this way are
        decoded where they land: no copy between the kernel and the decoder."""
        return self.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> list[Event]:
        """``nbytes`` were read into the last :meth:`get_buffer`; returns the events they complete."""
        if self.phase is not _CLOSED and nbytes:
            self.decoder.buffer_updated(nbytes)
            self._drain_frames()
        events, self._events = self._events, []
        return events

    def resume(self) -> list[Event]:
        """Events of the frames that waited behind a hello under check."""
        if self.phase is not _CLOSED:
            self._drain_frames()
        events, self._events = self._events, []
        return events

    def _drain_frames(self) -> None:
        next_frame = self.decoder.next_frame_view  # payloads are decoded here, never kept
        while self.phase is _OPEN or self.phase is _AWAIT_HELLO:
            try:
                frame = next_frame()
            except FramingError as exc:
                self._on_framing_error(exc)
                continue
            if frame is None:
                return
            if isinstance(frame, OversizeFrame):
                self._on_oversize(frame)
            else:
                self._on_frame(frame)

    def _on_framing_error(self, exc: FramingError) -> None:
        self._fail_connection(PeerViolation(str(exc)))

    def _on_oversize(self, frame: OversizeFrame) -> None:
        raise NotImplementedError

    def _on_frame(self, frame: Frame) -> None:
        raise NotImplementedError

    # -- data frames ---------------------------------------------------------------------
    def data_room(self, stream: Stream, fields: Mapping[str, Any]) -> int:
        """How many data bytes the next data frame of ``stream`` may carry (0: wait for credit)."""
        if not stream.open:
            return 0
        return max(0, min(stream.send_credit, self.peer_max_frame - data_overhead(fields)))

    def frame_room(self, fields: Mapping[str, Any]) -> int:
        """Data bytes that fit in one frame after ``fields``, credit aside."""
        return self.peer_max_frame - data_overhead(fields)

    def _send_data(self, kind: int, stream: Stream, fields: Mapping[str, Any], data: bytes | bytearray) -> bool:
        """Queue one data frame within credit and frame size; False when the request ended."""
        if not stream.open or self.phase is not _OPEN:
            return False
        if len(data) > stream.send_credit or len(data) > self.peer_max_frame - data_overhead(fields):
            raise AssertionError(f"data frame of {len(data)} bytes exceeds data_room")
        stream.send_credit -= len(data)
        head, body = encode_data_frame(kind, stream.id, dict(fields), data)
        self._queue(head)
        if body:
            self._queue(body)
        return True

    def _take_data(self, stream: Stream, body: dict[str, Any]) -> bool:
        """Count a received data frame against the stream; False when it overran the credit."""
        data = body.get("data")
        if isinstance(data, bytes) and data:
            stream.receive_allowance -= len(data)
            return stream.receive_allowance >= 0
        return True

    def grant(self, stream: Stream, nbytes: int) -> None:
        """Grant the peer ``nbytes`` more credit on ``stream`` (after consuming that much)."""
        if not stream.open or nbytes <= 0 or self.phase is not _OPEN:
            return
        stream.receive_allowance += nbytes
        self._send(_WINDOW, stream.id, {"bytes": nbytes})

    def _on_window(self, frame: Frame) -> None:
        stream = self.streams.get(frame.id)
        if stream is None:
            return  # the request already ended: a late grant is harmless, malformed or not
        try:
            nbytes = validate(WINDOW_BODY, decode_body(frame.payload))["bytes"]
        except GuestdError as err:
            self._on_bad_window(stream, err)
            return
        if nbytes:  # 0 grants nothing: a no-op
            stream.send_credit += nbytes
            self._events.append(CreditGranted(stream, nbytes))

    def _on_bad_window(self, stream: Stream, err: GuestdError) -> None:
        """A window frame that is not ``{bytes: uint}`` for a request in flight."""
        raise NotImplementedError


# ----------------------------------------------------------------------------- server


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


# ----------------------------------------------------------------------------- client


class ClientSession(Session):
    """The client's half: allocates ids, checks every reply, enforces the credit it granted.

    Everything the guest sends is hostile, and this is the one place that bounds what it can
    make the host hold or compute (SECURITY.md, "host side"):

    * A frame is decoded only when it belongs to a request in flight that may receive it; its
      decoded size is measured on its headers first (:func:`decoded_size`) and may not pass
      ``max_decoded`` (a final reply) or ``max_event_decoded`` (an event).
    * Frames for a request the client gave up on are skipped undecoded, counted against the
      credit that request still had plus ``GAVE_UP_SLACK``; frames for ids never sent (or
      already answered), and kinds a guest never sends, are skipped undecoded too, and
      ``MAX_STRAY_FRAMES`` of them end the connection.
    * An event for a request that asked for no stream (an op without events, or ``stream``
      false) ends the connection, undecoded.
    """

    MAX_STRAY_FRAMES = 16
    GAVE_UP_SLACK = 1024 * 1024  # non-data frames (started, start, final) of a cancelled request
    MAX_GAVE_UP = 4096  # cancelled requests remembered; older ones count as strays
    MAX_WINDOW_PAYLOAD = 32  # {"bytes": u64} is 15 bytes

    def __init__(
        self,
        *,
        ops: Mapping[str, OpSpec],
        max_frame: int,
        stream_window: int,
        max_decoded: int | None = None,
        max_event_decoded: int | None = None,
    ) -> None:
        # What the hello announces is the caller's value; what is accepted is at least the floor,
        # since a server sends frames of up to MIN_MAX_FRAME to any client (PROTOCOL.md 2.1).
        super().__init__(max_frame=max(MIN_MAX_FRAME, max_frame), stream_window=stream_window)
        self.announced_max_frame = max_frame
        self.ops = ops
        self.hello: dict[str, Any] | None = None
        self._offered_versions: tuple[int, ...] = ()
        self._next_id = 1
        # A final reply may decode to several times its frame (a 20,000-entry file.list is 14 MiB
        # for 1.3 MiB on the wire); an event at most to what a queue of events may hold.
        self.max_decoded = max_decoded if max_decoded is not None else 8 * max_frame
        self.max_event_decoded = max_event_decoded if max_event_decoded is not None else 4 * max_frame
        self.strays = 0
        self._gave_up: dict[int, int] = {}  # id -> payload bytes it may still send

    def send_hello(self, body: dict[str, Any]) -> None:
        self._offered_versions = tuple(body["versions"])
        self._send(_HELLO, 0, body)

    # -- requests ------------------------------------------------------------------------
    def start(self, op: str, args: dict[str, Any]) -> Stream:
        """Queue a REQUEST; returns its handle (its id is never 0, never one in flight).

        The request expects events when its op declares some and, for an op with
        ``events_when`` (exec's ``stream``, ``keep``), when one of those args is true."""
        if self.phase is not _OPEN:
            raise PeerViolation("the handshake has not completed")
        while True:
            req_id = self._next_id
            self._next_id = req_id + 1 if req_id < MAX_ID else 1
            if req_id not in self.streams:
                break
        spec = self.ops.get(op)
        stream = Stream(req_id, op, spec, self.stream_window, self.stream_window)
        if spec is not None:
            # events_when (exec's stream; keep: one event {ev: kept, run_id} comes first)
            stream.expects_events = spec.sends_events(args)
        self.streams[req_id] = stream
        self._gave_up.pop(req_id, None)
        self._send(_REQUEST, req_id, {"op": op, "args": args})
        return stream

    def send_input(self, stream: Stream, body: dict[str, Any]) -> bool:
        """Queue a non-data INPUT (eof, signal); False when the request already ended."""
        if not stream.open or self.phase is not _OPEN:
            return False
        self._send(_INPUT, stream.id, body)
        return True

    def send_input_data(self, stream: Stream, fields: Mapping[str, Any], data: bytes) -> bool:
        """Queue one data INPUT of at most ``data_room`` bytes; False when the request already ended."""
        return self._send_data(_INPUT, stream, fields, data)

    def cancel(self, stream: Stream, *, forget: bool) -> None:
        """Ask the server to cancel the request; with ``forget`` its later frames are ignored."""
        if stream.open and self.phase is _OPEN:
            self._send(_CANCEL, stream.id, {})
        if forget and self._end(stream):
            # Its late frames are skipped unread, within what it could still send.
            if len(self._gave_up) >= self.MAX_GAVE_UP:
                del self._gave_up[next(iter(self._gave_up))]
            self._gave_up[stream.id] = max(0, stream.receive_allowance) + self.GAVE_UP_SLACK

    # -- frames from the server ----------------------------------------------------------
    def _on_oversize(self, frame: OversizeFrame) -> None:
        self._fail_connection(PeerViolation(f"guest sent a {frame.length}-byte frame (max {self.max_frame})"))

    def _on_frame(self, frame: Frame) -> None:
        kind = frame.kind
        if kind == _HELLO or (kind == _ERROR and frame.id == 0):
            body = self._decode(frame, self.max_decoded)
            if body is None:
                return
            if kind == _HELLO:
                self._on_hello(body)
            else:
                self._fail_connection(GuestdError.from_body(body))
            return
        stream = self.streams.get(frame.id)
        if stream is None or kind not in (_RESPONSE, _ERROR, _EVENT, _WINDOW):
            self._on_stray(frame)
            return
        if kind == _WINDOW:
            if len(frame.payload) > self.MAX_WINDOW_PAYLOAD:
                self._fail_connection(PeerViolation(f"guest sent a {len(frame.payload)}-byte window frame"))
                return
            self._on_window(frame)
            return
        if kind == _EVENT and not stream.expects_events:
            why = "which has none" if stream.spec is not None and not stream.spec.events else "which asked for none"
            self._fail_connection(PeerViolation(f"guest sent an event for {stream.op}, {why}"))
            return
        size = self._measure(frame, self.max_event_decoded if kind == _EVENT else self.max_decoded)
        if size is None:
            return
        try:
            body = decode_body(frame.payload)
        except GuestdError as err:
            self._fail_connection(PeerViolation(err.message))
            return
        if kind == _RESPONSE:
            self._end(stream)
            if stream.spec is not None:
                try:
                    body = validate(stream.spec.result, body)
                except GuestdError as err:
                    violation = PeerViolation(f"malformed {stream.op} reply: {err.message}")
                    self._events.append(ErrorReceived(frame.id, violation))
                    return
            self._events.append(ResponseReceived(frame.id, body))
        elif kind == _ERROR:
            self._end(stream)
            self._events.append(ErrorReceived(frame.id, GuestdError.from_body(body)))
        else:
            self._on_event(stream, body, size)

    def _measure(self, frame: Frame, limit: int) -> int | None:
        """The frame's decoded size, or None after failing the connection when it is too big."""
        try:
            return decoded_size(frame.payload, limit)
        except GuestdError as err:
            self._fail_connection(PeerViolation(f"guest sent a frame of kind {frame.kind}: {err.message}"))
            return None

    def _decode(self, frame: Frame, limit: int) -> dict[str, Any] | None:
        if self._measure(frame, limit) is None:
            return None
        try:
            return decode_body(frame.payload)
        except GuestdError as err:
            self._fail_connection(PeerViolation(err.message))
            return None

    def _on_bad_window(self, stream: Stream, err: GuestdError) -> None:
        self._fail_connection(PeerViolation(f"guest sent a malformed window frame: {err.message}"))

    def _on_stray(self, frame: Frame) -> None:
        """A frame for no request in flight, skipped without decoding it."""
        left = self._gave_up.get(frame.id)
        if left is not None and frame.kind in (_RESPONSE, _ERROR, _EVENT, _WINDOW):
            left -= len(frame.payload)
            if frame.kind in (_RESPONSE, _ERROR):
                del self._gave_up[frame.id]  # its final frame: anything after it is a stray
                return
            if left >= 0:
                self._gave_up[frame.id] = left
                return
            del self._gave_up[frame.id]
        self.strays += 1
        if self.strays > self.MAX_STRAY_FRAMES:
            self._fail_connection(PeerViolation(f"guest sent {self.strays} frames for requests that are not in flight"))

    def _on_event(self, stream: Stream, body: dict[str, Any], size: int) -> None:
        if stream.spec is not None:
            if not stream.spec.events:
                self._fail_connection(PeerViolation(f"guest sent an event for {stream.op}, which has none"))
                return
            try:
                validate(stream.spec.events, body)  # checked, not rewritten: unknown keys stay
            except GuestdError as err:
                self._fail_connection(PeerViolation(f"malformed {stream.op} event: {err.message}"))
                return
        if not self._take_data(stream, body):
            self._fail_connection(
                PeerViolation(f"guest sent {-stream.receive_allowance} stream bytes beyond the granted credit")
            )
            return
        self._events.append(EventReceived(stream.id, body, size))

    def _on_hello(self, body: dict[str, Any]) -> None:
        if self.phase is not _AWAIT_HELLO:
            self._fail_connection(PeerViolation("guest sent a second hello"))
            return
        try:
            hello = validate(HELLO_SERVER, body)
        except GuestdError as err:
            self._fail_connection(PeerViolation(f"malformed hello: {err.message}"))
            return
        if hello["version"] not in self._offered_versions:
            self._fail_connection(PeerViolation(f"guest chose protocol version {hello['version']}, never offered"))
            return
        # The server may lower, never raise, what we offered.
        self.stream_window = min(self.stream_window, hello["stream_window"])
        limit = hello["limits"].get("max_frame")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit >= MIN_MAX_FRAME:
            self.peer_max_frame = limit
        else:
            self.peer_max_frame = MIN_MAX_FRAME
        self.hello = hello
        self.phase = _OPEN
        self._events.append(HelloAccepted(hello))
