"""A request's streams die with it (issue 35, defect 3): a streaming request whose client stops
granting credit and is then cancelled (or whose connection is lost) leaves nothing waiting for
that credit: the session, context or process it streamed from takes its next command within the
command's own timeout."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from guestd.client import AsyncClient, Client
from guestd.testing import Guestd
from guestd.testing.local import live_procs_with
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind

MIN_WINDOW = 64 * 1024  # the smallest window guestd grants (MIN_STREAM_WINDOW)


@pytest.fixture
def peer(guestd: Guestd) -> Iterator[RawPeer]:
    sock = guestd.raw_socket()
    p = RawPeer(sock)
    p.hello(stream_window=MIN_WINDOW)
    yield p
    sock.close()


def spend_window(peer: RawPeer, req_id: int) -> None:
    """Read the stream's events until its credit is gone (no WINDOW is ever sent)."""
    got = 0
    while got < MIN_WINDOW:
        kind, rid, body = peer.recv()
        assert rid == req_id and kind == Kind.EVENT, (kind, body)
        got += len(body.get("data", b""))


def stall(peer: RawPeer, req_id: int, marker: str) -> None:
    """Read the stream's events until its credit is gone (no WINDOW is ever sent), then wait
    until the command's timeout has ended it: guestd now holds the rest of its output."""
    spend_window(peer, req_id)
    deadline = time.monotonic() + 30
    while live_procs_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live_procs_with(marker), "the command outlived its timeout"


def cancel_and_expect_cancelled(peer: RawPeer, req_id: int) -> None:
    peer.send(Kind.CANCEL, req_id, {})
    kind, body = peer.recv_final(req_id)
    assert kind == Kind.ERROR and body["code"] == "cancelled", body


@pytest.mark.parametrize("pty", [False, True], ids=["pipes", "pty"])
def test_a_cancelled_stalled_shell_stream_leaves_the_session_usable(guestd: Guestd, peer: RawPeer, pty: bool) -> None:
    with Client(guestd.address) as c:
        sid = c.shell_create().id
        marker = f"stalled-shell-{pty}"
        peer.request(
            1, "shell.run", {"id": sid, "command": f"yes {marker}", "stream": True, "timeout_s": 1, "pty": pty}
        )
        stall(peer, 1, marker)
        cancel_and_expect_cancelled(peer, 1)
        t0 = time.monotonic()
        r = c.shell_run(sid, "echo next", timeout_s=20, deadline=30)
        assert (r.exit_code, r.stdout, r.timed_out) == (0, b"next\n", None), r
        assert time.monotonic() - t0 < 15  # within the stalled command's timeout and grace, not never


def test_a_stalled_shell_stream_whose_connection_is_lost_leaves_the_session_usable(guestd: Guestd) -> None:
    with Client(guestd.address) as c:
        sid = c.shell_create().id
        sock = guestd.raw_socket()
        p = RawPeer(sock)
        p.hello(stream_window=MIN_WINDOW)
        p.request(1, "shell.run", {"id": sid, "command": "yes stalled-lost", "stream": True, "timeout_s": 1})
        stall(p, 1, "stalled-lost")
        sock.close()
        r = c.shell_run(sid, "echo next", timeout_s=20, deadline=30)
        assert (r.exit_code, r.stdout) == (0, b"next\n"), r


def guestd_fds(guestd: Guestd) -> int:
    return len(os.listdir(f"/proc/{guestd.pid}/fd"))


def fd_targets(guestd: Guestd) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{guestd.pid}/fd"):
        with contextlib.suppress(OSError):
            out.append(f"{fd}:{os.readlink(f'/proc/{guestd.pid}/fd/{fd}')}")
    return out


def settles_to(guestd: Guestd, fds: int) -> bool:
    deadline = time.monotonic() + 20
    while guestd_fds(guestd) > fds and time.monotonic() < deadline:
        time.sleep(0.05)
    return guestd_fds(guestd) <= fds


