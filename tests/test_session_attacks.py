"""Attacks on the session core and its asyncio adapters (guestd/wire/session.py,
guestd/server/connection.py, guestd/client/connection.py), as a hostile or broken peer.

Each test states a PROTOCOL.md claim and attacks it. They came from a red-team pass over
the new core: 18 of them failed before the fixes that followed (hello pipelining, id reuse
after an abort, unread replies and refused peers, client waits and versions).

Safety: every guestd that may see a hello with a ``time_ns`` far from now is started with
``--simulate-privileged`` (this machine's clock is never touched); all traffic is on
Unix sockets.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from guestd.client import Client, GuestdError, GuestProtocolError
from guestd.testing import Guestd, StartGuestd, limits_config
from guestd.testing.rawwire import FAKE_GUEST_HELLO, FrameCounter, RawPeer
from guestd.wire.frames import HEADER, MAGIC, Kind, encode_frame

SMALL = 64 * 1024


def hello_frame(**extra: Any) -> bytes:
    return encode_frame(Kind.HELLO, 0, {"versions": [1], "client": "redteam", **extra})


def req(req_id: int, op: str, args: dict[str, Any] | None = None) -> bytes:
    return encode_frame(Kind.REQUEST, req_id, {"op": op, "args": args or {}})


def frames_for(p: RawPeer, req_id: int, timeout: float) -> list[tuple[int, dict[str, Any]]]:
    """Every frame of ``req_id`` that arrives within ``timeout`` s."""
    out = []
    p.sock.settimeout(timeout)
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            kind, rid, body = p.recv()
            if rid == req_id:
                out.append((kind, body))
    except (TimeoutError, EOFError):
        pass
    return out


# =================================================================== handshake pipelining


def test_hello_and_first_request_in_one_write_serve_the_request(guestd: Guestd) -> None:
    """PROTOCOL.md 3: only "a request *before* hello gets protocol_error". A client that
    pipelines its first request behind its hello (one write) sends it after the hello."""
    p = RawPeer(guestd.raw_socket())
    p.send_bytes(hello_frame() + req(1, "ping"))
    kind, rid, body = p.recv()
    assert kind == Kind.HELLO, f"first frame is {Kind(kind).name} id {rid}: {body}"
    kind, body = p.recv_final(1)
    assert kind == Kind.RESPONSE, f"a request sent after the hello was refused: {body}"


def test_two_hellos_in_one_write_the_second_is_refused(guestd: Guestd) -> None:
    """PROTOCOL.md 3: "A second hello on a socket is answered with protocol_error (id 0)
    and ignored." Sent in one write, both hellos are accepted: two HELLO replies, and
    the second one's max_frame replaces the first's."""
    p = RawPeer(guestd.raw_socket())
    p.send_bytes(hello_frame(max_frame=SMALL, stream_window=SMALL) + hello_frame())
    kind, _, first = p.recv()
    assert kind == Kind.HELLO and first["max_frame"] == SMALL
    kind, rid, second = p.recv()
    assert (Kind(kind).name, rid, second.get("code")) == ("ERROR", 0, "protocol_error"), (
        f"second hello answered with {Kind(kind).name}: max_frame now {second.get('max_frame')}"
    )


def test_two_hellos_in_one_write_do_not_raise_the_negotiated_max_frame(guestd: Guestd, tmp_path: Any) -> None:
    """Consequence of the above: after the client negotiated 64 KiB, guestd sends 1 MiB frames."""
    path = f"{tmp_path}/blob"
    with open(path, "wb") as f:
        f.write(os.urandom(2 * 1024 * 1024))
    p = RawPeer(guestd.raw_socket())
    big = 4 * 1024 * 1024
    p.send_bytes(hello_frame(max_frame=SMALL, stream_window=SMALL) + hello_frame(max_frame=big, stream_window=big))
    assert p.recv()[0] == Kind.HELLO  # the hello the client believes in: 64 KiB
    c = FrameCounter(p, SMALL, SMALL)
    p.request(1, "file.download", {"path": path})
    c.until_final(1)
    assert c.largest <= SMALL, f"guestd sent a {c.largest}-byte frame to a client that negotiated {SMALL}"


def test_a_refused_hello_ends_the_connection_before_a_second_hello_takes_effect(
    fresh_guestd: StartGuestd, tmp_path: Any
) -> None:
    """PROTOCOL.md 3: a wrong token is permission_denied *and close*; nothing of a refused
    connection reaches the clock logic. A second hello in the same read as the refused
    one still runs accept_hello and check_host_time on the refused connection."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    g = fresh_guestd("--token-file", str(token), "--simulate-privileged")  # never touch this host's clock
    p = RawPeer(g.raw_socket())
    far = time.time_ns() + 3600 * 10**9
    p.send_bytes(hello_frame(token="wrong") + hello_frame(token="s3cret", time_ns=far))
    kind, rid, body = p.recv()
    assert (kind, rid, body["code"]) == (Kind.ERROR, 0, "permission_denied")
    assert p.closed()
    with g.client(token="s3cret") as c:
        snap = c.call("info", {}, deadline=10)["snapshot"]
    assert snap["suspected_restore"] is False, "a hello on a refused connection reached the clock logic"


