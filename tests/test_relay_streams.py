"""A relay stream's edges (issue 34 reworked it: one task per stream, INPUT taken as it arrives,
the client's sender started on first use). The guest side here is a loopback listener in this
process, which a plain guestd reaches as it would a workload's server; the client speaks raw
frames where the order and the credit must be exact."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvloop

from guestd.client import AsyncClient
from guestd.testing import Guestd, StartGuestd
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind, encode_frame


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.settimeout(30)
    yield s
    s.close()


def serve_one(listener: socket.socket, handle: Callable[[socket.socket], Any]) -> dict[str, Any]:
    """Accept one connection in a thread and run ``handle`` on it; what it returns lands in
    the dict's ``result`` (its exception in ``error``)."""
    out: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(30)
                out["result"] = handle(conn)
        except Exception as exc:  # reported by the test through ``out``
            out["error"] = exc
        finally:
            done.set()

    out["done"] = done
    threading.Thread(target=run, daemon=True).start()
    return out


def raw_peer(guestd: Guestd) -> tuple[RawPeer, dict[str, Any]]:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    sock.connect(guestd.sock_path)
    peer = RawPeer(sock)
    return peer, peer.hello()


def read_all(conn: socket.socket) -> bytes:
    got = b""
    while chunk := conn.recv(65536):
        got += chunk
    return got


def test_input_sent_with_the_request_reaches_the_socket_in_order(guestd: Guestd, listener: socket.socket) -> None:
    """Data and eof sent before `connected` (in the same write as the request) wait for the
    socket and go out in order; the stream ends with their count."""
    served = serve_one(listener, read_all)
    peer, _ = raw_peer(guestd)
    port = listener.getsockname()[1]
    peer.send_bytes(
        b"".join(
            [
                encode_frame(Kind.REQUEST, 1, {"op": "port.connect", "args": {"port": port}}),
                encode_frame(Kind.INPUT, 1, {"data": b"first "}),
                encode_frame(Kind.INPUT, 1, {"data": b"second", "eof": True}),
            ]
        )
    )
    kind, rid, body = peer.recv()
    assert (kind, rid, body) == (Kind.EVENT, 1, {"ev": "connected"})
    assert served["done"].wait(30)
    assert served.get("result") == b"first second", served
    events, granted = [], 0
    while True:
        kind, rid, body = peer.recv()
        if kind == Kind.EVENT:
            events.append(body)
        elif kind == Kind.WINDOW:
            granted += body["bytes"]  # the credit back for what the socket took
        else:
            break
    assert (kind, rid, body) == (Kind.RESPONSE, 1, {"sent": 12, "received": 0})
    assert events == [{"ev": "eof"}] and granted == 12


def test_data_after_a_reset_ends_a_stream_that_waits_for_credit(guestd: Guestd, listener: socket.socket) -> None:
    """The workload floods past the client's credit, then resets. The stream waits for credit
    it will not get (this client grants none), yet the client's next data, which can no longer
    reach the workload, ends it at once with the reset error."""

    peer, hello = raw_peer(guestd)
    window = hello["stream_window"]

    def flood_then_reset(conn: socket.socket) -> None:
        # Past the window and whatever guestd and the kernel buffer, until guestd stops reading.
        conn.settimeout(0.2)
        block, sent, stalls = b"f" * 65536, 0, 0
        while sent < window + (1 << 20) or stalls < 1:
            try:
                sent += conn.send(block)
                stalls = 0
            except TimeoutError:
                stalls += 1
                assert stalls < 150, f"guestd stopped reading after {sent} bytes"
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    served = serve_one(listener, flood_then_reset)
    peer.request(1, "port.connect", {"port": listener.getsockname()[1]})
    assert peer.recv() == (Kind.EVENT, 1, {"ev": "connected"})
    received = 0
    while received < window:  # the whole window comes, and nothing more without a grant
        kind, rid, body = peer.recv()
        assert (kind, rid, body.get("ev")) == (Kind.EVENT, 1, "data"), body
        received += len(body["data"])
    assert received == window
    assert served["done"].wait(60) and "error" not in served, served
    final = None
    for _ in range(50):  # bounded: the first writes may still reach the socket before it reports the reset
        peer.send(Kind.INPUT, 1, {"data": b"x"})
        peer.request(100, "ping")
        while final is None:
            kind, rid, body = peer.recv()
            if rid == 1 and kind in (Kind.RESPONSE, Kind.ERROR):
                final = (kind, body)
            elif rid == 100:
                break
            else:
                assert (rid, kind) == (1, Kind.WINDOW), (kind, rid, body)  # credit for a byte it took
        if final is not None:
            break
    assert final is not None, "the stream did not end"
    kind, body = final
    assert kind == Kind.ERROR and body["details"] == {"stage": "relay", "reason": "reset"}, body


