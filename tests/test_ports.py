"""Ports (issue 17): guestd runs in a private network namespace (``unshare -n``), so this host
reaches the guest's ports only through guestd's relay; servers run in the guest as guestd
processes (tests/port_servers.py). What is proven: HTTP (urllib), a WebSocket and a headless
browser through a host forward; half-close and resets either way; typed connect errors; 100
streams at once; the stream limit and port policy; discovery, the watch and port.wait; a
workload that floods or never reads costs guestd one window; reverse forwards reach the one
host destination the host named, are off by default, and a guest cannot pick another."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from guestd.client import AsyncClient, Client, GuestdError, GuestProtocolError
from guestd.testing import REPO, Guestd, StartGuestd, limits_config, start_guestd
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind
from tests.port_servers import ws_accept, ws_frame, ws_read_frame

SERVERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "port_servers.py")
NETNS = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
HTTP, ECHO, HALF, RESET, WATCHRESET, FLOOD, SINK = 18080, 18081, 18082, 18083, 18084, 18085, 18086
FULL = 18087  # started by its test: port_wait's probe would wait on it
PAGE = b"""<!doctype html><html><body><p id="static">served in the guest</p><p id="js"></p>
<script>document.getElementById("js").textContent = "rendered by " + "script " + (6 * 7);</script>
</body></html>"""
BINARY = bytes(range(256)) * 257


def _netns_usable() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None or os.geteuid() != 0:
        return False
    return subprocess.run([*NETNS, "true"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def guest() -> Iterator[Guestd]:
    """guestd alone in a network namespace, reverse forwards on, every test server running."""
    if not _netns_usable():
        pytest.skip("needs root, unshare and ip (a private network namespace)")
    d = tempfile.mkdtemp(prefix="guestd-ports-")
    with open(os.path.join(d, "guestd.toml"), "w") as f:
        f.write("[ports]\nreverse = true\n")
    site = os.path.join(d, "site")
    os.mkdir(site)
    with open(os.path.join(site, "index.html"), "wb") as f:
        f.write(PAGE)
    with open(os.path.join(site, "blob.bin"), "wb") as f:
        f.write(BINARY)
    g = start_guestd(d, "--config", os.path.join(d, "guestd.toml"), wrapper=NETNS)
    with g.client() as c:
        for mode, port in (
            ("http", HTTP),
            ("echo", ECHO),
            ("halfclose", HALF),
            ("reset", RESET),
            ("watchreset", WATCHRESET),
            ("flood", FLOOD),
            ("sink", SINK),
        ):
            c.process_start([sys.executable, SERVERS, mode, str(port), site if mode == "http" else d])
        for port in (HTTP, ECHO, HALF, RESET, WATCHRESET, FLOOD, SINK):
            assert c.port_wait(port, timeout_s=20).ready, g.log()
    yield g
    assert g.alive(), g.log()
    g.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def gc(guest: Guestd) -> Iterator[Client]:
    with guest.client() as c:
        yield c


@pytest.fixture(autouse=True)
def shared_client_socket_is_its_own(request: pytest.FixtureRequest) -> Iterator[None]:
    """Twice in CI the shared client's connection was lost with ENOTCONN, which a connected Unix
    socket does not give: its fd number had come to name another socket, so something in this
    process closed a descriptor it did not own. This names the test during which that happens."""
    if "gc" not in request.fixturenames:
        yield
        return
    client: Client = request.getfixturevalue("gc")
    transport = client._aio._conn.transport
    assert transport is not None
    fd = transport.get_extra_info("socket").fileno()
    before = os.fstat(fd)
    yield
    try:
        after = os.fstat(fd)
    except OSError as e:
        pytest.fail(f"the shared client's socket fd {fd} was closed during this test: {e}")
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        pytest.fail(f"the shared client's socket fd {fd} names another file after this test: closed by someone else")


def arun(guest: Guestd, body: Any) -> Any:
    """Run ``body(client)`` with a fresh AsyncClient of ``guest``."""

    async def main() -> Any:
        c = await AsyncClient.connect(guest.address)
        try:
            return await asyncio.wait_for(body(c), 60)
        finally:
            await c.close()

    return asyncio.run(main())


def guest_file(c: Client, path: str) -> bytes:
    """Wait (bounded, in the guest) for a file a server writes with a rename, then read it."""
    done = c.exec(["sh", "-c", f"i=0; while [ ! -e {path} ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done"])
    assert done.exit_code == 0
    return c.read_file(path)


# --------------------------------------------------------------------------- through a forward


def test_the_host_reaches_guest_ports_only_through_the_relay(gc: Client) -> None:
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", HTTP), timeout=2).close()  # the host's own loopback
    with gc.port_forward(HTTP) as fwd:
        base = f"http://127.0.0.1:{fwd.local_port}"
        with urllib.request.urlopen(f"{base}/index.html", timeout=10) as r:
            assert r.status == 200 and r.read() == PAGE
        with urllib.request.urlopen(f"{base}/blob.bin", timeout=10) as r:
            assert r.read() == BINARY
        upload = os.urandom(3 * 1024 * 1024 + 7)
        req = urllib.request.Request(f"{base}/echo", data=upload, method="POST")
        with urllib.request.urlopen(req, timeout=20) as r:
            assert r.read() == upload  # binary-safe both ways, several windows each way
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(f"{base}/missing", timeout=10)
        assert ei.value.code == 404


def test_a_websocket_echoes_text_and_binary_through_a_forward(gc: Client) -> None:
    with gc.port_forward(HTTP) as fwd, socket.create_connection(("127.0.0.1", fwd.local_port), timeout=10) as s:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(
            f"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        rfile = s.makefile("rb")
        assert rfile.readline().split()[1] == b"101"
        headers = {}
        while (line := rfile.readline().strip()) != b"":
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().decode()
        assert headers[b"sec-websocket-accept"] == ws_accept(key)
        messages = [(1, "héllo".encode()), (2, bytes(range(256))), (2, os.urandom(200_000)), (1, b"")]
        for opcode, data in messages:
            s.sendall(ws_frame(opcode, data, mask=os.urandom(4)))
            assert ws_read_frame(rfile) == (opcode, data)
        s.sendall(ws_frame(8, b"\x03\xe8", mask=os.urandom(4)))
        assert ws_read_frame(rfile) == (8, b"\x03\xe8")


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def test_a_headless_browser_renders_a_page_served_in_the_guest(gc: Client) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium (scripts/test.sh installs Debian's)")
    with gc.port_forward(HTTP) as fwd, tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--dump-dom",
                f"http://127.0.0.1:{fwd.local_port}/index.html",
            ],
            capture_output=True,
            timeout=60,
        )
    dom = done.stdout.decode()
    assert '<p id="static">served in the guest</p>' in dom, done.stderr.decode()[-2000:]
    assert '<p id="js">rendered by script 42</p>' in dom  # the script ran: the DOM, not the source


def test_closing_a_forward_ends_a_host_connection_whose_guest_side_is_still_connecting(
    guest: Guestd, gc: Client
) -> None:
    """The forward closed while a host connection's port.connect still waited in the guest: the
    host connection was left open and silent forever (its relay task was cancelled, the host
    end never closed). Now it ends with the forward."""
    p = gc.process_start([sys.executable, SERVERS, "full", str(FULL), guest.workdir])
    try:
        guest_file(gc, os.path.join(guest.workdir, "full"))
        with gc.port_forward(FULL, connect_timeout_s=60) as fwd:
            s = socket.create_connection(("127.0.0.1", fwd.local_port), timeout=10)
            for _ in range(1000):  # bounded: until the forward has accepted it
                if fwd.forward.connections:
                    break
                time.sleep(0.01)
            assert fwd.forward.connections == 1
        with s:
            s.settimeout(10)
            try:
                got = s.recv(1)
            except ConnectionResetError:
                got = b""
            assert got == b""  # reset or eof, not a connection that waits forever
    finally:
        gc.process_signal(p.id, "KILL")


# --------------------------------------------------------------------------- streams


def test_half_close_from_the_host_side_still_gets_the_guests_reply(guest: Guestd) -> None:
    async def body(c: AsyncClient) -> None:
        r, w = await c.open_port(ECHO)
        w.write(b"a" * 300_000)
        w.write_eof()
        assert await r.read() == b"a" * 300_000 + b"bye"  # then eof: the guest side ended too
        w.close()
        await w.wait_closed()

    arun(guest, body)


def test_half_close_from_the_guest_side_lets_the_host_keep_sending(guest: Guestd, gc: Client) -> None:
    async def body(c: AsyncClient) -> None:
        r, w = await c.open_port(HALF)
        assert await r.read() == b"go"  # eof from the guest
        for _ in range(8):
            w.write(b"z" * (1 << 20))
            await w.drain()
        w.write_eof()
        w.close()
        await w.wait_closed()

    gc.exec(["rm", "-f", os.path.join(guest.workdir, "count")])
    arun(guest, body)
    assert guest_file(gc, os.path.join(guest.workdir, "count")) == str(8 << 20).encode()


def test_a_reset_in_the_guest_reaches_the_reader_as_connection_reset(guest: Guestd) -> None:
    async def body(c: AsyncClient) -> None:
        r, w = await c.open_port(RESET)
        w.write(b"line\n")
        with pytest.raises(ConnectionResetError):
            await r.read()

    arun(guest, body)


def test_an_abort_on_the_host_side_resets_the_guest_socket(guest: Guestd, gc: Client) -> None:
    async def body(c: AsyncClient) -> None:
        _r, w = await c.open_port(WATCHRESET)
        w.write(b"some bytes")
        await w.drain()
        w.transport.abort()
        assert await c.ping() > 0

    gc.exec(["rm", "-f", os.path.join(guest.workdir, "how")])
    arun(guest, body)
    assert guest_file(gc, os.path.join(guest.workdir, "how")) == b"reset"


def test_connect_errors_are_typed(guest: Guestd, fresh_guestd: StartGuestd) -> None:
    with Client(guest.address) as c, pytest.raises(GuestdError) as ei:
        c.call("port.connect", {"port": 1})
    assert ei.value.code == "unavailable" and ei.value.details == {"stage": "connect", "reason": "refused"}
    assert ei.value.errno == 111

    async def refused(c: AsyncClient) -> None:
        with pytest.raises(GuestdError) as ei:
            await c.open_port(1)
        assert ei.value.details["reason"] == "refused"

    arun(guest, refused)

    # A listener whose backlog is full never answers the SYN: the connect times out.
    async def timed_out(c: AsyncClient) -> None:
        stream = c.exec_stream(
            [
                sys.executable,
                "-c",
                "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1',18090)); s.listen(0);"
                "a=socket.create_connection(('127.0.0.1',18090)); b=socket.socket(); b.setblocking(False);"
                "b.connect_ex(('127.0.0.1',18090)); print('full', end='', flush=True); sys.stdin.read()",
            ],
            stdin_stream=True,
        )
        assert await stream.__aiter__().__anext__() == ("stdout", b"full")
        t0 = time.monotonic()
        with pytest.raises(GuestdError) as ei:
            await c.open_port(18090, connect_timeout_s=0.5)
        assert ei.value.code == "timeout" and ei.value.details["limit"] == "connect_timeout_s"
        assert time.monotonic() - t0 < 5
        await stream.cancel()

    arun(guest, timed_out)

    # A guest whose loopback is down: unreachable.
    down = fresh_guestd(wrapper=["unshare", "-n"])
    with down.client() as c, pytest.raises(GuestdError) as ei:
        c.call("port.connect", {"port": 80})
    assert ei.value.code == "unavailable" and ei.value.details["reason"] == "unreachable"


def test_a_hundred_streams_at_once_on_one_connection(guest: Guestd) -> None:
    async def one(c: AsyncClient, i: int) -> bytes:
        r, w = await c.open_port(ECHO)
        payload = os.urandom(50_000 + i)
        w.write(payload)
        w.write_eof()
        got = await r.read()
        w.close()
        assert got == payload + b"bye"
        return got

    async def body(c: AsyncClient) -> None:
        results = await asyncio.gather(*(one(c, i) for i in range(100)))
        assert len(results) == 100
        assert await c.ping() > 0

    arun(guest, body)


def test_stream_limit_and_port_policy(fresh_guestd: StartGuestd, tmp_path: Any) -> None:
    path = limits_config(str(tmp_path), max_port_streams=2)
    with open(path, "a") as f:
        f.write(f'[ports]\nallow = ["1-1000", "{ECHO}"]\n')
    g = fresh_guestd("--config", path)
    with g.client() as c:
        assert c.aio.limits["max_port_streams"] == 2 and c.aio.limits["max_port_pending"] > 0
        with pytest.raises(GuestdError) as ei:
            c.call("port.connect", {"port": 5000})
        assert ei.value.code == "permission_denied" and ei.value.details["policy"] == "ports.allow"
        with pytest.raises(GuestdError) as ei:
            c.call("port.wait", {"port": 5000, "timeout_s": 0})
        assert ei.value.details["policy"] == "ports.allow"
        with pytest.raises(GuestdError) as ei:
            c.call("port.connect", {"port": 80, "address": "192.0.2.7"})  # not the guest's own
        assert ei.value.code == "permission_denied" and ei.value.details["policy"] == "guest_addresses"
        with pytest.raises(GuestdError) as ei:
            c.call("port.connect", {"port": 80, "address": "localhost"})  # no resolver in guestd
        assert ei.value.code == "bad_request"
        with pytest.raises(GuestdError) as ei:
            c.call("port.reverse", {"port": 0})  # off by default
        assert ei.value.code == "permission_denied" and ei.value.details["policy"] == "ports.reverse"

    srv = socket.socket()
    srv.bind(("127.0.0.1", ECHO))  # the shared guest is in its own namespace: this port is free here
    srv.listen()

    async def body(c: AsyncClient) -> None:
        a = await c.open_port(ECHO)
        b = await c.open_port(ECHO)
        with pytest.raises(GuestdError) as ei:
            await c.open_port(ECHO)
        assert ei.value.code == "limit" and ei.value.details["limit"] == "max_port_streams"
        a[1].transport.abort()
        for _ in range(100):  # the guest frees the slot when the cancel arrives
            try:
                c3 = await c.open_port(ECHO)
                break
            except GuestdError:
                await asyncio.sleep(0.02)
        else:
            raise AssertionError("the aborted stream's slot never came back")
        for _, w in (b, c3):
            w.transport.abort()

    try:
        arun(g, body)
    finally:
        srv.close()


def test_a_workload_that_floods_or_never_reads_costs_one_window(guest: Guestd) -> None:
    rss0 = guest.rss()

    async def body(c: AsyncClient) -> None:
        window = c.server_hello["stream_window"]
        # flood: nobody reads the reader; its buffer stops the grants.
        fr, fw = await c.open_port(FLOOD)
        # sink: the host writes 64 MiB that the workload never reads.
        _sr, sw = await c.open_port(SINK)
        sink_transport = sw.transport
        for _ in range(64):
            sw.write(b"s" * (1 << 20))
        for _ in range(300):  # bounded: until the credit has run out
            await c.ping()
            if sink_transport.get_write_buffer_size() >= (64 << 20) - window - (8 << 20):
                break
            await asyncio.sleep(0.02)
        unsent = sink_transport.get_write_buffer_size()
        assert unsent >= (64 << 20) - window - (8 << 20), unsent
        assert len(fr._buffer) <= window + (1 << 20)  # type: ignore[attr-defined]
        assert guest.rss() - rss0 < 3 * window + (16 << 20)
        t0 = time.monotonic()
        await c.ping()
        assert time.monotonic() - t0 < 1.0
        fw.transport.abort()
        sw.transport.abort()

    arun(guest, body)


# --------------------------------------------------------------------------- discovery, wait


def test_port_wait_before_and_after_the_server_starts(guest: Guestd, gc: Client) -> None:
    before = gc.port_wait(18099, timeout_s=0.2)
    assert not before.ready and before.elapsed_s >= 0.15 and before.http_status is None

    async def body(c: AsyncClient) -> None:
        waiting = asyncio.ensure_future(c.port_wait(18099, timeout_s=20, http=True, path="/index.html"))
        await asyncio.sleep(0)
        assert not waiting.done()
        site = os.path.join(guest.workdir, "site")
        proc = await c.process_start([sys.executable, SERVERS, "http", "18099", site])
        got = await waiting
        assert got.ready and got.http_status == 200 and got.elapsed_s > 0
        again = await c.port_wait(18099, timeout_s=1, http=True, path="/missing")
        assert not again.ready and again.http_status == 404
        await c.process_signal(proc.id, "KILL")

    arun(guest, body)


def test_port_list_and_the_watch_see_a_listener_come_and_go(guest: Guestd, gc: Client) -> None:
    listed = {listener.port: listener for listener in gc.port_list()}
    assert {HTTP, ECHO, SINK} <= set(listed)
    assert listed[HTTP].address == "127.0.0.1" and listed[HTTP].family == "ipv4"
    assert "port_servers.py http" in (listed[HTTP].command or "")

    async def body(c: AsyncClient) -> None:
        changes = c.watch_ports(interval_s=0.05, poll_s=10)

        async def until(kind: str, port: int) -> Any:
            # Listeners of earlier tests in this guest may still come and go: skip them (bounded).
            for _ in range(100):
                seen, listener = await asyncio.wait_for(changes.__anext__(), 30)
                if (seen, listener.port) == (kind, port):
                    return listener
            raise AssertionError(f"no {kind} event for port {port}")

        await until("added", HTTP)  # the initial set comes as added events
        started = await c.process_start([sys.executable, SERVERS, "echo", "18098", guest.workdir])
        listener = await until("added", 18098)
        assert listener.pid == started.pid
        await c.process_signal(started.id, "KILL")
        await until("removed", 18098)
        await changes.aclose()

    arun(guest, body)


# --------------------------------------------------------------------------- reverse forwards


class HostService:
    """A loopback service on this host: answers each line with ``host:<line>`` and counts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port: int = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        with conn:
            try:
                line = conn.makefile("rb").readline()
                conn.sendall(b"host:" + line)
            except OSError:
                pass  # the other end went away first

    def close(self) -> None:
        self.sock.close()


