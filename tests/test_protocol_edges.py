"""The protocol's edges against a real guestd, frame by frame: one final frame per request
whatever arrives with it, frame sizes within the client's max_frame, bounded memory for
a peer that never reads, the hello deadline, and the order of hello checks."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from guestd.testing import Guestd, StartGuestd, limits_config
from guestd.testing.rawwire import FrameCounter, RawPeer
from guestd.wire.frames import Kind, encode_frame

SMALL = 64 * 1024


def small_peer(g: Guestd) -> RawPeer:
    p = RawPeer(g.raw_socket())
    hello = p.hello(max_frame=SMALL, stream_window=SMALL)
    assert hello["max_frame"] == SMALL and hello["stream_window"] == SMALL
    return p


# ------------------------------------------------------------------ one final frame


def test_input_beyond_credit_in_the_same_read_as_the_upload_ends_it(guestd: Guestd, tmp_path: Any) -> None:
    p = small_peer(guestd)
    req = encode_frame(Kind.REQUEST, 5, {"op": "file.upload", "args": {"path": f"{tmp_path}/up"}})
    over = encode_frame(Kind.INPUT, 5, {"data": b"x" * (SMALL + 1)})
    p.send_bytes(req + over)  # one write: guestd reads both before the handler first runs
    kind, body = p.recv_final(5)
    assert (kind, body["code"], body["details"]["limit"]) == (Kind.ERROR, "limit", "stream_window")
    p.request(5, "ping")  # the id is free again, not "already in flight"
    assert p.recv_final(5)[0] == Kind.RESPONSE
    assert not os.path.exists(f"{tmp_path}/up")


def test_oversize_input_in_the_same_read_as_the_upload_ends_it(fresh_guestd: StartGuestd, tmp_path: Any) -> None:
    g = fresh_guestd("--max-frame", str(SMALL))
    p = small_peer(g)
    req = encode_frame(Kind.REQUEST, 6, {"op": "file.upload", "args": {"path": f"{tmp_path}/up"}})
    over = encode_frame(Kind.INPUT, 6, {"data": b"x" * (SMALL + 100)})
    p.send_bytes(req + over)
    kind, body = p.recv_final(6)
    assert (kind, body["code"]) == (Kind.ERROR, "too_large")
    p.request(6, "ping")
    assert p.recv_final(6)[0] == Kind.RESPONSE


def test_a_cancel_in_the_same_read_as_its_request_still_gets_a_final_frame(guestd: Guestd) -> None:
    p = small_peer(guestd)
    req = encode_frame(Kind.REQUEST, 8, {"op": "exec", "args": {"argv": ["sleep", "30"]}})
    p.send_bytes(req + encode_frame(Kind.CANCEL, 8, {}))
    kind, body = p.recv_final(8)
    assert (kind, body["code"]) == (Kind.ERROR, "cancelled")
    p.request(8, "ping")
    assert p.recv_final(8)[0] == Kind.RESPONSE


def test_a_cancel_after_an_uploads_eof_answers_what_happened(guestd: Guestd, tmp_path: Any) -> None:
    # A cancel sent just after the eof lands before, during or after the commit. Whatever
    # guestd answers must agree with the file system: before the fix, a cancel that hit the
    # commit said "cancelled" for a file that was then in place.
    p = RawPeer(guestd.raw_socket())
    p.hello()
    outcomes = {"cancelled": 0, "committed": 0}
    for attempt in range(300):
        target = f"{tmp_path}/f{attempt}"
        rid = attempt + 1
        req = encode_frame(Kind.REQUEST, rid, {"op": "file.upload", "args": {"path": target}})
        p.send_bytes(req + encode_frame(Kind.INPUT, rid, {"data": b"u" * 4096, "eof": True}))
        time.sleep((attempt % 7) * 0.0003)
        p.send(Kind.CANCEL, rid, {})
        kind, body = p.recv_final(rid)
        if kind == Kind.RESPONSE:
            assert os.path.getsize(target) == body["size"] == 4096
            outcomes["committed"] += 1
        else:
            assert body["code"] == "cancelled"
            assert not os.path.exists(target), f"attempt {attempt}: answered cancelled, the file is in place"
            outcomes["cancelled"] += 1
    assert outcomes["committed"] > 0  # the cancel did land after eof in some attempts


# ------------------------------------------------------------------ frame sizes


def test_download_events_fit_the_clients_max_frame(guestd: Guestd, tmp_path: Any) -> None:
    path = f"{tmp_path}/blob"
    with open(path, "wb") as f:
        f.write(os.urandom(3 * 1024 * 1024 + 17))
    p = small_peer(guestd)
    p.request(1, "file.download", {"path": path})  # no chunk: the server picks
    r = FrameCounter(p, SMALL, SMALL)
    kind, body, got = r.until_final(1)
    assert kind == Kind.RESPONSE and got == body["bytes"] == 3 * 1024 * 1024 + 17
    assert r.largest <= SMALL and r.violations == []


def test_exec_stream_events_fit_the_clients_max_frame(guestd: Guestd) -> None:
    p = small_peer(guestd)
    p.request(1, "exec", {"argv": ["head", "-c", "3000000", "/dev/zero"], "stream": True})
    r = FrameCounter(p, SMALL, SMALL)
    kind, body, got = r.until_final(1)
    assert kind == Kind.RESPONSE and body["exit_code"] == 0 and got == 3_000_000
    assert r.largest <= SMALL and r.violations == []


def test_attach_events_fit_the_clients_max_frame(guestd: Guestd) -> None:
    p = small_peer(guestd)
    # A ring larger than the output: attach may start after the process finished writing.
    p.request(1, "process.start", {"argv": ["head", "-c", "2000000", "/dev/zero"], "ring_bytes": 4 << 20})
    kind, body = p.recv_final(1)
    assert kind == Kind.RESPONSE, body
    process_id = body["id"]
    p.request(2, "process.attach", {"id": process_id, "follow": True})
    r = FrameCounter(p, SMALL, SMALL)
    kind, final, got = r.until_final(2)
    assert kind == Kind.RESPONSE and got == 2_000_000 == final["stdout_offset"]
    assert r.largest <= SMALL and r.violations == []


def test_max_frame_below_the_floor_is_raised_to_it(guestd: Guestd) -> None:
    p = RawPeer(guestd.raw_socket())
    hello = p.hello(max_frame=100, stream_window=10)
    assert hello["max_frame"] == 65536 and hello["stream_window"] == 65536


# ------------------------------------------------------------------ peers that misbehave


def test_a_peer_that_never_reads_cannot_grow_guestd(fresh_guestd: StartGuestd) -> None:
    g = fresh_guestd()
    s = g.raw_socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    p = RawPeer(s)
    p.hello()
    before = g.rss()
    batch = b"".join(encode_frame(Kind.REQUEST, i, {"op": "ping", "args": {}}) for i in range(1, 20001))
    s.settimeout(0.5)
    sent = blocked = 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            s.sendall(batch)
            sent += 1
        except TimeoutError:
            blocked += 1  # guestd stopped reading us: the point of the test
            if blocked >= 3:
                break
    grown = g.rss() - before
    assert blocked >= 3, f"guestd kept reading {sent} batches of 20000 unread pings"
    assert grown < 64 * 1024 * 1024, f"guestd grew by {grown >> 20} MiB for a peer that never reads"
    s.close()
    with g.client() as c:
        assert c.ping(deadline=10) > 0


def test_silent_peers_get_a_hello_deadline_and_cannot_lock_the_host_out(
    fresh_guestd: StartGuestd, tmp_path: Any
) -> None:
    cfg = limits_config(str(tmp_path), hello_timeout_s=1.0, max_connections=4)
    g = fresh_guestd("--config", cfg)
    silent = [g.raw_socket() for _ in range(4)]
    # Every slot is held by a peer that never says hello; the host's real connection still gets in.
    with g.client(connect_timeout=5) as c:
        assert c.ping(deadline=5) > 0
    # The evicted one was told why; the rest hit the deadline.
    reasons = []
    for s in silent:
        p = RawPeer(s)
        kind, rid, body = p.recv()
        assert (kind, rid) == (Kind.ERROR, 0)
        reasons.append(body["code"])
        assert p.closed()
    assert sorted(set(reasons)) == ["limit", "timeout"]


def test_a_hello_with_a_wrong_token_changes_nothing(fresh_guestd: StartGuestd, tmp_path: Any) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    g = fresh_guestd("--token-file", str(token), "--simulate-privileged")  # never touch this host's clock
    p = RawPeer(g.raw_socket())
    p.send(Kind.HELLO, 0, {"versions": [1], "token": "wrong", "time_ns": time.time_ns() + 3600 * 10**9})
    kind, rid, body = p.recv()
    assert (kind, rid, body["code"]) == (Kind.ERROR, 0, "permission_denied")
    with g.client(token="s3cret") as c:
        assert c.call("info", {}, deadline=10)["snapshot"]["suspected_restore"] is False


def test_request_id_zero_is_a_protocol_error(guestd: Guestd) -> None:
    p = RawPeer(guestd.raw_socket())
    p.hello()
    p.request(0, "ping")
    kind, rid, body = p.recv()
    assert (kind, rid, body["code"], body["details"]["field"]) == (Kind.ERROR, 0, "protocol_error", "id")
    assert p.closed()


def test_a_duplicate_in_flight_id_closes_the_connection_and_cancels_its_requests(guestd: Guestd) -> None:
    """Issue 32 rule 10 (before: bad_request on id 1, then the original's own final frame, two
    frames ending one id). Now a connection error, as HTTP/2's reused stream id: protocol_error
    on id 0, no final frame for the original, the connection closed, and its exec killed (the
    connection's end cancels every request, PROTOCOL.md 4)."""
    p = RawPeer(guestd.raw_socket())
    p.hello()
    p.request(1, "exec", {"shell": "echo $$; exec sleep 300", "stream": True})
    kind, rid, body = p.recv()
    assert (kind, rid, body["ev"]) == (Kind.EVENT, 1, "started")
    pid = body["pid"]
    p.request(1, "ping")
    seen: list[tuple[int, int, dict[str, Any]]] = []
    p.sock.settimeout(10)
    while True:  # every frame up to the close (bounded: guestd closes at once, or the timeout fails it)
        try:
            seen.append(p.recv())
        except EOFError:
            break
    errors = [f for f in seen if f[0] == Kind.ERROR]
    assert errors == [(Kind.ERROR, 0, errors[0][2])], seen  # one error: on id 0, none on id 1
    assert (errors[0][2]["code"], errors[0][2]["details"]) == ("protocol_error", {"field": "id", "reason": "in_flight"})
    assert all(f[0] != Kind.RESPONSE for f in seen), seen
    for _ in range(400):  # bounded: the cancel's SIGTERM ends the sleep at once
        if not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}"), "the exec outlived its connection"


def test_many_unreading_peers_leave_ping_answering(guestd: Guestd) -> None:
    socks = []
    for _ in range(8):
        s = guestd.raw_socket()
        RawPeer(s).hello()
        s.sendall(b"".join(encode_frame(Kind.REQUEST, i, {"op": "ping", "args": {}}) for i in range(1, 5001)))
        socks.append(s)
    done = threading.Event()

    def ping() -> None:
        with guestd.client() as c:
            c.ping(deadline=10)
        done.set()

    threading.Thread(target=ping, daemon=True).start()
    assert done.wait(15)
    for s in socks:
        s.close()
