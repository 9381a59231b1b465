"""The session core's client half: request ids, the server's hello checked, and the bounds on
what a hostile guest can make the host hold or compute."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from guestd.wire.errors import GuestdError
from guestd.wire.frames import MAX_ID, Frame, OversizeFrame
from guestd.wire.messages import bounded_by_length, decode_body, decoded_size
from guestd.wire.schema import HELLO_SERVER, OpSpec, validate
from guestd.wire.session.core import (
    _AWAIT_HELLO,
    _CANCEL,
    _ERROR,
    _EVENT,
    _HELLO,
    _INPUT,
    _OPEN,
    _REQUEST,
    _RESPONSE,
    _WINDOW,
    MIN_MAX_FRAME,
    Session,
)
from guestd.wire.session.events import (
    ErrorReceived,
    EventReceived,
    HelloAccepted,
    PeerViolation,
    ResponseReceived,
    Stream,
)


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
        size = 0  # what an event is charged in the event queue; a reply's is only bounded
        if kind == _EVENT:
            measured = self._measure(frame, self.max_event_decoded)
            if measured is None:
                return
            size = measured
        elif not bounded_by_length(frame.payload, self.max_decoded):
            measured = self._measure(frame, self.max_decoded)  # None: it failed the connection
            if measured is None:
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