# =================================================================== ids and final frames


def test_an_id_reused_after_an_aborted_request_gets_its_own_final_frame(guestd: Guestd, tmp_path: Any) -> None:
    """PROTOCOL.md 4: reuse of an id after its final frame is fine. After the core aborts
    a request (bad input: final ERROR sent at once), the id is free; a new request on it
    must end with its own final frame. The aborted request's handler task, cancelled
    but not yet finished, answers "cancelled" (reason "aborted") on the new request's id."""
    p = RawPeer(guestd.raw_socket())
    p.hello()
    p.send_bytes(
        req(5, "file.upload", {"path": f"{tmp_path}/up"})
        + encode_frame(Kind.INPUT, 5, {"data": "not bin"})  # malformed: the core ends request 5
        + req(5, "exec", {"argv": ["sh", "-c", "sleep 0.2; echo fine"]})
    )
    kind, first = p.recv_final(5)
    assert (kind, first["code"]) == (Kind.ERROR, "bad_request")
    kind, second = p.recv_final(5)
    assert kind == Kind.RESPONSE and second.get("stdout") == b"fine\n", f"the exec on the reused id got {second}"


def test_an_id_reused_after_an_abort_of_a_running_handler(guestd: Guestd, tmp_path: Any) -> None:
    """The same when the aborted handler is already running (not only cancelled before it
    ran): the reused id's request is answered by the old task's cancellation."""
    p = RawPeer(guestd.raw_socket())
    p.hello()
    p.request(7, "exec", {"argv": ["sleep", "5"], "stdin_stream": True})
    time.sleep(0.3)  # the handler runs and waits for the process
    p.send_bytes(
        encode_frame(Kind.INPUT, 7, {"eof": "yes"})  # malformed: the core ends request 7
        + req(7, "exec", {"argv": ["sh", "-c", "sleep 0.2; echo fine"]})
    )
    kind, first = p.recv_final(7)
    assert (kind, first["code"]) == (Kind.ERROR, "bad_request")
    kind, second = p.recv_final(7)
    assert kind == Kind.RESPONSE and second.get("stdout") == b"fine\n", f"the exec on the reused id got {second}"


# =================================================================== peers that never read


def stuff_unread(g: Guestd, *, hello: bool = False, seconds: float = 5.0) -> socket.socket:
    """A peer that sends pings (before or after a hello) until guestd stops reading it,
    and never reads a byte of the replies: guestd's write buffer for it stays full."""
    s = g.raw_socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    if hello:
        s.sendall(hello_frame())
    batch = b"".join(req(i, "ping") for i in range(1, 4001))
    s.settimeout(0.3)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            s.sendall(batch)
        except TimeoutError:
            break  # guestd paused reading: its buffer for us is above the high-water mark
    return s


def test_hello_less_peers_that_never_read_cannot_lock_the_host_out(fresh_guestd: StartGuestd, tmp_path: Any) -> None:
    """PROTOCOL.md 3: "Peers that never say hello cannot lock the host out." A hello-less
    peer that sends requests (each answered with protocol_error) and never reads leaves
    unsent bytes in guestd's transport. The hello deadline then refuses and close()s it,
    but transport.close() waits for the buffer to drain, which never happens: the
    connection keeps its slot forever (connection_lost is never called), and as it is no
    longer "awaiting hello" (phase CLOSED) it is never evicted either."""
    cfg = limits_config(str(tmp_path), hello_timeout_s=1.0, max_connections=3)
    g = fresh_guestd("--config", cfg)
    held = [stuff_unread(g, seconds=3) for _ in range(3)]
    time.sleep(2.5)  # well past the hello deadline of every one of them
    try:
        with g.client(connect_timeout=5) as c:
            assert c.ping(deadline=5) > 0
    except GuestdError as err:
        pytest.fail(f"the host is locked out by 3 hello-less peers past their deadline: {err}")
    finally:
        for s in held:
            s.close()


