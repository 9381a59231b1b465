"""Protocol behaviour of a real guestd over a raw Unix socket: handshake, framing, bad input."""

from __future__ import annotations

import struct
import threading
import time

import msgpack
import pytest

from guestd.testing import Guestd, StartGuestd
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import FRAME_VERSION, HEADER, MAGIC, Kind, encode_frame, encode_raw


@pytest.fixture
def peer(guestd: Guestd) -> RawPeer:
    p = RawPeer(guestd.raw_socket())
    p.hello()
    return p


def test_hello_reports_version_capabilities_and_limits(guestd: Guestd) -> None:
    p = RawPeer(guestd.raw_socket())
    hello = p.hello(versions=[7, 1], max_frame=1 << 20, stream_window=1 << 20, unknown_field="ignored")
    assert hello["version"] == 1
    assert {"system", "exec", "files"} <= set(hello["capabilities"])
    assert "exec" in hello["ops"] and "file.upload" in hello["ops"]
    assert hello["limits"]["max_frame"] >= 1 << 20
    assert hello["limits"]["max_inflight"] >= 1000
    assert hello["max_frame"] == 1 << 20  # lowered to what we asked
    assert hello["stream_window"] == 1 << 20
    assert len(hello["boot_id"]) > 0


def test_unsupported_version_is_typed_and_closes(guestd: Guestd) -> None:
    p = RawPeer(guestd.raw_socket())
    p.send(Kind.HELLO, 0, {"versions": [99]})
    kind, rid, body = p.recv()
    assert (kind, rid, body["code"]) == (Kind.ERROR, 0, "unsupported_version")
    assert body["details"]["supported"] == [1]
    assert p.closed()


def test_request_before_hello_is_refused_but_connection_lives(guestd: Guestd) -> None:
    p = RawPeer(guestd.raw_socket())
    p.request(5, "ping")
    kind, rid, body = p.recv()
    assert (kind, rid, body["code"]) == (Kind.ERROR, 5, "protocol_error")
    p.hello()
    p.request(6, "ping")
    assert p.recv_final(6)[0] == Kind.RESPONSE


def test_unknown_op_and_unknown_fields(peer: RawPeer) -> None:
    peer.request(1, "no.such.op")
    kind, body = peer.recv_final(1)
    assert kind == Kind.ERROR and body["code"] == "unknown_op"
    peer.send(Kind.REQUEST, 2, {"op": "ping", "args": {"whatever": 1}, "future_envelope": True})
    assert peer.recv_final(2)[0] == Kind.RESPONSE


@pytest.mark.parametrize(
    "payload, field",
    [
        (msgpack.packb({"op": "exec", "args": {"argv": "not-a-list"}}), "argv"),
        (msgpack.packb({"op": "exec", "args": {"argv": ["true"], "timeout_s": "soon"}}), "timeout_s"),
        (msgpack.packb({"op": "file.read", "args": {}}), "path"),
        (msgpack.packb({"op": "file.read", "args": {"path": 5}}), "path"),
        (msgpack.packb({"op": "file.read", "args": {"path": "/", "offset": -1}}), "offset"),
        (msgpack.packb({"op": 42}), "op"),
        (msgpack.packb({"op": "ping", "args": [1, 2]}), "args"),
        (msgpack.packb({"op": "exec", "args": {"argv": ["true"], "capture": "middle"}}), "capture"),
        (msgpack.packb({"op": "exec", "args": {"argv": ["true"], "timeout_s": float("nan")}}), "timeout_s"),
    ],
)
def test_wrong_types_and_missing_fields_are_bad_request(peer: RawPeer, payload: bytes, field: str) -> None:
    peer.send_bytes(encode_raw(Kind.REQUEST, 3, payload))
    kind, body = peer.recv_final(3)
    assert kind == Kind.ERROR and body["code"] == "bad_request"
    assert body["details"]["field"] == field


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", b"\x93\x01\x02", b"", b"\x81\x01\x02", b"\xdf\xff\xff\xff\xff", b"\x91" * 5000, msgpack.packb("str")],
)
def test_malformed_payload_is_bad_request(peer: RawPeer, payload: bytes) -> None:
    peer.send_bytes(encode_raw(Kind.REQUEST, 9, payload))
    kind, body = peer.recv_final(9)
    assert kind == Kind.ERROR and body["code"] == "bad_request"
    peer.request(10, "ping")
    assert peer.recv_final(10)[0] == Kind.RESPONSE


