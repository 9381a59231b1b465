"""Guest -> host forwards: a guest loopback listener whose connections wait to be claimed.

guestd never chooses where a connection goes: it announces each one (``accepted``) on the
``port.reverse`` request, and the host client that set the forward up claims it with
``port.accept`` and connects it to the destination it named. A connection nobody claims
within ``accept_timeout_s`` is reset; while ``max_pending`` wait, guestd stops accepting (the
kernel's backlog then holds or refuses newcomers), so a workload that opens connections in a
loop costs at most ``max_pending`` sockets and events.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from guestd.services import Request


def reset(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class Forward:
    """One listening guest port and the connections that wait for the host."""

    def __init__(self, fid: str, owner: object, listener: socket.socket, max_pending: int, timeout_s: float) -> None:
        self.id = fid
        self.owner = owner  # the connection whose port.reverse made it: only it may claim
        self.listener = listener
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self.accepted = 0
        self._pending: dict[int, tuple[socket.socket, asyncio.TimerHandle]] = {}
        self._room = asyncio.Event()
        self._room.set()

    @property
    def port(self) -> int:
        port: int = self.listener.getsockname()[1]
        return port

    async def serve(self, ctx: Request) -> None:
        """Accept and announce connections until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            await self._room.wait()
            sock, _ = await loop.sock_accept(self.listener)
            sock.setblocking(False)
            self.accepted += 1
            n = self.accepted
            self._pending[n] = (sock, loop.call_later(self.timeout_s, self._expire, n))
            if len(self._pending) >= self.max_pending:
                self._room.clear()
            await ctx.send_event({"ev": "accepted", "conn": n})

    def claim(self, n: int) -> socket.socket | None:
        entry = self._pending.pop(n, None)
        if entry is None:
            return None
        entry[1].cancel()
        self._room.set()
        return entry[0]

    def _expire(self, n: int) -> None:
        sock = self.claim(n)
        if sock is not None:
            reset(sock)

    def close(self) -> None:
        self.listener.close()
        for n in list(self._pending):
            sock = self.claim(n)
            if sock is not None:
                reset(sock)
