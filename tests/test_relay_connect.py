"""A relay connect in one round trip (issue 34).

- A forward's host connection: its ``port.connect`` goes out when the host connects, and the
  host's first bytes (and eof) go right behind it, before the guest side is connected; guestd
  holds them until its socket is open (tests/test_relay_streams.py). Before, the forward read
  nothing from the host until ``connected`` came back: a connect and a first request cost two
  round trips.
- guestd says ``connected`` before the guest socket's transport is attached; a stream cut
  short while it attaches still resets the workload's socket, and one that fails to connect
  leaves no socket behind.

The fake guest (conftest's ``evil``) makes the order exact: it answers ``connected`` only
once it has the host's bytes, which a forward that waits for ``connected`` never sends.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from typing import Any

import uvloop

from guestd.client import AsyncClient, Client
from guestd.testing import Guestd
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind

REQUEST = b"GET / HTTP/1.0\r\n\r\n"


def _input_until_eof(peer: RawPeer, rid: int) -> tuple[bytes, list[int]]:
    """The data of ``rid``'s INPUT frames up to its eof, and the kinds of every frame seen."""
    got, kinds = b"", []
    while True:
        kind, frame_id, body = peer.recv()
        kinds.append(kind)
        if kind == Kind.INPUT and frame_id == rid:
            got += body.get("data", b"")
            if body.get("eof"):
                return got, kinds


def test_a_forwards_first_bytes_travel_with_its_connect_before_the_guest_side_connects(evil: Any) -> None:
    seen: dict[str, Any] = {}
    answered = threading.Event()

    def script(peer: RawPeer) -> None:
        kind, rid, req = peer.recv()
        seen["request"] = (kind, req)
        # Nothing is answered yet: what the host sent must come without a `connected`.
        seen["before_connected"] = _input_until_eof(peer, rid)
        peer.send(Kind.EVENT, rid, {"ev": "connected"})
        peer.send(Kind.EVENT, rid, {"ev": "data", "data": b"HTTP/1.0 200 OK\r\n\r\nhi"})
        peer.send(Kind.EVENT, rid, {"ev": "eof"})
        peer.send(Kind.RESPONSE, rid, {"sent": len(REQUEST), "received": 21})
        answered.set()
        while True:
            peer.recv()  # window frames; the test ends by closing the client

    with Client(evil(script)) as c, c.port_forward(8000) as fwd:
        with socket.create_connection(("127.0.0.1", fwd.local_port), timeout=30) as host:
            host.sendall(REQUEST)
            host.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := host.recv(65536):
                answer += chunk
        assert answered.wait(30)
    kind, req = seen["request"]
    assert kind == Kind.REQUEST and req["op"] == "port.connect" and req["args"]["port"] == 8000
    data, kinds = seen["before_connected"]
    assert data == REQUEST
    assert Kind.CANCEL not in kinds
    assert answer == b"HTTP/1.0 200 OK\r\n\r\nhi"


def test_a_host_connection_that_sends_and_leaves_before_the_guest_side_connects_is_delivered(evil: Any) -> None:
    """A host that writes and closes at once (a fire-and-forget sender): its bytes and eof
    reach the guest side, not a reset (the forward used to abort the guest side of a host
    connection that was gone by the time it connected, with what the host sent)."""
    seen: dict[str, Any] = {}
    done = threading.Event()

    def script(peer: RawPeer) -> None:
        _kind, rid, _req = peer.recv()
        seen["input"] = _input_until_eof(peer, rid)
        peer.send(Kind.EVENT, rid, {"ev": "connected"})
        peer.send(Kind.EVENT, rid, {"ev": "eof"})
        peer.send(Kind.RESPONSE, rid, {"sent": 5, "received": 0})
        done.set()
        while True:
            kind, frame_id, body = peer.recv()
            seen.setdefault("after", []).append((kind, frame_id))
            if kind == Kind.REQUEST and body["op"] == "ping":
                peer.send(Kind.RESPONSE, frame_id, {"t_ns": 1})

    with Client(evil(script)) as c, c.port_forward(8000) as fwd:
        with socket.create_connection(("127.0.0.1", fwd.local_port), timeout=30) as host:
            host.sendall(b"bytes")
        assert done.wait(30)
        assert c.ping() > 0  # a round trip: whatever the client sent after the reply has come
    data, kinds = seen["input"]
    assert data == b"bytes" and Kind.CANCEL not in kinds
    assert all(kind != Kind.CANCEL for kind, _ in seen.get("after", []))


