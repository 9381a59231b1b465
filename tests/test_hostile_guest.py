"""The client against a compromised guest: it must neither hang nor grow without bound."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import pytest

from guestd.client import Client, GuestdError, GuestProtocolError
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import HEADER, MAGIC, Kind, encode_frame


def test_oversize_frame_closes_the_connection(evil: Callable[..., str]) -> None:
    def script(p: RawPeer) -> None:
        _, rid, _ = p.recv()
        p.send_bytes(HEADER.pack(MAGIC, 1, Kind.RESPONSE, 1 << 30, rid))  # "a 1 GiB reply follows"
        p.sock.recv(1)

    with Client(evil(script)) as c, pytest.raises(GuestProtocolError):
        c.ping(deadline=10)


def test_wrongly_typed_reply_is_a_protocol_error(evil: Callable[..., str]) -> None:
    def script(p: RawPeer) -> None:
        _, rid, _ = p.recv()
        p.send(Kind.RESPONSE, rid, {"t_ns": "not a number"})
        p.sock.recv(1)

    with Client(evil(script)) as c, pytest.raises(GuestProtocolError):
        c.ping(deadline=10)


def test_stream_beyond_the_granted_window_is_refused(evil: Callable[..., str]) -> None:
    def script(p: RawPeer) -> None:
        _, rid, _ = p.recv()
        for _ in range(200):  # 200 x 32 KiB, never waiting for WINDOW
            p.send_bytes(encode_frame(Kind.EVENT, rid, {"ev": "data", "data": b"z" * 32768}))
        p.sock.recv(1)

    async def no_reader(c: Client) -> None:
        call = c.aio._conn.start("file.download", {"path": "/anything"})  # events are never consumed
        await c.aio._conn.wait(call, 10)

    with Client(evil(script)) as c, pytest.raises(GuestProtocolError):
        c._run(no_reader(c))


def test_more_download_bytes_than_the_file_has(evil: Callable[..., str]) -> None:
    def script(p: RawPeer) -> None:
        _, rid, _ = p.recv()
        p.send(Kind.EVENT, rid, {"ev": "start", "size": 10})
        p.send(Kind.EVENT, rid, {"ev": "data", "data": b"y" * 100})
        p.sock.recv(1)

    with Client(evil(script)) as c, pytest.raises(GuestProtocolError):
        c.download("/anything", progress_timeout=10)


def test_a_silent_guest_hits_the_client_deadline(evil: Callable[..., str]) -> None:
    def script(p: RawPeer) -> None:
        p.recv()
        p.sock.recv(1)  # never answers

    with Client(evil(script)) as c, pytest.raises(GuestdError) as ei:
        c.ping(deadline=0.5)
    assert ei.value.code == "timeout"


def test_garbage_instead_of_a_hello(tmp_path: object) -> None:
    path = f"{tmp_path}/junk.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n" * 10)
        conn.recv(1)

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(GuestdError):
        Client(f"unix:{path}", connect_timeout=5)
    srv.close()


def test_replies_to_ids_never_sent_are_ignored(evil: Callable[..., str]) -> None:
    def script(p: RawPeer) -> None:
        _, rid, _ = p.recv()
        for bogus in (rid + 1000, 0xFFFFFFFF):
            p.send(Kind.RESPONSE, bogus, {"t_ns": 1})
            p.send(Kind.EVENT, bogus, {"ev": "data", "data": b"x" * 1000})
            p.send(Kind.ERROR, bogus, {"code": "internal", "message": "for nobody"})
        p.send(Kind.RESPONSE, rid, {"t_ns": 42})
        p.sock.recv(1)

    with Client(evil(script)) as c:
        assert c.ping(deadline=10) == 42