def test_evicted_peers_that_never_read_do_not_pile_up_in_guestd(fresh_guestd: StartGuestd, tmp_path: Any) -> None:
    """PROTOCOL.md 5: a peer that never reads holds at most ~2 MiB of unsent output per
    *connection*, and connections are bounded by max_connections. An evicted hello-less
    peer is dropped from the daemon's table at once, but its transport (and the unsent
    bytes in it, plus its fd) stay until the peer reads: one peer can open connection
    after connection and grow guestd by ~2-4 MiB each, without bound."""
    cfg = limits_config(str(tmp_path), hello_timeout_s=60.0, max_connections=2)
    g = fresh_guestd("--config", cfg)
    socks = [stuff_unread(g, seconds=2)]
    before = g.rss()
    fds_before = len(os.listdir(f"/proc/{g.pid}/fd"))
    for _ in range(16):
        socks.append(stuff_unread(g, seconds=2))  # each new one evicts the oldest hello-less one
    time.sleep(0.5)
    grown = g.rss() - before
    fds = len(os.listdir(f"/proc/{g.pid}/fd")) - fds_before
    try:
        assert fds <= 4 and grown < 16 * 1024 * 1024, (
            f"after 16 evictions (max_connections=2) guestd holds {fds} more fds and grew by {grown >> 20} MiB"
        )
    finally:
        for s in socks:
            s.close()


def test_unread_large_replies_do_not_grow_guestd_without_bound(fresh_guestd: StartGuestd, tmp_path: Any) -> None:
    """PROTOCOL.md 5: reading pauses at 2 MiB of unsent output, "so a peer that sends
    requests and never reads the replies holds at most 2 MiB of unsent output plus the
    replies of the requests already in flight". But every request decoded from the reads
    before the pause runs to completion and its reply is written into the transport
    anyway: 150 file.read requests of 2 MiB (one 6 KiB write) pin ~300 MiB in guestd.
    The literal bound is max_inflight x max_frame = 4096 x 4 MiB = 16 GiB per
    connection, times max_connections: no bound for a microVM."""
    path = f"{tmp_path}/two_mib"
    with open(path, "wb") as f:
        f.write(os.urandom(2 * 1024 * 1024))
    g = fresh_guestd()
    s = g.raw_socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    p = RawPeer(s)
    p.hello()
    before = g.rss()
    s.sendall(b"".join(req(i, "file.read", {"path": path}) for i in range(1, 151)))
    time.sleep(3)
    grown = g.rss() - before
    s.close()
    assert grown < 64 * 1024 * 1024, f"guestd grew by {grown >> 20} MiB for one peer that never reads"


def test_ping_on_another_connection_is_not_delayed_by_a_peer_that_never_reads(
    fresh_guestd: StartGuestd, tmp_path: Any
) -> None:
    """PROTOCOL.md 4: a long request "never delays a ping on the same or another
    connection". One peer's 300 unread file.read replies of 2 MiB are encoded and
    queued on the event loop anyway; a ping on another connection waits for that."""
    path = f"{tmp_path}/two_mib"
    with open(path, "wb") as f:
        f.write(os.urandom(2 * 1024 * 1024))
    g = fresh_guestd()
    with g.client() as c:
        s = g.raw_socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        RawPeer(s).hello()
        s.sendall(b"".join(req(i, "file.read", {"path": path}) for i in range(1, 301)))
        worst = 0.0
        for _ in range(20):
            t0 = time.monotonic()
            c.ping(deadline=30)
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.1)
        s.close()
    assert worst < 0.5, f"a ping on another connection took {worst:.2f} s"


# =================================================================== frame sizes and strict credit


def small_counter(g: Guestd) -> tuple[RawPeer, FrameCounter]:
    p = RawPeer(g.raw_socket())
    hello = p.hello(max_frame=SMALL, stream_window=SMALL)
    assert hello["max_frame"] == SMALL and hello["stream_window"] == SMALL
    return p, FrameCounter(p, SMALL, SMALL)