def test_a_forward_to_a_refused_port_resets_the_host_connection_and_says_why(guestd: Guestd) -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    with Client(guestd.address) as c, c.port_forward(port) as fwd:
        with socket.create_connection(("127.0.0.1", fwd.local_port), timeout=30) as host:
            host.sendall(REQUEST)
            try:
                got = host.recv(65536)
            except ConnectionResetError:
                got = b""
        assert got == b""
        for _ in range(1000):  # the error is recorded by the callback that reset the host side
            if fwd.forward.errors:
                break
            c.ping()
        assert [e.details.get("reason") for e in fwd.forward.errors] == ["refused"]


def _syn_sent_to(port: int) -> int:
    """Sockets of this network namespace whose connect to 127.0.0.1:``port`` waits for an answer."""
    count = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for row in table:
            fields = row.split()
            if fields[2] == f"0100007F:{port:04X}" and fields[3] == "02":  # SYN_SENT
                count += 1
    return count


def test_a_connect_that_waits_for_the_handshake_is_relayed(guestd: Guestd) -> None:
    """The slow path of guestd's hand-made connect: the listener's backlog is full, so the SYN
    goes unanswered (connect() returns EINPROGRESS) until the listener accepts and the SYN is
    sent again; guestd waits for writability, then attaches the same socket to a transport."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))  # the backlog's one place
    listener.settimeout(30)

    async def main() -> bytes:
        c = await AsyncClient.connect(guestd.address)
        try:
            opening = asyncio.ensure_future(c.open_port(port, connect_timeout_s=30))
            for _ in range(3000):  # guestd's SYN is out and unanswered
                if _syn_sent_to(port):
                    break
                await asyncio.sleep(0.01)
            assert _syn_sent_to(port) and not opening.done()
            first, _ = await asyncio.to_thread(listener.accept)  # room in the backlog: the SYN's retry gets in
            first.close()
            reader, writer = await opening
            conn, _ = await asyncio.to_thread(listener.accept)
            with conn:
                writer.write(b"through")
                writer.write_eof()
                got = b""
                while chunk := await asyncio.to_thread(conn.recv, 65536):
                    got += chunk
                conn.sendall(b"back")
            answer = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            return got + b"/" + answer
        finally:
            await c.close()

    try:
        assert uvloop.run(main()) == b"through/back"
    finally:
        filler.close()
        listener.close()


def test_many_connects_leave_no_socket_behind_in_guestd(guestd: Guestd) -> None:
    """Connected, refused and cancelled-at-once streams: guestd's open descriptors come back to
    where they were (a socket connected by hand is closed on every path)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    fds = f"/proc/{guestd.proc.pid}/fd"
    try:
        with Client(guestd.address) as c:
            c.ping()
            before = len(os.listdir(fds))
            for i in range(200):
                stream = c.aio._conn.start("port.connect", {"port": port if i % 3 else 1})
                if i % 2:
                    c._run(_cancel_soon(c, stream))
                else:
                    c._run(_wait_end(c, stream))
            for _ in range(1000):
                if len(os.listdir(fds)) <= before:
                    break
                c.ping()
            assert len(os.listdir(fds)) <= before
    finally:
        stop.set()
        acceptor.join(5)
        listener.close()
        for s in accepted:
            s.close()


async def _cancel_soon(c: Client, call: Any) -> None:
    call.cancel()
    try:
        await call.future
    except Exception:
        pass


async def _wait_end(c: Client, call: Any) -> None:
    """Until ``connected`` (then cancel) or the error (refused)."""
    if await call.next_event(30) is not None:
        call.cancel()
    try:
        await call.future
    except Exception:
        pass
