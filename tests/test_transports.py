"""Transports other than a plain Unix socket: hybrid vsock (fc:) and serial (pty stand-in)."""

from __future__ import annotations

import asyncio
import os
import pty
import select
import socket
import threading
import time
import tty
from collections.abc import Callable, Iterator

import pytest

from guestd.client import AsyncClient, Client, GuestdError
from guestd.testing import Guestd
from guestd.wire.frames import Kind, encode_frame


class HybridVsockMuxer:
    """A small stand-in for Firecracker's vsock muxer: a Unix socket that accepts
    ``CONNECT <port>\\n``, answers ``OK <n>\\n`` and relays to the guest's listener."""

    def __init__(self, path: str, ports: dict[int, str], reply: bytes | None = None) -> None:
        self.path = path
        self.ports = ports
        self.reply = reply  # overrides the OK line, to test hostile replies
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        self.threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        line = b""
        while not line.endswith(b"\n") and len(line) < 64:
            b = conn.recv(1)
            if not b:
                conn.close()
                return
            line += b
        parts = line.split()
        if len(parts) != 2 or parts[0] != b"CONNECT" or int(parts[1]) not in self.ports:
            conn.close()  # what Firecracker does for a port nobody listens on
            return
        guest = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        guest.connect(self.ports[int(parts[1])])
        conn.sendall(self.reply if self.reply is not None else b"OK 1073741824\n")
        self._relay(conn, guest)

    @staticmethod
    def _relay(a: socket.socket, b: socket.socket) -> None:
        socks = [a, b]
        try:
            while True:
                r, _, _ = select.select(socks, [], [], 30)
                if not r:
                    return
                for s in r:
                    data = s.recv(1 << 20)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
        except OSError:
            return
        finally:
            a.close()
            b.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def muxer(guestd: Guestd, tmp_path: object) -> Iterator[Callable[..., HybridVsockMuxer]]:
    made: list[HybridVsockMuxer] = []

    def make(reply: bytes | None = None) -> HybridVsockMuxer:
        m = HybridVsockMuxer(f"{tmp_path}/v{len(made)}.sock", {10700: guestd.sock_path}, reply)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def test_hybrid_vsock_client_end_to_end(muxer: Callable[..., HybridVsockMuxer], tmp_path: object) -> None:
    m = muxer()
    with Client(f"fc:{m.path}:10700") as c:
        assert c.ping() > 0
        assert c.exec(["echo", "via-fc"]).stdout == b"via-fc\n"
        data = os.urandom(3 << 20)
        c.upload(data, f"{tmp_path}/fc.bin")
        assert c.download(f"{tmp_path}/fc.bin") == data


@pytest.mark.parametrize("reply", [b"NOPE\n", b"OK\n", b"X" * 200, b""])
def test_hybrid_vsock_bad_replies_are_typed(muxer: Callable[..., HybridVsockMuxer], reply: bytes) -> None:
    m = muxer(reply=reply)
    with pytest.raises(GuestdError) as ei:
        Client(f"fc:{m.path}:10700", connect_timeout=3)
    assert ei.value.code in ("protocol_error", "cancelled", "timeout")


def test_hybrid_vsock_unknown_port(muxer: Callable[..., HybridVsockMuxer]) -> None:
    m = muxer()
    with pytest.raises(GuestdError) as ei:
        Client(f"fc:{m.path}:999", connect_timeout=3)
    assert ei.value.code == "protocol_error" and "port 999" in ei.value.message


def test_bad_addresses() -> None:
    for addr in ("tcp:1.2.3.4:5", "unix:", "vsock:x:1", "fc:/p", "nothing"):
        with pytest.raises(ValueError):
            Client(addr)


class SerialBridge:
    """Relays a socketpair end to a pty master, standing in for the host side of a virtio-serial port."""

    def __init__(self) -> None:
        self.master, slave = pty.openpty()
        tty.setraw(self.master)
        self.slave_path = os.ttyname(slave)
        self._slave = slave  # kept open so the pty never reports hang-up between clients
        self.stop = threading.Event()

    def attach(self) -> socket.socket:
        mine, theirs = socket.socketpair()
        t = threading.Thread(target=self._relay, args=(mine,), daemon=True)
        t.start()
        return theirs

    def _relay(self, s: socket.socket) -> None:
        while not self.stop.is_set():
            r, _, _ = select.select([s.fileno(), self.master], [], [], 0.2)
            for fd in r:
                if fd == s.fileno():
                    data = s.recv(65536)
                    if not data:
                        return
                    os.write(self.master, data)
                else:
                    s.sendall(os.read(self.master, 65536))

    def write_raw(self, data: bytes) -> None:
        os.write(self.master, data)


def test_serial_transport_session_and_resync(fresh_guestd: Callable[..., Guestd]) -> None:
    bridge = SerialBridge()
    g = fresh_guestd(listen=[f"serial:{bridge.slave_path}"])
    # Line noise before the first frame (a reconnecting host, a console banner) is skipped.
    bridge.write_raw(b"garbage\r\n\x00\xffGD")

    async def session(sock: socket.socket) -> None:
        c = await AsyncClient.from_socket(sock)
        assert (await c.exec(["echo", "serial"])).stdout == b"serial\n"
        data = os.urandom(2 << 20)
        await c.upload(data, f"{g.workdir}/s.bin")
        assert await c.download(f"{g.workdir}/s.bin") == data
        await c.close()

    asyncio.run(session(bridge.attach()))
    # A second host session on the same long-lived port: a partial frame left behind
    # by the first host is resynced past, and a fresh hello starts a new session.
    bridge.write_raw(encode_frame(Kind.REQUEST, 1, {"op": "ping"})[:7])
    time.sleep(1.5)  # > the serial stall limit: the stale partial frame is forgotten
    asyncio.run(session(bridge.attach()))
    bridge.stop.set()
    assert g.alive()