@pytest.mark.parametrize("chunk", [None, 1000, 65535, 65536, 65537, 1024 * 1024])
def test_download_chunks_fit_max_frame_and_credit(guestd: Guestd, tmp_path: Any, chunk: int | None) -> None:
    path = f"{tmp_path}/blob"
    size = 300_000
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    p, c = small_counter(guestd)
    args: dict[str, Any] = {"path": path}
    if chunk is not None:
        args["chunk"] = chunk
    p.request(1, "file.download", args)
    kind, body, got = c.until_final(1)
    assert kind == Kind.RESPONSE and got == body["bytes"] == size, body
    assert not c.violations, c.violations


def test_concurrent_streams_fit_max_frame_and_strict_credit(guestd: Guestd, tmp_path: Any) -> None:
    """exec stream (stdout and stderr), download, attach with a chunk, all at once on one
    64 KiB connection; every data byte is counted against the credit granted."""
    path = f"{tmp_path}/blob"
    with open(path, "wb") as f:
        f.write(os.urandom(1_500_000))
    p, c = small_counter(guestd)
    p.request(9, "process.start", {"shell": "head -c 900000 /dev/zero; head -c 700000 /dev/zero >&2"})
    kind, started = p.recv_final(9)
    assert kind == Kind.RESPONSE
    p.request(1, "exec", {"shell": "head -c 1000000 /dev/urandom; head -c 1000000 /dev/urandom >&2", "stream": True})
    p.request(2, "file.download", {"path": path, "chunk": 70000})
    p.request(3, "process.attach", {"id": started["id"], "chunk": 100000})
    p.request(4, "exec", {"shell": "head -c 500000 /dev/zero >&2; head -c 500000 /dev/zero", "stream": True})
    finals: dict[int, tuple[int, dict[str, Any]]] = {}
    got = {1: 0, 2: 0, 3: 0, 4: 0}
    while len(finals) < 4:
        kind, rid, body = c.frame()
        if kind == Kind.EVENT and isinstance(body.get("data"), bytes):
            got[rid] += len(body["data"])
        if kind in (Kind.RESPONSE, Kind.ERROR):
            finals[rid] = (kind, body)
    assert all(k == Kind.RESPONSE for k, _ in finals.values()), finals
    assert got == {1: 2_000_000, 2: 1_500_000, 3: 1_600_000, 4: 1_000_000}
    assert not c.violations and c.largest <= SMALL, c.violations


def test_credit_granted_a_few_bytes_at_a_time_is_never_exceeded(guestd: Guestd) -> None:
    """After the initial window, grant odd small amounts: frames shrink to the credit."""
    p, c = small_counter(guestd)
    c.grant = False
    p.request(1, "exec", {"argv": ["head", "-c", "200000", "/dev/zero"], "stream": True})
    total = 0
    granted = SMALL
    while True:
        kind, _rid, body = c.frame()
        if kind in (Kind.RESPONSE, Kind.ERROR):
            break
        data = body.get("data")
        if isinstance(data, bytes) and data:
            total += len(data)
            if total >= granted:  # all credit used: grant 7, 1000 or 65535 bytes more
                more = (7, 1000, 65535)[total % 3]
                granted += more
                c.credit[1] += more
                p.send(Kind.WINDOW, 1, {"bytes": more})
    assert kind == Kind.RESPONSE and total == 200_000
    assert not c.violations, c.violations[:3]


