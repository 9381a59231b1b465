"""Listeners for each address family: ``unix:PATH``, ``vsock:PORT``, ``serial:DEVICE``.

Unix sockets use the loop's own transport (fastest). vsock and virtio-serial use
:class:`FdTransport`, a small non-blocking fd transport, because uvloop does not
accept AF_VSOCK sockets and because a virtio-serial port has its own notion of
"peer gone" (0-byte reads / POLLHUP while the host side is closed) that must not
end the session.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
from collections.abc import Callable, Set
from typing import TYPE_CHECKING, Any, Final

from guestd.config import DEFAULT_VSOCK_PORT
from guestd.server.connection import Connection
from guestd.wire.record import Record

if TYPE_CHECKING:
    from guestd.server.host import ConnectionHost

log = logging.getLogger("guestd.transport")

READ_SIZE = 1024 * 1024
HIGH_WATER = 2 * 1024 * 1024
LOW_WATER = 512 * 1024
SERIAL_POLL_S = 0.05


class ListenAddress(Record):  # not a frozen dataclass or NamedTuple: declared at every start (start to first reply)
    __slots__ = ("path", "port", "scheme")

    def __init__(self, scheme: str, path: str = "", port: int = 0) -> None:
        self.scheme: Final = scheme  # unix | vsock | serial
        self.path: Final = path
        self.port: Final = port

    def __str__(self) -> str:
        return f"vsock:{self.port}" if self.scheme == "vsock" else f"{self.scheme}:{self.path}"


def parse_listen(addr: str) -> ListenAddress:
    scheme, sep, rest = addr.partition(":")
    if not sep:
        raise ValueError(f"listen address {addr!r} needs a scheme: unix:PATH, vsock:PORT or serial:DEVICE")
    if scheme == "unix" and rest:
        return ListenAddress("unix", path=rest)
    if scheme == "serial" and rest:
        return ListenAddress("serial", path=rest)
    if scheme == "vsock":
        port = int(rest) if rest else DEFAULT_VSOCK_PORT
        if not 0 < port < 2**32:
            raise ValueError(f"vsock port out of range: {port}")
        return ListenAddress("vsock", port=port)
    raise ValueError(f"bad listen address {addr!r}: use unix:PATH, vsock:PORT or serial:DEVICE")


class FdTransport(asyncio.Transport):
    """A non-blocking byte-stream transport over a raw fd (vsock socket or serial port)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        protocol: Connection,
        *,
        peername: Any = None,
        serial: bool = False,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._loop = loop
        self._fd = fd
        self._protocol = protocol
        self._peername = peername
        self._serial = serial
        self._on_close = on_close
        self._buf = bytearray()
        self._closing = False
        self._paused_proto = False
        self._reading = False
        self._reading_paused = False  # by the protocol, while its peer does not read
        self._poll_handle: asyncio.TimerHandle | None = None
        os.set_blocking(fd, False)
        protocol.connection_made(self)
        self._start_reading()

    # -- reading ------------------------------------------------------------------
    def _start_reading(self) -> None:
        if not self._reading and not self._closing and not self._reading_paused:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def pause_reading(self) -> None:
        self._reading_paused = True
        self._stop_reading()

    def resume_reading(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            if self._poll_handle is None:  # a serial port waiting for its host polls instead
                self._start_reading()

    def is_reading(self) -> bool:
        return self._reading

    def _stop_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def _on_readable(self) -> None:
        # Straight into the session's decoder, as uvloop does for a BufferedProtocol.
        try:
            nbytes = os.readv(self._fd, [self._protocol.get_buffer(-1)])
        except BlockingIOError:
            return
        except OSError as exc:
            if self._serial and exc.errno in (errno.EIO, errno.EPIPE, errno.ECONNRESET):
                self._serial_peer_gone()
                return
            self._force_close(exc)
            return
        if not nbytes:
            if self._serial:
                self._serial_peer_gone()
            else:
                self._force_close(None)
            return
        self._protocol.buffer_updated(nbytes)

    def _serial_peer_gone(self) -> None:
        # The host side closed the port. Keep the device open and poll for its return.
        self._stop_reading()
        self._buf.clear()
        self._protocol.peer_reset()
        self._poll_handle = self._loop.call_later(SERIAL_POLL_S, self._serial_poll)

    def _serial_poll(self) -> None:
        self._poll_handle = None
        if self._closing:
            return
        try:
            data = os.read(self._fd, READ_SIZE)
        except BlockingIOError:
            self._start_reading()  # connected, nothing to read yet
            return
        except OSError:
            data = b""
        if not data:
            self._poll_handle = self._loop.call_later(SERIAL_POLL_S, self._serial_poll)
            return
        self._start_reading()
        self._protocol.data_received(data)

    # -- writing ------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        if not self._buf:
            try:
                n = os.write(self._fd, data)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                self._write_failed(exc)
                return
            if n == len(data):
                return
            data = memoryview(data)[n:]
            self._loop.add_writer(self._fd, self._on_writable)
        self._buf += data
        if not self._paused_proto and len(self._buf) > HIGH_WATER:
            self._paused_proto = True
            self._protocol.pause_writing()

    def _on_writable(self) -> None:
        try:
            n = os.write(self._fd, self._buf)
        except BlockingIOError:
            return
        except OSError as exc:
            self._write_failed(exc)
            return
        del self._buf[:n]
        if not self._buf:
            self._loop.remove_writer(self._fd)
            if self._closing:
                self._finish_close(None)
                return
        if self._paused_proto and len(self._buf) <= LOW_WATER:
            self._paused_proto = False
            self._protocol.resume_writing()

    def _write_failed(self, exc: OSError) -> None:
        if self._serial:
            # Host side gone mid-write: what we had is for a peer that left.
            self._buf.clear()
            self._loop.remove_writer(self._fd)
            if self._paused_proto:
                self._paused_proto = False
                self._protocol.resume_writing()
            return
        self._force_close(exc)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass  # fixed HIGH_WATER / LOW_WATER

    def get_write_buffer_size(self) -> int:
        return len(self._buf)

    # -- lifecycle ----------------------------------------------------------------
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self._peername
        return default

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._stop_reading()
        if not self._buf:
            self._loop.call_soon(self._finish_close, None)

    def abort(self) -> None:
        if self._fd >= 0:
            self._force_close(None)

    def _force_close(self, exc: Exception | None) -> None:
        self._closing = True
        self._stop_reading()
        self._buf.clear()
        self._loop.remove_writer(self._fd)
        self._finish_close(exc)

    def _finish_close(self, exc: Exception | None) -> None:
        if self._fd < 0:
            return
        if self._poll_handle is not None:
            self._poll_handle.cancel()
        fd, self._fd = self._fd, -1
        self._loop.remove_writer(fd)
        self._loop.remove_reader(fd)
        os.close(fd)
        self._protocol.connection_lost(exc)
        if self._on_close is not None:
            self._on_close()


class Listener:
    """A bound address; ``close`` stops accepting (existing connections stay)."""

    def __init__(self, address: ListenAddress, closer: Callable[[], None]) -> None:
        self.address = address
        self._closer = closer

    def close(self) -> None:
        self._closer()


async def listen(address: ListenAddress, host: ConnectionHost, allowed_cids: Set[int]) -> Listener:
    """Serve ``address``: each peer gets a Connection to ``host``; on vsock, only peers whose CID
    is in ``allowed_cids``."""
    loop = asyncio.get_running_loop()
    if address.scheme == "unix":
        return await _listen_unix(host, loop, address)
    if address.scheme == "vsock":
        return _listen_vsock(host, loop, address, allowed_cids)
    return _listen_serial(host, loop, address)


class AddressInUse(OSError):
    """A listen address a live server answers on: guestd refuses to take it over."""


def _answers(path: str) -> bool:
    """True when a server accepts connections on the Unix socket at ``path`` (a full backlog
    counts: someone listens). A socket file nobody listens on refuses at once: stale. A socket of
    another type (a datagram socket left at the path, EPROTOTYPE to a stream connect) is probed
    with its own type, so a stale one is replaced as before and a live one is not taken over."""
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):
        probe = socket.socket(socket.AF_UNIX, kind)
        probe.setblocking(False)  # AF_UNIX connect never waits for the peer: it connects, refuses or EAGAINs
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except BlockingIOError:
            return True
        except OSError as exc:
            if exc.errno == errno.EPROTOTYPE:
                continue  # not this type of socket: the next one
            raise
        finally:
            probe.close()
        return True
    return False


