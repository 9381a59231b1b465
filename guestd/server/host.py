"""What a connection needs of the server that hosts it, and what the host sees of a connection.

``Connection`` (guestd/server/connection.py) and the transports talk to a :class:`ConnectionHost`
instead of the daemon's attributes: the daemon is one (guestd/server/daemon.py), and a test or a
fuzzer can give another. Neither side imports the other's module.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import asyncio

    from guestd.config import Limits
    from guestd.server.admission import Admitted
    from guestd.wire.errors import GuestdError
    from guestd.wire.schema import OpSpec


class HostedConnection(Protocol):
    """What the host reads of, and does to, one of its connections."""

    opened_at: float  # time.monotonic() when it was made
    session_id: str

    @property
    def awaiting_hello(self) -> bool: ...

    @property
    def version(self) -> int | None: ...

    @property
    def stream_window(self) -> int: ...

    @property
    def peer_max_frame(self) -> int: ...

    def refuse(self, error: GuestdError) -> None:
        """End it with a connection-level error."""
        ...

    def close(self) -> None: ...

    def cancel_requests(self, reason: str) -> list[asyncio.Task[None]]:
        """Cancel every request it runs (``reason``: the CANCELLED error's); their tasks."""
        ...


class ConnectionHost(Protocol):
    """What a connection needs of the server: its limits and ops, a slot, the peer and token
    checks, the hello's reply and hooks, and the admission of each request."""

    @property
    def limits(self) -> Limits: ...

    @property
    def op_specs(self) -> Mapping[str, OpSpec]:
        """The ops served: what the session core admits (a live map: declared ops are in it)."""
        ...

    def connection_opened(self, conn: HostedConnection) -> bool:
        """Take a connection slot; False when every slot is held (it is refused)."""
        ...

    def connection_closed(self, conn: HostedConnection) -> None: ...

    def check_peer(self, sock: Any) -> str | None:
        """None when the peer on ``sock`` (None: a transport without one) may talk, else why not."""
        ...

    def check_token(self, token: Any) -> str | None:
        """None when a hello's token lets the peer in, else why not."""
        ...

    def hello_body(self, conn: HostedConnection) -> dict[str, Any]:
        """The reply to an accepted hello."""
        ...

    def on_hello(self, hello: Mapping[str, Any]) -> None:
        """A hello was accepted and answered (the snapshot's host-clock check hooks in here)."""
        ...

    def admit(self, op: str, source: Hashable) -> Admitted:
        """The request for ``op`` from ``source`` (its connection) through the admission chain:
        its route, its handler as the chain runs it, and what it waits for first; raises the
        GuestdError of a refusal."""
        ...