def test_oversize_frame_gets_too_large_and_body_is_skipped(guestd: Guestd) -> None:
    p = RawPeer(guestd.raw_socket())
    limit = p.hello()["limits"]["max_frame"]
    size = limit + 10
    # The header announces the oversize body; send it in pieces, then a normal request.
    p.send_bytes(HEADER.pack(MAGIC, FRAME_VERSION, Kind.REQUEST, size, 77))
    junk = b"\xc1" * size  # would be invalid msgpack if anything tried to decode it
    for i in range(0, size, 1 << 20):
        p.send_bytes(junk[i : i + (1 << 20)])
    p.request(78, "ping")
    kind, body = p.recv_final(77)
    assert kind == Kind.ERROR and body["code"] == "too_large"
    assert body["details"]["limit"] == "max_frame"
    assert p.recv_final(78)[0] == Kind.RESPONSE


def test_bad_magic_is_protocol_error_and_closes(peer: RawPeer) -> None:
    peer.send_bytes(b"HTTP/1.1 GET /\r\n\r\n")
    kind, rid, body = peer.recv()
    assert (kind, rid, body["code"]) == (Kind.ERROR, 0, "protocol_error")
    assert peer.closed()


def test_duplicate_id_while_in_flight(peer: RawPeer) -> None:
    """A connection error (issue 32 rule 10): protocol_error on id 0, close, the exec cancelled."""
    peer.request(1, "exec", {"argv": ["sleep", "30"]})
    peer.request(1, "ping")
    kind, rid, body = peer.recv()
    assert (kind, rid, body["code"], body["details"]) == (
        Kind.ERROR,
        0,
        "protocol_error",
        {"field": "id", "reason": "in_flight"},
    )
    assert peer.closed()


def test_unknown_frame_kinds_are_ignored(peer: RawPeer) -> None:
    peer.send(200, 0, {"from": "the future"})
    peer.send(Kind.WINDOW, 12345, {"bytes": 10})  # for no request: ignored
    peer.send(Kind.CANCEL, 12345, {})
    peer.request(4, "ping")
    assert peer.recv_final(4)[0] == Kind.RESPONSE


def test_cancel_stops_a_running_exec(peer: RawPeer) -> None:
    peer.request(1, "exec", {"shell": "sleep 30 & sleep 30"})
    time.sleep(0.2)
    t0 = time.monotonic()
    peer.send(Kind.CANCEL, 1, {})
    kind, body = peer.recv_final(1)
    assert kind == Kind.ERROR and body["code"] == "cancelled"
    assert time.monotonic() - t0 < 10


def test_max_inflight_is_a_typed_limit(fresh_guestd: StartGuestd) -> None:
    g = fresh_guestd("--max-inflight", "4")
    p = RawPeer(g.raw_socket())
    p.hello()
    for i in range(1, 5):
        p.request(i, "exec", {"argv": ["sleep", "0.5"]})
    p.request(5, "exec", {"argv": ["true"]})
    kind, rid, body = p.recv()
    assert (kind, rid, body["code"]) == (Kind.ERROR, 5, "limit")
    assert body["details"]["limit"] == "max_inflight"


def test_thousand_pings_in_flight_on_one_connection(peer: RawPeer) -> None:
    n = 1000
    peer.send_bytes(b"".join(encode_frame(Kind.REQUEST, i, {"op": "ping"}) for i in range(1, n + 1)))
    seen: set[int] = set()
    while len(seen) < n:
        kind, rid, _ = peer.recv()
        assert kind == Kind.RESPONSE
        seen.add(rid)
    assert seen == set(range(1, n + 1))


def test_ping_is_not_delayed_by_a_long_exec(peer: RawPeer) -> None:
    peer.request(1, "exec", {"argv": ["sleep", "2"]})
    peer.request(2, "ping")
    kind, rid, _ = peer.recv()
    assert (kind, rid) == (Kind.RESPONSE, 2)  # the ping answer arrives first


def test_abrupt_disconnects_mid_frame_and_mid_stream(guestd: Guestd) -> None:
    for cut in range(1, 14):
        p = RawPeer(guestd.raw_socket())
        p.hello()
        frame = encode_frame(Kind.REQUEST, 1, {"op": "ping"})
        p.send_bytes(frame[:cut])
        p.sock.close()
    p = RawPeer(guestd.raw_socket())
    p.hello()
    p.request(1, "exec", {"shell": "yes | head -c 50000000", "stream": True})
    p.recv()
    p.sock.close()
    p = RawPeer(guestd.raw_socket())
    p.hello()
    p.request(1, "file.upload", {"path": f"{guestd.workdir}/half-upload"})
    p.send(Kind.INPUT, 1, {"data": b"x" * 1000})
    p.sock.close()
    time.sleep(0.3)
    with guestd.client() as c:
        c.ping()
        assert not c.exists(f"{guestd.workdir}/half-upload")
    assert guestd.alive()


