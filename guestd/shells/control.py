"""guestd's end of a session's status channel: the marker of each command, believed only when
bash itself wrote it (SO_PASSCRED) with the nonce guestd chose for that command."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct

from guestd.shells.script import Marker, take_marker

log = logging.getLogger("guestd.shells")

_CREDS_SPACE = socket.CMSG_SPACE(struct.calcsize("iII"))  # struct ucred: pid, uid, gid


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(guestd's end, bash's end): guestd's tells who wrote each byte, and never blocks."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        ours.setblocking(False)
    except BaseException:
        ours.close()
        theirs.close()
        raise
    return ours, theirs


def sender_pid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= 12:
            return int(struct.unpack("iII", data[:12])[0])
    return None


class StatusChannel:
    """Reads guestd's end of the status socket of one bash (``writer``: its pid)."""

    def __init__(self, sock: socket.socket, writer: int) -> None:
        self.sock: socket.socket | None = sock
        self.writer = writer
        self.forged_bytes = 0  # bytes from another process, or without the expected nonce
        self.stranger_logged = False  # bytes from another process are logged once a session
        self._buf = bytearray()
        self._nonce: bytes | None = None  # the marker guestd waits for now
        self._marker: asyncio.Future[Marker] | None = None
        # Done at end of file: every copy of bash's end is closed (bash exited, or never had
        # it), so no marker can come any more.
        self.writer_gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().add_reader(sock.fileno(), self.on_readable)

    def expect(self) -> str:
        """A fresh nonce for the next marker, and a fresh future for it."""
        nonce = os.urandom(16).hex()
        self._nonce = nonce.encode()
        self._marker = asyncio.get_running_loop().create_future()
        self._scan()  # bytes that arrived before (none of them can carry the new nonce)
        return nonce

    @property
    def marker(self) -> asyncio.Future[Marker]:
        assert self._marker is not None
        return self._marker

    def on_readable(self) -> None:
        sock = self.sock
        if sock is None:
            return
        try:
            data, ancillary, _flags, _addr = sock.recvmsg(65536, _CREDS_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancillary = b"", []
        if not data:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            if not self.writer_gone.done():
                self.writer_gone.set_result(None)
            return
        sender = sender_pid(ancillary)
        if sender != self.writer:
            if not self.stranger_logged:  # a workload that keeps at it is not logged each time
                self.stranger_logged = True
                log.warning(
                    "status bytes of shell %d from pid %s, not bash: dropped (the rest are counted)",
                    self.writer,
                    sender,
                )
            self.forged_bytes += len(data)  # a process the command started, not bash
            return
        self._buf += data
        self._scan()

    def _scan(self) -> None:
        nonce, marker = self._nonce, self._marker
        if nonce is None or marker is None or marker.done():
            self.forged_bytes += len(self._buf)
            self._buf.clear()
            return
        dropped, found = take_marker(self._buf, nonce)
        self.forged_bytes += dropped
        if found is not None:
            self._nonce = None
            marker.set_result(found)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
