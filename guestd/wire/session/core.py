"""The session core's shared half: framing, the output queue, the in-flight table and the
data-frame rules (credit and frame size) of both ends; ``ServerSession`` and ``ClientSession``
build on it."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from guestd.wire.errors import GuestdError
from guestd.wire.frames import (
    Frame,
    FrameDecoder,
    FramingError,
    Kind,
    OversizeFrame,
    encode_data_frame,
    encode_frame,
    pack,
)
from guestd.wire.messages import decode_body
from guestd.wire.schema import WINDOW_BODY, validate
from guestd.wire.session.events import ConnectionFailed, CreditGranted, Event, PeerViolation, Stream

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
# frame: the hot paths (here, in server.py and in client.py) compare against these plain
# module names instead.
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
        if self.phase is not _CLOSED:
            self.decoder.feed(data)
        return self.resume()

    def get_buffer(self) -> memoryview:
        """Where the transport should read the peer's next bytes to (asyncio's
        BufferedProtocol); then call :meth:`buffer_updated`. Bytes read this way are
        decoded where they land: no copy between the kernel and the decoder."""
        return self.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> list[Event]:
        """``nbytes`` were read into the last :meth:`get_buffer`; returns the events they complete."""
        if self.phase is not _CLOSED:
            self.decoder.buffer_updated(nbytes)
        return self.resume()

    def resume(self) -> list[Event]:
        """Decode the frames the decoder holds (after a hello under check: those that waited
        behind it); returns their events, in order."""
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