GUEST_CALL = (
    "import socket,sys; s=socket.create_connection(('127.0.0.1',int(sys.argv[1])),timeout=10);"
    "s.sendall(b'from the guest\\n'); sys.stdout.buffer.write(s.makefile('rb').read())"
)


def test_a_reverse_forward_lets_the_guest_reach_the_named_host_service(gc: Client) -> None:
    service = HostService()
    try:
        with gc.reverse_forward(0, ("127.0.0.1", service.port)) as fwd:
            assert fwd.guest_port > 0
            for _ in range(3):
                done = gc.exec([sys.executable, "-c", GUEST_CALL, str(fwd.guest_port)], timeout_s=20)
                assert done.stdout == b"host:from the guest\n", done
            assert service.connections == 3
            port = fwd.guest_port
        # Closed: nothing listens on the guest port any more.
        done = gc.exec([sys.executable, "-c", GUEST_CALL, str(port)], timeout_s=20)
        assert done.exit_code != 0 and b"ConnectionRefusedError" in done.stderr
    finally:
        service.close()


def test_a_reverse_forward_whose_destination_is_down_resets_the_guest_connection(gc: Client) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()[1]
    s.close()
    with gc.reverse_forward(0, ("127.0.0.1", dead)) as fwd:
        done = gc.exec([sys.executable, "-c", GUEST_CALL, str(fwd.guest_port)], timeout_s=20)
        assert done.stdout == b"" and fwd.forward.refused == 1
        assert gc.ping() > 0


