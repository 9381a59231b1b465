"""The session core's records: the ``Stream`` handle of a request in flight, and the typed
events that say what the peer did."""

from __future__ import annotations

from typing import Any, Final

from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.record import Record
from guestd.wire.schema import OpSpec


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
# Immutable, typed records of what the peer did, in the order it did it. Records (plain classes
# with __slots__, guestd/wire/record.py), not dataclasses or NamedTuples: twelve frozen slotted
# dataclasses cost ~190 KiB of guestd's idle memory (generated code objects) and NamedTuples
# ~35 KiB and ~1.5 ms to declare on the start path; these cost ~0.1 ms.


class HelloReceived(Record):
    """Server: a well-formed client hello with a common version. Nothing has taken
    effect yet, and frames after it wait until the adapter, having checked the token
    and peer, calls ``accept_hello`` (then ``resume``) or ``refuse``."""

    __slots__ = ("hello",)

    def __init__(self, hello: dict[str, Any]) -> None:
        self.hello: Final = hello


class SessionReset(Record):
    """Server, serial links only: a new host sent a hello; every request of the old one is gone."""

    __slots__ = ("dropped",)

    def __init__(self, dropped: tuple[Stream, ...]) -> None:
        self.dropped: Final = dropped


class RequestReceived(Record):
    __slots__ = ("args", "stream")

    def __init__(self, stream: Stream, args: dict[str, Any]) -> None:
        self.stream: Final = stream
        self.args: Final = args

    @property
    def id(self) -> int:
        return self.stream.id

    @property
    def op(self) -> str:
        return self.stream.op


class InputReceived(Record):
    __slots__ = ("body", "stream")

    def __init__(self, stream: Stream, body: dict[str, Any]) -> None:
        self.stream: Final = stream
        self.body: Final = body


class CreditGranted(Record):
    """The peer granted ``nbytes`` more stream credit."""

    __slots__ = ("nbytes", "stream")

    def __init__(self, stream: Stream, nbytes: int) -> None:
        self.stream: Final = stream
        self.nbytes: Final = nbytes


class CancelRequested(Record):
    __slots__ = ("stream",)

    def __init__(self, stream: Stream) -> None:
        self.stream: Final = stream


class RequestAborted(Record):
    """Server: the core already sent the request's final ERROR; its handler must stop."""

    __slots__ = ("error", "stream")

    def __init__(self, stream: Stream, error: GuestdError) -> None:
        self.stream: Final = stream
        self.error: Final = error


class HelloAccepted(Record):
    """Client: the server's validated hello; negotiated values are in effect."""

    __slots__ = ("hello",)

    def __init__(self, hello: dict[str, Any]) -> None:
        self.hello: Final = hello


class ResponseReceived(Record):
    __slots__ = ("body", "id")

    def __init__(self, id: int, body: dict[str, Any]) -> None:
        self.id: Final = id
        self.body: Final = body


class ErrorReceived(Record):
    __slots__ = ("error", "id")

    def __init__(self, id: int, error: GuestdError) -> None:
        self.id: Final = id
        self.error: Final = error


class EventReceived(Record):
    __slots__ = ("body", "id", "size")

    def __init__(self, id: int, body: dict[str, Any], size: int) -> None:
        self.id: Final = id
        self.body: Final = body
        self.size: Final = size  # payload bytes, for the client's bound on queued events


class ConnectionFailed(Record):
    """The connection cannot continue; the adapter flushes what is queued and closes."""

    __slots__ = ("error",)

    def __init__(self, error: GuestdError) -> None:
        self.error: Final = error


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