def test_a_stream_that_never_writes_still_sends_its_eof_on_close(guestd: Guestd, listener: socket.socket) -> None:
    """The client starts a stream's sender only when there is something to send: close() on a
    stream that never wrote must still send the eof, so the workload sees a clean end."""
    served = serve_one(listener, read_all)

    async def main() -> None:
        c = await AsyncClient.connect(guestd.address)
        try:
            reader, writer = await c.open_port(listener.getsockname()[1])
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), 30)
            assert await reader.read() == b""
        finally:
            await c.close()

    asyncio.run(main())
    assert served["done"].wait(30)
    assert served.get("result") == b"", served


def echo_to_eof(conn: socket.socket) -> bytes:
    got = read_all(conn)
    conn.sendall(got)
    return got


def test_a_forward_on_uvloop_keeps_what_the_host_sent_before_the_guest_side_connected(
    guestd: Guestd, listener: socket.socket
) -> None:
    """uvloop starts reading a transport right after connection_made, so the pause the
    forward asked for there did not hold: a host connection's first bytes (and its eof)
    arrived while the guest side was still connecting and were dropped (an HTTP request
    through a forward hung; bench/relay.py on uvloop). They wait for the guest side now."""
    served = serve_one(listener, echo_to_eof)

    async def main() -> bytes:
        c = await AsyncClient.connect(guestd.address)
        try:
            async with await c.port_forward(listener.getsockname()[1]) as fwd:
                reader, writer = await asyncio.open_connection("127.0.0.1", fwd.local_port)
                writer.write(b"GET / HTTP/1.0\r\n\r\n")
                writer.write_eof()
                answer = await asyncio.wait_for(reader.read(), 30)
                writer.close()
                return answer
        finally:
            await c.close()

    assert uvloop.run(main()) == b"GET / HTTP/1.0\r\n\r\n"
    assert served["done"].wait(30) and served.get("result") == b"GET / HTTP/1.0\r\n\r\n", served


def test_a_reverse_forward_keeps_a_banner_the_destination_sends_at_once(fresh_guestd: StartGuestd) -> None:
    """A host destination that speaks first (an SSH or SMTP banner) may send before the guest
    side of its relay is open; those bytes were dropped. They wait for it now."""
    d = tempfile.mkdtemp(prefix="guestd-reverse-")
    with open(os.path.join(d, "guestd.toml"), "w") as f:
        f.write("[ports]\nreverse = true\n")
    g = fresh_guestd("--config", os.path.join(d, "guestd.toml"))
    destination = socket.socket()
    destination.bind(("127.0.0.1", 0))
    destination.listen(8)
    destination.settimeout(30)

    def banner_then_echo() -> None:
        conn, _ = destination.accept()
        with conn:
            conn.sendall(b"220 banner\r\n")
            conn.sendall(read_all(conn))

    threading.Thread(target=banner_then_echo, daemon=True).start()

    async def main() -> bytes:
        c = await AsyncClient.connect(g.address)
        try:
            async with await c.reverse_forward(0, ("127.0.0.1", destination.getsockname()[1])) as fwd:
                # A process in the guest connecting to the forward (here: the same loopback).
                with socket.create_connection(("127.0.0.1", fwd.guest_port), timeout=30) as s:
                    return await asyncio.to_thread(_banner_and_echo, s)
        finally:
            await c.close()

    try:
        assert uvloop.run(main()) == b"220 banner\r\nping\r\n"
    finally:
        destination.close()
        shutil.rmtree(d, ignore_errors=True)


def _banner_and_echo(s: socket.socket) -> bytes:
    got = b""
    while not got.endswith(b"\r\n"):
        chunk = s.recv(100)
        if not chunk:
            break
        got += chunk
    s.sendall(b"ping\r\n")
    s.shutdown(socket.SHUT_WR)
    return got + read_all(s)
