"""Host-side addresses: ``unix:PATH``, ``vsock:CID:PORT``, ``fc:UDS_PATH:PORT``."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

from guestd.wire.errors import ErrorCode, GuestdError

FC_LINE_MAX = 64  # "OK <port>\n" is short; a guest/VMM that sends more is refused


@dataclass(frozen=True)
class Address:
    scheme: str  # unix | vsock | fc
    path: str = ""
    cid: int = 0
    port: int = 0


def parse_address(addr: str) -> Address:
    scheme, _sep, rest = addr.partition(":")
    try:
        if scheme == "unix" and rest:
            return Address("unix", path=rest)
        if scheme == "vsock":
            cid, _, port = rest.partition(":")
            return Address("vsock", cid=int(cid), port=int(port))
        if scheme == "fc":
            path, _, port = rest.rpartition(":")
            if path:
                return Address("fc", path=path, port=int(port))
    except ValueError:
        pass
    raise ValueError(f"bad address {addr!r}: use unix:PATH, vsock:CID:PORT or fc:UDS_PATH:PORT")


async def open_socket(address: Address, timeout: float) -> socket.socket:
    """Connect and return a non-blocking stream socket ready for frames."""
    loop = asyncio.get_running_loop()
    if address.scheme == "vsock":
        sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        target: str | tuple[int, int] = (address.cid, address.port)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target = address.path
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, target), timeout)
        if address.scheme == "fc":
            await asyncio.wait_for(_fc_handshake(loop, sock, address.port), timeout)
    except TimeoutError:
        sock.close()
        raise GuestdError(ErrorCode.TIMEOUT, f"connect to {address.scheme}: no answer within {timeout} s") from None
    except BaseException:
        sock.close()
        raise
    return sock


async def _fc_handshake(loop: asyncio.AbstractEventLoop, sock: socket.socket, port: int) -> None:
    """Firecracker / Cloud Hypervisor hybrid vsock: ``CONNECT <port>\\n`` -> ``OK <n>\\n``."""
    await loop.sock_sendall(sock, f"CONNECT {port}\n".encode())
    line = bytearray()
    while not line.endswith(b"\n"):
        if len(line) >= FC_LINE_MAX:
            raise GuestdError(ErrorCode.PROTOCOL_ERROR, "hybrid vsock: reply line too long")
        b = await loop.sock_recv(sock, 1)  # byte by byte: frames may follow the line
        if not b:
            raise GuestdError(
                ErrorCode.PROTOCOL_ERROR,
                f"hybrid vsock: connection closed after {bytes(line)!r} (is guestd listening on port {port}?)",
            )
        line += b
    parts = line.decode("ascii", "replace").split()
    if len(parts) != 2 or parts[0] != "OK" or not parts[1].isdigit():
        raise GuestdError(ErrorCode.PROTOCOL_ERROR, f"hybrid vsock: unexpected reply {bytes(line)!r}")
