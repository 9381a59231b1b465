"""Sans-I/O session core: the protocol's rules for one connection, for both ends.

Bytes in, events out; calls in, bytes out (the shape of h11's ``Connection`` and
websockets' ``Protocol``). ``ServerSession`` and ``ClientSession`` share framing,
the in-flight table, credit in both directions and the frame-size rules; the
asyncio adapters in ``guestd/server/connection.py`` and ``guestd/client/connection.py``
only move bytes and run tasks. Nothing here does I/O or knows about the event loop,
so every rule is unit-tested without sockets (tests/test_session.py).

Its modules: ``events`` (the ``Stream`` handle and the event records), ``core`` (what both
ends share: framing, in-flight table, credit and frame size), ``server`` and ``client`` (each
end's half). Import the public names from here.

Rules this package owns (PROTOCOL.md sections 3-6):

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

from typing import TYPE_CHECKING, Any

from guestd.wire.session.core import MIN_MAX_FRAME, MIN_STREAM_WINDOW, Phase, Session, data_overhead
from guestd.wire.session.events import (
    CancelRequested,
    ConnectionFailed,
    CreditGranted,
    ErrorReceived,
    Event,
    EventReceived,
    HelloAccepted,
    HelloReceived,
    InputReceived,
    PeerViolation,
    RequestAborted,
    RequestReceived,
    ResponseReceived,
    SessionReset,
    Stream,
)
from guestd.wire.session.server import ServerSession

if TYPE_CHECKING:
    from guestd.wire.session.client import ClientSession


def __getattr__(name: str) -> Any:
    """``ClientSession`` is imported when first asked for: guestd's start path imports this
    package for the server's half and never needs the client's (start to first reply)."""
    if name == "ClientSession":
        from guestd.wire.session.client import ClientSession

        return ClientSession
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MIN_MAX_FRAME",
    "MIN_STREAM_WINDOW",
    "CancelRequested",
    "ClientSession",
    "ConnectionFailed",
    "CreditGranted",
    "ErrorReceived",
    "Event",
    "EventReceived",
    "HelloAccepted",
    "HelloReceived",
    "InputReceived",
    "PeerViolation",
    "Phase",
    "RequestAborted",
    "RequestReceived",
    "ResponseReceived",
    "ServerSession",
    "Session",
    "SessionReset",
    "Stream",
    "data_overhead",
]
