"""One relay stream: a guest TCP socket spliced onto a request's data events and INPUT frames.

The relay adds no flow control of its own; it holds the socket to the request's credit
(PROTOCOL.md section 5), so memory per stream is bounded by the protocol's numbers:

- guest socket -> client: at most one chunk (plus one socket read) waits in guestd; past
  that guestd stops reading the socket until the client grants credit and the connection's
  output drains, so a workload that floods blocks in its own ``send``.
- client -> guest socket: the client may send one window; credit goes back only for bytes
  the socket took while its transport buffer is under ``RELAY_WRITE_HIGH``. A workload that
  accepts and never reads holds guestd to one window plus that mark, and stalls only its
  own stream.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
from typing import TYPE_CHECKING, Any

from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.services import Request

RELAY_WRITE_HIGH = 256 * 1024  # unsent bytes per guest socket before credit stops going back
FIRST_READ = 64 * 1024  # a stream's first read buffer from its guest socket (see Relay)
_DATA = {"ev": "data"}
_UNREACHABLE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN, errno.EADDRNOTAVAIL}


def reset_error() -> GuestdError:
    return GuestdError(
        ErrorCode.IO_ERROR,
        "the guest side reset the connection",
        errno=errno.ECONNRESET,
        details={"stage": "relay", "reason": "reset"},
    )


def connect_error(exc: BaseException, address: str, port: int, timeout_s: float) -> GuestdError:
    """The typed error of a failed connect: refused, unreachable, timed out, or the OS error."""
    where = f"{address}:{port}" if ":" not in address else f"[{address}]:{port}"
    if isinstance(exc, TimeoutError):
        return GuestdError(
            ErrorCode.TIMEOUT,
            f"connecting to {where} took longer than {timeout_s:g} s",
            details={"stage": "connect", "reason": "timeout", "limit": "connect_timeout_s"},
        )
    if isinstance(exc, ConnectionRefusedError):
        return GuestdError(
            ErrorCode.UNAVAILABLE,
            f"nothing listens on {where} in the guest (connection refused)",
            errno=exc.errno,
            details={"stage": "connect", "reason": "refused"},
        )
    if isinstance(exc, OSError) and exc.errno in _UNREACHABLE:
        return GuestdError(
            ErrorCode.UNAVAILABLE,
            f"{where} is unreachable in the guest ({exc.strerror})",
            errno=exc.errno,
            details={"stage": "connect", "reason": "unreachable"},
        )
    if isinstance(exc, OSError):
        return GuestdError.from_os_error(exc, stage="connect")
    raise exc


class _Socket(asyncio.BufferedProtocol):
    """The guest socket's protocol: reads into its relay's chunk buffer, hands it the rest."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.relay.attach(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.relay.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.relay.on_read(nbytes)

    def eof_received(self) -> bool:
        self.relay.on_eof()
        return True  # keep the write side: a half-closed peer may still read

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay.on_lost(exc)

    def pause_writing(self) -> None:
        self.relay.writable.clear()

    def resume_writing(self) -> None:
        self.relay.writable.set()