def test_window_abuse_changes_nothing_but_credit(guestd: Guestd) -> None:
    """WINDOW frames of every wrong shape for ids not in flight (unknown and reserved) are
    ignored; a huge grant (credit far beyond u32, twice) for a request in flight is only
    credit: frames still fit max_frame, guestd keeps serving, and nothing reaches its log as
    an exception. A malformed WINDOW for a request in flight ends it with bad_request naming
    `bytes` (PROTOCOL.md 5, issue 32: it was ignored)."""
    p, c = small_counter(guestd)
    p.request(1, "exec", {"argv": ["head", "-c", "600000", "/dev/zero"], "stream": True})
    junk: list[Any] = ["100", -5, 1.5, None, True, b"\x01", [1], {"bytes": 1}, 0]
    out = b""
    for rid in (0, 2, 0xFFFFFFFF):
        for v in junk:
            out += encode_frame(Kind.WINDOW, rid, {"bytes": v})
        out += encode_frame(Kind.WINDOW, rid, {})
        out += HEADER.pack(MAGIC, 1, Kind.WINDOW, 3, rid) + b"\xc1\xc1\xc1"  # not msgpack
    out += encode_frame(Kind.WINDOW, 1, {"bytes": 0})  # no credit, no error
    out += encode_frame(Kind.WINDOW, 1, {"bytes": 2**64 - 1}) * 2
    p.send_bytes(out)
    kind, body, got = c.until_final(1)
    assert kind == Kind.RESPONSE and got == 600_000, body
    assert c.largest <= SMALL
    for rid, v in enumerate(junk[:-2], start=3):  # every malformed shape, each on a request in flight
        p.request(rid, "exec", {"argv": ["head", "-c", "600000", "/dev/zero"], "stream": True})
        p.send_bytes(encode_frame(Kind.WINDOW, rid, {"bytes": v}))
        kind, body, _ = c.until_final(rid)
        assert kind == Kind.ERROR and body["code"] == "bad_request", (v, body)
        assert body["details"]["field"] == "bytes", (v, body)
    p.request(2, "ping")
    assert c.until_final(2)[0] == Kind.RESPONSE
    assert "Traceback" not in guestd.log()


def test_oversize_request_with_id_zero_is_a_protocol_error(fresh_guestd: StartGuestd) -> None:
    """PROTOCOL.md 4: a request with id 0 is protocol_error on id 0 and the connection
    closes. An *oversize* request with id 0 is silently discarded instead
    (ServerSession._on_oversize skips id 0), and the connection stays."""
    g = fresh_guestd("--max-frame", str(SMALL))
    p = RawPeer(g.raw_socket())
    p.hello()
    p.send_bytes(req(0, "file.write", {"path": "/tmp/x", "data": b"x" * (SMALL + 10)}))
    p.sock.settimeout(1.5)
    try:
        kind, rid, body = p.recv()
    except TimeoutError:
        pytest.fail("an oversize request with id 0 got no answer and the connection stays open")
    assert (kind, rid, body["code"]) == (Kind.ERROR, 0, "protocol_error")


def test_oversize_request_before_hello_gets_protocol_error(fresh_guestd: StartGuestd) -> None:
    """PROTOCOL.md 3: "A request before hello gets protocol_error for its id". When that
    request is oversize, it gets nothing at all (ServerSession._on_oversize only answers
    in phase OPEN)."""
    g = fresh_guestd("--max-frame", str(SMALL))
    p = RawPeer(g.raw_socket())
    p.send_bytes(req(3, "file.write", {"path": "/tmp/x", "data": b"x" * (SMALL + 10)}))
    p.sock.settimeout(1.5)
    try:
        kind, rid, body = p.recv()
    except TimeoutError:
        pytest.fail("an oversize request before hello got no answer")
    assert (kind, rid, body["code"]) == (Kind.ERROR, 3, "protocol_error")


def test_oversize_hello_is_too_large_and_closes(fresh_guestd: StartGuestd) -> None:
    g = fresh_guestd("--max-frame", str(SMALL))
    p = RawPeer(g.raw_socket())
    p.send_bytes(hello_frame(client="x" * (SMALL + 1)))
    kind, rid, body = p.recv()
    assert (kind, rid, body["code"], body["details"]["limit"]) == (Kind.ERROR, 0, "too_large", "max_frame")
    assert p.closed()


