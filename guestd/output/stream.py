"""What output producers need of a request: data events sent within the client's credit.

A handler's request (``guestd.services.Request``) is one; the pump (pump.py) and the port
relay see no more of it than this, so each can be driven in a unit test by a fake whose
credit the test sets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class CreditedStream(Protocol):
    """A request's server -> client data, paced by the client's credit and the connection."""

    @property
    def active(self) -> bool:
        """False once the request's final frame went out: nothing of it is sent any more."""
        ...

    @property
    def write_paused(self) -> bool:
        """The connection's unsent output is over its mark: wait (:meth:`drain`) before more."""
        ...

    def data_room(self, fields: Mapping[str, Any]) -> int:
        """Data bytes the next event with ``fields`` may carry now (0: out of credit, or ended)."""
        ...

    def push_data(self, fields: Mapping[str, Any], data: bytes | bytearray) -> None:
        """Queue one data event of at most :meth:`data_room` bytes, without waiting."""
        ...

    async def wait_credit(self) -> None:
        """Until the client grants credit, or the request ends."""
        ...

    async def drain(self) -> None:
        """Until the connection takes more output, or the request ends."""
        ...
