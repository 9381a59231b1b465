"""Parameter types the client's calls share: what a guest timeout does, how a write opens its
file, a transfer's progress callback; and :func:`present`, how a call's arguments become a
request's (the fields left at None left out).

They live below :mod:`guestd.client.aio` so the handles, the protocols they hold the client as
(:mod:`guestd.client._surface`) and the blocking twins can name them without importing the
client (``tests/test_import_cycles.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

DEFAULT_DEADLINE = 300.0  # the client's wait for a request with no bound of its own in the guest
TRANSFER_DEADLINE = 3600.0  # the client's wait for a whole upload or download without a deadline

Progress = Callable[[int], None]  # called with each chunk's size as an upload or download moves it
OnTimeout = Literal["kill", "detach"]  # what a guest timeout does to exec / shell.run
WriteFlag = Literal["overwrite", "create", "append"]


def present(**fields: Any) -> dict[str, Any]:
    """Request args without the fields left at None (the guest applies its defaults)."""
    return {k: v for k, v in fields.items() if v is not None}
