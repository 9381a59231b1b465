"""Host-side addresses: ``unix:PATH``, ``vsock:CID:PORT``, ``fc:UDS_PATH:PORT``."""

from __future__ import annotations

import asyncio
import errno
import socket
from dataclasses import dataclass

from guestd.wire.errors import ErrorCode, GuestdError

FC_LINE_MAX = 64  # "OK <port>\n" is short; a guest/VMM that sends more is refused
WHERE_TO_SET = "set GUESTD_CONNECT or --connect"  # how guestctl (and the examples) pick the address


class ConnectError(ConnectionError):
    """Connecting to a guestd failed: the text names the address and what to try. An OSError
    (``errno`` is the socket's), so ``except OSError`` keeps catching it."""

    def __init__(self, address: str, message: str, err: int | None = None) -> None:
        super().__init__(err if err is not None else 0, message)
        self.address = address

    def __str__(self) -> str:
        return str(self.strerror)


def connect_hint(address: str, exc: OSError) -> ConnectError:
    """``exc`` from connecting to ``address``, said so a person knows what to do next."""
    code = exc.errno
    if code == errno.ENOENT:
        text = f"no socket at {address}: is guestd running? {WHERE_TO_SET}"
    elif code == errno.ECONNREFUSED:
        text = (
            f"connection refused at {address}: nothing listens there (guestd ended and left its socket?); "
            f"start guestd, or {WHERE_TO_SET}"
        )
    elif code in (errno.EACCES, errno.EPERM):
        text = f"permission denied on {address}: run as a user allowed to open that socket (or root), or {WHERE_TO_SET}"
    elif code in (errno.ENODEV, errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.ENETUNREACH, errno.EHOSTUNREACH):
        text = f"cannot reach {address} ({exc.strerror}): is the VM running and its vsock device there? {WHERE_TO_SET}"
    elif code == errno.ECONNRESET:
        text = f"connection reset by {address}: is a guestd (not something else) listening there? {WHERE_TO_SET}"
    else:
        text = f"cannot connect to {address}: {exc.strerror or exc}; {WHERE_TO_SET}"
    return ConnectError(address, text, code)


@dataclass(frozen=True)
class Address:
    scheme: str  # unix | vsock | fc
    path: str = ""
    cid: int = 0
    port: int = 0

    def __str__(self) -> str:
        if self.scheme == "unix":
            return f"unix:{self.path}"
        if self.scheme == "vsock":
            return f"vsock:{self.cid}:{self.port}"
        return f"fc:{self.path}:{self.port}"


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
    try:
        if address.scheme == "vsock":
            sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
            target: str | tuple[int, int] = (address.cid, address.port)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target = address.path
    except OSError as exc:  # no vsock support on this host, say
        raise connect_hint(str(address), exc) from exc
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, target), timeout)
        if address.scheme == "fc":
            await asyncio.wait_for(_fc_handshake(loop, sock, address.port), timeout)
    except TimeoutError:
        sock.close()
        raise GuestdError(
            ErrorCode.TIMEOUT,
            f"connect to {address}: no answer within {timeout} s (is guestd up and serving there? "
            f"a longer connect_timeout / --connect-timeout waits longer)",
        ) from None
    except OSError as exc:
        sock.close()
        raise connect_hint(str(address), exc) from exc
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
