"""The floor server's client (bench/floor_server.py's framing: a 4-byte big-endian length, then
one msgpack object): one call in flight, no checks. Used by the host bench and, copied into the
guest beside the server, by bench/guest_probe.py; kept out of the server's own file, whose size
is part of the floor's start."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgpack


class FloorClient(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: asyncio.Future[dict[str, Any]] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its API.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= 4:
            n = int.from_bytes(self.buf[:4], "big")
            if len(self.buf) < 4 + n:
                return
            obj = msgpack.unpackb(bytes(self.buf[4 : 4 + n]))
            del self.buf[: 4 + n]
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(obj)

    async def call(self, obj: dict[str, Any]) -> dict[str, Any]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        body = msgpack.packb(obj)
        self.transport.write(len(body).to_bytes(4, "big") + body)
        return await self.waiter