def test_a_guest_cannot_choose_where_a_reverse_forward_connects(evil: Any) -> None:
    """A compromised guest announces connections with destinations of its own choosing and
    claims forwards the host never set up: the client connects only where the host said."""
    allowed, other = HostService(), HostService()
    seen: list[dict[str, Any]] = []
    claimed = threading.Event()

    def script(peer: RawPeer) -> None:
        kind, rid, req = peer.recv()
        assert req["op"] == "port.reverse"
        peer.send(Kind.EVENT, rid, {"ev": "listening", "forward": "r1", "port": 5555})
        for n in (1, 2):
            peer.send(
                Kind.EVENT,
                rid,
                {"ev": "accepted", "conn": n, "host": "127.0.0.1", "port": other.port, "destination": "127.0.0.1"},
            )
        while len(seen) < 2:
            kind, rid2, body = peer.recv()
            if kind == Kind.REQUEST:
                seen.append(body)
                peer.send(Kind.EVENT, rid2, {"ev": "connected"})
                peer.send(Kind.EVENT, rid2, {"ev": "data", "data": b"x\n"})
                peer.send(Kind.EVENT, rid2, {"ev": "eof"})
        claimed.set()
        while True:
            kind, rid2, body = peer.recv()
            if kind == Kind.INPUT and body.get("eof") and rid2 == rid:
                peer.send(Kind.RESPONSE, rid, {"accepted": 2})
            elif kind == Kind.INPUT and body.get("eof"):
                peer.send(Kind.RESPONSE, rid2, {"sent": 7, "received": 2})

    try:
        with Client(evil(script)) as c:
            with c.reverse_forward(5555, ("127.0.0.1", allowed.port)):
                assert claimed.wait(10)
            assert [(b["op"], b["args"]) for b in seen] == [
                ("port.accept", {"forward": "r1", "conn": 1}),
                ("port.accept", {"forward": "r1", "conn": 2}),
            ]
        for _ in range(200):  # the service's accept thread counts them when it gets to run
            if allowed.connections >= 2:
                break
            time.sleep(0.05)
        assert allowed.connections == 2
        assert other.connections == 0
    finally:
        allowed.close()
        other.close()


