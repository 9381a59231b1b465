"""The session core's records: the ``Stream`` handle of a request in flight, and the typed
events that say what the peer did."""

from __future__ import annotations

from typing import Any, NamedTuple

from guestd.wire.errors import ErrorCode, GuestdError
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