def refuse_live_unix_socket(path: str) -> None:
    """Raise AddressInUse when a live server (another guestd, say) answers at ``path``: taking
    its path over would leave it unreachable, and its removal on exit would strand us. Called
    before guestd sets anything up, and again just before the bind."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return  # not a socket: the bind fails (EADDRINUSE) and nothing is removed
    except FileNotFoundError:
        return
    if _answers(path):
        raise AddressInUse(
            errno.EADDRINUSE,
            f"unix:{path} is served by a live process (another guestd?): refusing to take it over; "
            "stop that one or give this guestd another --listen unix:PATH",
        )


async def _listen_unix(host: ConnectionHost, loop: asyncio.AbstractEventLoop, address: ListenAddress) -> Listener:
    path = address.path
    refuse_live_unix_socket(path)
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)  # stale: nothing answers there (a previous run that was killed)
    except FileNotFoundError:
        pass
    old_umask = os.umask(0o177)  # created 0600: only the owner (root in a guest) may connect
    try:
        server = await loop.create_unix_server(lambda: Connection(host, "unix"), path, backlog=512)
    finally:
        os.umask(old_umask)
    bound = os.lstat(path)

    def closer() -> None:
        server.close()
        # Only our own socket: a path someone replaced since (a newer guestd) stays theirs.
        try:
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino):
                os.unlink(path)
        except OSError:
            pass

    return Listener(address, closer)


def _listen_vsock(
    host: ConnectionHost, loop: asyncio.AbstractEventLoop, address: ListenAddress, allowed_cids: Set[int]
) -> Listener:
    sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    sock.bind((socket.VMADDR_CID_ANY, address.port))
    sock.listen(128)
    sock.setblocking(False)

    def on_accept() -> None:
        try:
            conn, (cid, port) = sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("vsock accept failed: %s", exc)
            return
        if cid not in allowed_cids:
            log.warning("vsock: refused peer cid %d (allowed: %s)", cid, sorted(allowed_cids))
            conn.close()
            return
        fd = conn.detach()
        FdTransport(loop, fd, Connection(host, "vsock"), peername=(cid, port))

    loop.add_reader(sock.fileno(), on_accept)

    def closer() -> None:
        loop.remove_reader(sock.fileno())
        sock.close()

    return Listener(address, closer)


def _listen_serial(host: ConnectionHost, loop: asyncio.AbstractEventLoop, address: ListenAddress) -> Listener:
    state: dict[str, Any] = {"closed": False, "transport": None}

    def schedule_reopen() -> None:
        loop.call_later(SERIAL_POLL_S, reopen)

    def open_port() -> None:
        if state["closed"]:
            return
        fd = os.open(address.path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        if os.isatty(fd):
            import termios  # serial only: not on the start path of a socket listener
            import tty

            tty.setraw(fd, termios.TCSANOW)  # a pty or real tty must pass bytes untouched
        state["transport"] = FdTransport(
            loop,
            fd,
            Connection(host, "serial", serial=True),
            peername=address.path,
            serial=True,
            on_close=schedule_reopen,
        )

    def reopen() -> None:
        # The session object is long-lived; only a hard device error gets here. Retry quietly.
        try:
            open_port()
        except OSError as exc:
            log.warning("serial %s: %s; retrying", address.path, exc)
            loop.call_later(1.0, reopen)

    open_port()

    def closer() -> None:
        state["closed"] = True
        tr = state["transport"]
        if tr is not None:
            tr.close()

    return Listener(address, closer)