def test_a_reverse_forward_event_on_another_request_is_a_protocol_violation(evil: Any) -> None:
    def script(peer: RawPeer) -> None:
        _kind, rid, _req = peer.recv()
        peer.send(Kind.EVENT, rid, {"ev": "accepted", "conn": 1})  # port.list has no events

    with Client(evil(script)) as c, pytest.raises(GuestProtocolError):
        c.port_list()


def test_one_connection_cannot_claim_another_connections_reverse_connection(guest: Guestd, gc: Client) -> None:
    service = HostService()
    try:
        with gc.reverse_forward(0, ("127.0.0.1", service.port)) as fwd, Client(guest.address) as intruder:
            with pytest.raises(GuestdError) as ei:
                intruder.call("port.accept", {"forward": fwd.forward.forward_id, "conn": 1})
            assert ei.value.code == "not_found"
    finally:
        service.close()


# --------------------------------------------------------------------------- guestctl


def guestctl_running(g: Guestd, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """A long-running guestctl and the first line it printed."""
    p = subprocess.Popen(
        g.guestctl_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": REPO}
    )
    assert p.stdout is not None
    return p, p.stdout.readline().decode()


def test_guestctl_ports_port_wait_and_both_forwards(guest: Guestd, gc: Client) -> None:
    listed = json.loads(guest.guestctl("--json", "ports").stdout)["listeners"]
    assert any(x["port"] == HTTP and "port_servers.py" in x["command"] for x in listed)
    assert f"127.0.0.1:{HTTP}" in guest.guestctl("ports").stdout.decode()

    assert guest.guestctl("port-wait", str(HTTP), "--http", "--timeout", "5").returncode == 0
    slow = guest.guestctl("--json", "port-wait", "18097", "--timeout", "0.3")
    assert slow.returncode == 124 and json.loads(slow.stdout)["ready"] is False

    p, first = guestctl_running(guest, "port-forward", f"0:{HTTP}")
    try:
        assert first.startswith("Forwarding from 127.0.0.1:"), first + (p.stderr.read().decode() if p.stderr else "")
        local = int(first.split()[2].rsplit(":", 1)[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{local}/index.html", timeout=10) as r:
            assert r.read() == PAGE
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(10) == 0

    service = HostService()
    p, first = guestctl_running(guest, "port-forward", "--reverse", f"0:127.0.0.1:{service.port}")
    try:
        assert first.startswith("Forwarding guest 127.0.0.1:"), first
        guest_port = first.split()[2].rsplit(":", 1)[1]
        done = gc.exec([sys.executable, "-c", GUEST_CALL, guest_port], timeout_s=20)
        assert done.stdout == b"host:from the guest\n"
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(10) == 0
        service.close()