def test_a_cancelled_stalled_exec_stream_ends_and_closes_its_pipes(guestd: Guestd, peer: RawPeer) -> None:
    peer.request(9, "exec", {"argv": ["true"]})  # what guestd opens once for every exec is open
    assert peer.recv_final(9)[0] == Kind.RESPONSE
    before = guestd_fds(guestd)
    peer.request(1, "exec", {"argv": ["yes", "stalled-exec"], "stream": True, "timeout_s": 1})
    stall(peer, 1, "stalled-exec")
    cancel_and_expect_cancelled(peer, 1)
    assert settles_to(guestd, before), fd_targets(guestd)
    peer.request(2, "exec", {"argv": ["echo", "next"]})
    kind, body = peer.recv_final(2)
    assert kind == Kind.RESPONSE and body["stdout"] == b"next\n", body


def test_a_cancelled_stalled_code_stream_leaves_the_context_usable(guestd: Guestd, peer: RawPeer) -> None:
    with Client(guestd.address) as c:
        ctx = c.code_create(deadline=120).id
        cell = "while True: print('x' * 4000)"
        peer.request(1, "code.run", {"context": ctx, "code": cell, "stream": True, "timeout_s": 60})
        got = 0
        while got < MIN_WINDOW // 2:  # the cell's prints, until the window is about spent
            kind, rid, body = peer.recv()
            assert rid == 1 and kind == Kind.EVENT, (kind, body)
            got += len(body.get("data", b"") or body.get("text", b"") or b"")
        cancel_and_expect_cancelled(peer, 1)
        r = c.code_run("1 + 1", context=ctx, timeout_s=20, deadline=60)
        assert (r.status, r.text) == ("ok", "2"), r


def test_a_cancelled_stalled_attach_leaves_the_process_and_its_readers(guestd: Guestd, peer: RawPeer) -> None:
    with Client(guestd.address) as c:
        before = guestd_fds(guestd)
        p = c.process_start(["yes", "attached-flood"])
        try:
            peer.request(1, "process.attach", {"id": p.id})
            spend_window(peer, 1)
            cancel_and_expect_cancelled(peer, 1)
            collected = c.process_output(p.id, follow=False)
            out, _err, _final = collected.stdout, collected.stderr, collected.status
            assert out.endswith(b"attached-flood\n") or b"attached-flood" in out
        finally:
            c.process_signal(p.id, "KILL")
            c.process_wait(p.id, timeout_s=20)
            c.process_forget(p.id)
        assert settles_to(guestd, before), fd_targets(guestd)


def test_a_cancelled_stalled_port_relay_closes_its_connection(guestd: Guestd, peer: RawPeer) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    flooding: list[socket.socket] = []

    def flood() -> None:
        conn, _ = server.accept()
        flooding.append(conn)
        with contextlib.suppress(OSError):
            while True:
                conn.sendall(b"f" * 65536)

    before = guestd_fds(guestd)
    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    peer.request(1, "port.connect", {"port": port})
    spend_window(peer, 1)
    cancel_and_expect_cancelled(peer, 1)
    thread.join(20)  # the flood ends once guestd closed its side
    assert not thread.is_alive(), "guestd kept the relay's connection open"
    assert settles_to(guestd, before), fd_targets(guestd)
    for s in [server, *flooding]:
        s.close()


def test_stdin_for_a_command_that_ended_is_not_reported_as_written(guestd: Guestd) -> None:
    """(issue 35, defect 4) Before: write_stdin returned as if all was written."""

    async def go() -> None:
        c = await AsyncClient.connect(guestd.address)
        try:
            s = c.exec_stream(["head", "-c", "10"], stdin_stream=True)
            with pytest.raises(BrokenPipeError, match="not delivered"):
                await s.write_stdin(b"x" * 20_000_000)  # head takes 10 bytes and exits
            r = await s.result()
            assert r.exit_code == 0  # (its output came as events)
            with pytest.raises(BrokenPipeError, match="5 of 5 bytes"):
                await s.write_stdin(b"later")  # the run is over
        finally:
            await c.close()

    asyncio.run(go())