def test_frames_split_byte_by_byte_get_the_same_answers(fresh_guestd: StartGuestd, tmp_path: Any) -> None:
    """hello, a ping, an oversize input for an upload and a cancel for an exec, all delivered
    one byte per write: one final frame per request, nothing else. (A duplicate id, once part of
    this stream, is a connection error since issue 32: tests/test_protocol_edges.py.)"""
    g = fresh_guestd("--max-frame", str(SMALL))
    s = g.raw_socket()
    p = RawPeer(s)
    stream = (
        hello_frame()
        + req(1, "ping")
        + req(2, "file.upload", {"path": f"{tmp_path}/up"})
        + encode_frame(Kind.INPUT, 2, {"data": b"x" * (SMALL + 5)})
        + req(3, "exec", {"argv": ["sleep", "30"]})
        + encode_frame(Kind.CANCEL, 3, {})
        + req(4, "ping")
    )
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    for i in range(len(stream)):
        s.send(stream[i : i + 1])
    kind, rid, _ = p.recv()
    assert kind == Kind.HELLO
    finals: dict[int, list[tuple[str, Any]]] = {}
    s.settimeout(5)
    while len(finals) < 4:
        kind, rid, body = p.recv()
        finals.setdefault(rid, []).append((Kind(kind).name, body.get("code")))
    assert finals == {
        1: [("RESPONSE", None)],
        2: [("ERROR", "too_large")],
        3: [("ERROR", "cancelled")],
        4: [("RESPONSE", None)],
    }
    assert not frames_for(p, 3, 0.5)  # nothing more for the cancelled exec
    assert not os.path.exists(f"{tmp_path}/up")


def test_a_signal_input_in_the_same_read_as_its_exec_is_delivered(guestd: Guestd) -> None:
    """PROTOCOL.md 7: input {signal} signals the process group of a running exec. An INPUT
    that arrives in the same read as the request is accepted by the core (counted,
    not refused) but queued in ctx.input before the handler installs input_handler;
    without stdin_stream nobody ever reads that queue, so the signal is silently lost."""
    p = RawPeer(guestd.raw_socket())
    p.hello()
    p.send_bytes(req(1, "exec", {"argv": ["sleep", "1.5"]}) + encode_frame(Kind.INPUT, 1, {"signal": "KILL"}))
    t0 = time.monotonic()
    kind, body = p.recv_final(1)
    took = time.monotonic() - t0
    assert kind == Kind.RESPONSE
    assert body["signal"] == 9 and took < 1, f"the signal was dropped: exit {body['exit_code']} after {took:.1f} s"


def test_bad_input_after_an_uploads_eof_agrees_with_the_file_system(guestd: Guestd, tmp_path: Any) -> None:
    """PROTOCOL.md 4/8: past an upload's eof guestd is committing, and its answer must say
    what happened. A malformed INPUT after the eof (or one beyond credit) makes the core
    send a final bad_request at once and cancel the handler, ignoring cancel_shielded: the
    commit already running in the I/O thread still renames the file into place, so the
    client is told the upload failed while the new file is there."""
    p = RawPeer(guestd.raw_socket())
    p.hello()
    mismatches = []
    for attempt in range(400):
        target = f"{tmp_path}/f{attempt}"
        rid = attempt + 1
        p.send_bytes(
            req(rid, "file.upload", {"path": target})
            + encode_frame(Kind.INPUT, rid, {"data": b"u" * 4096, "eof": True})
        )
        time.sleep((attempt % 15) * 0.0002)
        p.send(Kind.INPUT, rid, {"data": "not bin"})
        kind, body = p.recv_final(rid)
        time.sleep(0.005)
        if kind == Kind.ERROR and os.path.exists(target):
            mismatches.append((attempt, body["code"]))
    assert not mismatches, f"answered an error, file committed anyway: {mismatches[:5]} ({len(mismatches)} of 400)"


# =================================================================== the client against a hostile guest