def test_many_connections_at_once(guestd: Guestd) -> None:
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with guestd.client() as c:
                for _ in range(20):
                    c.ping()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


def test_header_layout_is_as_documented() -> None:
    frame = encode_frame(Kind.REQUEST, 0x01020304, {"op": "ping"})
    assert frame[:2] == b"GD" and frame[2] == 1 and frame[3] == Kind.REQUEST
    (length,) = struct.unpack(">I", frame[4:8])
    assert length == len(frame) - 12
    assert frame[8:12] == b"\x01\x02\x03\x04"


def test_max_connections_is_a_typed_limit(fresh_guestd: StartGuestd) -> None:
    g = fresh_guestd("--max-connections", "2")
    held = [RawPeer(g.raw_socket()) for _ in range(2)]
    for p in held:
        p.hello()
    extra = RawPeer(g.raw_socket())
    kind, rid, body = extra.recv()
    assert (kind, rid, body["code"]) == (Kind.ERROR, 0, "limit")
    assert body["details"]["limit"] == "max_connections"
    assert extra.closed()
    for p in held:  # handshaken peers keep their slots (only hello-less ones are evicted)
        p.request(1, "ping")
        assert p.recv_final(1)[0] == Kind.RESPONSE
    held[0].sock.close()
    time.sleep(0.2)
    again = RawPeer(g.raw_socket())
    again.hello()  # a slot was freed


def test_random_and_mutated_frames_never_kill_the_daemon(guestd: Guestd) -> None:
    import random

    rng = random.Random(1234)
    good = [
        encode_frame(Kind.REQUEST, 1, {"op": "ping", "args": {}}),
        encode_frame(Kind.REQUEST, 2, {"op": "file.stat", "args": {"path": "/"}}),
        encode_frame(Kind.INPUT, 3, {"data": b"x"}),
        encode_frame(Kind.WINDOW, 4, {"bytes": 5}),
    ]
    for _ in range(150):
        p = RawPeer(guestd.raw_socket())
        p.hello()
        frame = bytearray(rng.choice(good))
        for _ in range(rng.randint(1, 6)):  # flip bytes past the magic, so most frames stay frames
            frame[rng.randrange(4, len(frame))] = rng.randrange(256)
        if rng.random() < 0.3:
            frame += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
        try:
            p.send_bytes(bytes(frame))
        except OSError:
            pass
        p.sock.close()
    with guestd.client() as c:
        assert c.ping() > 0


def test_network_fuzz_batches_keep_guestd_answering_with_bounded_rss(fresh_guestd: StartGuestd) -> None:
    import random

    from guestd.wire.schema import OPS

    g = fresh_guestd("--simulate-privileged")  # never touch this host's clock
    rng = random.Random(99)
    junk_values = [None, True, -1, 2**63, 1.5, "", "x" * 300, b"\x00" * 10, [], {}, [1, [2, [3]]], {"a": {"b": 1}}]
    with g.client() as c:
        c.ping()
        base = g.rss()
        for batch in range(6):
            for i in range(40):
                p = RawPeer(g.raw_socket())
                try:
                    p.hello()
                    kind = rng.choice([0, 1, 2, 3])
                    if kind == 0:  # half frames
                        frame = encode_frame(Kind.REQUEST, i + 1, {"op": "ping"})
                        p.send_bytes(frame[: rng.randint(1, len(frame) - 1)])
                    elif kind == 1:  # huge declared lengths
                        p.send_bytes(HEADER.pack(MAGIC, FRAME_VERSION, Kind.REQUEST, rng.choice([2**31, 2**32 - 1]), i))
                    elif kind == 2:  # deep msgpack nesting
                        depth = rng.choice([100, 1000, 100000])
                        p.send_bytes(encode_raw(Kind.REQUEST, i + 1, b"\x91" * depth + b"\xc0"))
                    else:  # wrong types in every field of a random op
                        op = rng.choice(OPS)
                        args = {f.name: rng.choice(junk_values) for f in op.args}
                        p.send(Kind.REQUEST, i + 1, {"op": op.name, "args": args})
                except OSError:
                    pass
                p.sock.close()
            for _ in range(30):  # a burst of connects and disconnects
                s = g.raw_socket()
                s.close()
            assert c.ping() > 0, f"batch {batch}"
        assert g.rss() - base < 64 * 1024 * 1024
    assert g.alive()