class Relay:
    """Both directions of one stream; :meth:`run` returns the result once both have ended."""

    def __init__(self, ctx: Request, chunk: int) -> None:
        self.ctx = ctx
        self.chunk = chunk
        self.transport: Any = None  # uvloop's transports have asyncio's API but not its classes
        self.writable = asyncio.Event()
        self.writable.set()
        self.sent = 0
        self.received = 0
        # The guest socket is read straight into a buffer; a full one becomes a data event as
        # it is (no copy), a partial one is copied out. Before, reads came as uvloop's 256 KiB
        # bytes joined into chunks: two copies per byte of a bulk stream instead of none. A
        # stream starts with FIRST_READ bytes and doubles up to a chunk with each full buffer,
        # so a small or idle stream holds 64 KiB, not a chunk.
        self._fill: bytearray | None = None
        self._size = min(FIRST_READ, chunk)  # of the next buffer
        self._buffered = 0  # bytes of _fill that hold data
        self._reading_paused = False
        self._eof = False
        self._lost = False
        self._error: BaseException | None = None
        self._wake = asyncio.Event()

    def protocol(self) -> asyncio.BufferedProtocol:
        return _Socket(self)

    # -- from the guest socket -----------------------------------------------------------
    def attach(self, transport: Any) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=RELAY_WRITE_HIGH)

    def get_buffer(self) -> memoryview:
        if self._fill is None:
            self._fill = bytearray(self._size)
        return memoryview(self._fill)[self._buffered :]

    def on_read(self, nbytes: int) -> None:
        self._buffered += nbytes
        if self._fill is not None and self._buffered >= len(self._fill) and not self._reading_paused:
            self._reading_paused = True  # a full buffer waits to go out: read no more till then
            self.transport.pause_reading()
        self._wake.set()

    def on_eof(self) -> None:
        self._eof = True
        self._wake.set()

    def on_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        self._error = exc
        self._wake.set()
        self.writable.set()

    # -- the two directions --------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        await self.ctx.send_event({"ev": "connected"})
        tasks = [asyncio.ensure_future(self._outbound()), asyncio.ensure_future(self._inbound())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()  # the first failure ends the stream
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        return {"sent": self.sent, "received": self.received}

    def _take(self, room: int) -> bytes | bytearray:
        buf, n = self._fill, self._buffered
        assert buf is not None
        if n == len(buf) and n <= room:
            self._fill, self._buffered = None, 0  # the full buffer goes out as it is
            self._size = min(2 * n, self.chunk)
            return buf
        k = min(n, room)
        piece = bytes(memoryview(buf)[:k])
        if k < n:
            buf[: n - k] = memoryview(buf)[k:n]
        self._buffered = n - k
        return piece

    async def _outbound(self) -> None:
        """Guest socket -> data events, then an eof event."""
        ctx = self.ctx
        while True:
            self._wake.clear()
            if self._buffered:
                room = min(ctx.data_room(_DATA), self.chunk)
                if room <= 0:
                    if not ctx.active:
                        return
                    await ctx.wait_credit()
                    continue
                piece = self._take(room)
                ctx.push_data(_DATA, piece)
                self.received += len(piece)
                if self._reading_paused and not self._lost and (self._fill is None or self._buffered < len(self._fill)):
                    self._reading_paused = False
                    self.transport.resume_reading()
                if ctx.write_paused:
                    await ctx.drain()
                continue
            if self._lost and self._error is not None:
                raise reset_error()
            if self._eof or self._lost:
                await ctx.send_event({"ev": "eof"})
                return
            await self._wake.wait()

    async def _inbound(self) -> None:
        """INPUT data -> guest socket, credit back as it takes it; eof -> shutdown(SHUT_WR)."""
        ctx = self.ctx
        queue = ctx.input
        while True:
            body = await queue.get()
            data = body.get("data")
            if data:
                if self._lost:
                    raise reset_error()
                self.transport.write(data)
                self.sent += len(data)
                if not self.writable.is_set():
                    await self.writable.wait()
                    if self._lost and self._error is not None:
                        raise reset_error()
                ctx.ack_input(len(data))
            if body.get("eof"):
                ctx.stop_taking_data()
                if not self._lost and self.transport.can_write_eof():
                    self.transport.write_eof()
                return

    def close(self, *, reset: bool) -> None:
        """Close the guest socket: gracefully after the stream ended, with RST when it was cut
        short (cancel, a dropped connection, an error) so the workload sees the abort."""
        t = self.transport
        if t is None or t.is_closing():
            return
        if reset:
            sock = t.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            t.abort()
        else:
            t.close()


def check_address(address: str) -> tuple[socket.AddressFamily, bool]:
    """(family, is loopback) of an IP literal; names are refused (no resolver runs in guestd)."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise GuestdError(
            ErrorCode.BAD_REQUEST, f"address {address!r} is not an IP literal", details={"field": "address"}
        ) from None
    return (socket.AF_INET6 if ip.version == 6 else socket.AF_INET), ip.is_loopback


def check_local(address: str) -> None:
    """Only the guest's own addresses: a relay into the guest must never become a way into the
    networks the guest can reach. An address is the guest's when a socket can bind to it."""
    family, loopback = check_address(address)
    if loopback:
        return
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((address, 0))
    except OSError:
        raise GuestdError(
            ErrorCode.PERMISSION_DENIED,
            f"{address} is not an address of the guest",
            details={"policy": "guest_addresses", "field": "address"},
        ) from None
    finally:
        s.close()