def run_with_deadline(fn: Callable[[], Any], seconds: float) -> tuple[bool, Any]:
    """(finished, result or exception) of ``fn`` run on a thread, waiting ``seconds``."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            box.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    return (not t.is_alive(), box[0] if box else None)


def test_upload_to_a_guest_that_never_reads_honours_its_timeout(evil: Any) -> None:
    """aio.upload: "timeout bounds each chunk's wait". A guest that granted credit (its
    hello's 4 MiB window) and then never reads the socket stalls the client in
    ClientConnection.drain() (WriteGate.wait, no deadline): upload(progress_timeout=1) never returns."""

    def script(p: RawPeer) -> None:
        p.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        time.sleep(30)  # never reads

    c = Client(evil(script), connect_timeout=5)
    try:
        done, outcome = run_with_deadline(lambda: c.upload(b"x" * (8 * 1024 * 1024), "/f", progress_timeout=1), 8)
        assert done, "upload(progress_timeout=1) still blocked after 8 s on a guest that does not read"
        assert isinstance(outcome, GuestdError) and outcome.code == "timeout", outcome
    finally:
        c._loop.call_soon_threadsafe(c._loop.stop)


def test_stdin_writer_and_output_reader_of_one_exec_stream_both_progress(guestd: Guestd) -> None:
    """An exec_stream with stdin_stream: one task writes stdin (more than the credit), one
    reads the output, the usual way to drive an interactive process. Call._wait keeps a
    single ``_waiter``: the reader's wait replaces the writer's, credit wakes only the
    reader, and write_stdin (no timeout) hangs forever."""
    from guestd.client import AsyncClient

    payload = os.urandom(600_000)

    async def main() -> bytes:
        ac = await AsyncClient.connect(guestd.address, stream_window=SMALL)
        try:
            st = ac.exec_stream(["cat"], stdin_stream=True, deadline=30)

            async def writer() -> None:
                await st.write_stdin(payload)
                await st.close_stdin()

            async def reader() -> bytes:
                out = bytearray()
                async for _, data in st:
                    out += data
                return bytes(out)

            w = asyncio.ensure_future(writer())
            got = await asyncio.wait_for(reader(), 8)
            await asyncio.wait_for(w, 2)
            return got
        finally:
            await ac.close()

    try:
        got = asyncio.run(main())
    except (TimeoutError, GuestdError) as exc:
        pytest.fail(f"writer and reader of one exec stream deadlocked: {exc!r}")
    assert got == payload


def test_unconsumed_events_cannot_pin_unbounded_client_memory(evil: Any) -> None:
    """The client bounds queued data by its credit, but non-data events only by count
    (MAX_PENDING_EVENTS = 4096, each up to max_frame = 4 MiB): a hostile guest can make
    one plain call (a ping, whose events nobody reads) hold 16 GiB. Here: 200 events of
    1 MiB each, then the reply; the call ends holding 200 MiB of junk."""

    def script(p: RawPeer) -> None:
        _, rid, _ = p.recv()
        junk = encode_frame(Kind.EVENT, rid, {"ev": "junk", "pad": b"j" * (1024 * 1024)})
        for _ in range(200):
            p.send_bytes(junk)
        p.send(Kind.RESPONSE, rid, {"t_ns": 1})
        time.sleep(5)

    c = Client(evil(script), connect_timeout=5)

    async def go() -> int:
        conn = c.aio._conn
        call = conn.start("ping", {})
        try:
            await conn.wait(call, 20)
        except GuestProtocolError:
            return 0  # refusing such a guest is fine
        return sum(len(body.get("pad", b"")) for body, _size in (call._events or ()))

    try:
        held = c._run(go())
    finally:
        c.close()
    assert held <= 16 * 1024 * 1024, f"a finished ping holds {held >> 20} MiB of events the guest pushed"


def test_a_guest_hello_with_an_unoffered_version_is_refused(evil: Any) -> None:
    """PROTOCOL.md 3: "version is the highest version in both lists". The client offers
    [1]; a guest that answers version 7 is accepted as if it spoke version 1."""
    url = evil(lambda p: time.sleep(5), {**FAKE_GUEST_HELLO, "version": 7})
    with pytest.raises(GuestdError):
        Client(url, connect_timeout=3).close()


def test_max_inflight_plus_one_is_limit(fresh_guestd: StartGuestd) -> None:
    g = fresh_guestd("--max-inflight", "2")
    p = RawPeer(g.raw_socket())
    p.hello()
    p.send_bytes(
        req(1, "exec", {"argv": ["sleep", "0.5"]}) + req(2, "exec", {"argv": ["sleep", "0.5"]}) + req(3, "ping")
    )
    kind, body = p.recv_final(3)
    assert (kind, body["code"], body["details"]) == (Kind.ERROR, "limit", {"limit": "max_inflight", "value": 2})
    finals = p.recv_finals([1, 2])  # the two execs start in parallel: either may answer first
    assert {rid: kind for rid, (kind, _) in finals.items()} == {1: Kind.RESPONSE, 2: Kind.RESPONSE}


def test_zz_shared_guestd_survived_the_attacks_without_tracebacks(guestd: Guestd) -> None:
    """Runs last in this file: after everything above, the shared daemon still answers
    and logged no exception."""
    with guestd.client() as c:
        assert c.ping(deadline=5) > 0
    log = guestd.log()
    assert "Traceback" not in log, log[log.find("Traceback") - 200 :][:3000]
