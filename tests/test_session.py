"""The session core without sockets: bytes in, events out; calls in, bytes out.

A ServerSession and a ClientSession are wired to each other (or fed hand-made frames),
so every protocol rule is checked here on its own, byte by byte where it matters.
"""

from __future__ import annotations

from typing import Any

import pytest

from guestd.wire.errors import GuestdError
from guestd.wire.frames import Frame, FrameDecoder, Kind, encode_frame
from guestd.wire.messages import decode_body
from guestd.wire.schema import OPS_BY_NAME
from guestd.wire.session import (
    MIN_MAX_FRAME,
    CancelRequested,
    ClientSession,
    ConnectionFailed,
    CreditGranted,
    ErrorReceived,
    EventReceived,
    HelloAccepted,
    HelloReceived,
    InputReceived,
    Phase,
    RequestAborted,
    RequestReceived,
    ResponseReceived,
    ServerSession,
    SessionReset,
    Stream,
    data_overhead,
)

WINDOW = 64 * 1024


def server(**kw: Any) -> ServerSession:
    opts: dict[str, Any] = {"ops": OPS_BY_NAME, "max_frame": 1 << 20, "stream_window": 1 << 20, "max_inflight": 16}
    opts.update(kw)
    return ServerSession(**opts)


def reply_body(s: ServerSession) -> dict[str, Any]:
    return {
        "version": s.version,
        "server": "test",
        "capabilities": [],
        "ops": [],
        "limits": {"max_frame": s.limit_max_frame},
        "stream_window": s.stream_window,
        "max_frame": s.peer_max_frame,
        "boot_id": "b",
        "session": "s",
    }


def frames(data: list[bytes | bytearray]) -> list[tuple[int, int, dict[str, Any], int]]:
    """Decode what a session queued: (kind, id, body, payload length)."""
    dec = FrameDecoder(1 << 30)
    dec.feed(b"".join(data))
    out = []
    while (f := dec.next_frame()) is not None:
        assert isinstance(f, Frame)
        out.append((f.kind, f.id, decode_body(f.payload), len(f.payload)))
    return out


def hello(**extra: Any) -> bytes:
    return encode_frame(Kind.HELLO, 0, {"versions": [1], **extra})


def opened(**kw: Any) -> ServerSession:
    s = server(**kw)
    (ev,) = s.receive_data(hello(max_frame=MIN_MAX_FRAME, stream_window=WINDOW))
    assert isinstance(ev, HelloReceived)
    s.accept_hello(reply_body)
    assert s.resume() == []
    s.data_to_send()
    return s


def admitted(s: ServerSession, req_id: int, op: str, args: dict[str, Any] | None = None) -> Stream:
    (ev,) = s.receive_data(request(req_id, op, args))
    assert isinstance(ev, RequestReceived)
    return ev.stream


def request(req_id: int, op: str, args: dict[str, Any] | None = None) -> bytes:
    return encode_frame(Kind.REQUEST, req_id, {"op": op, "args": args or {}})


def test_nothing_in_a_hello_takes_effect_before_it_is_accepted() -> None:
    s = server()
    (ev,) = s.receive_data(hello(max_frame=70_000, stream_window=80_000, token="wrong", time_ns=1))
    assert isinstance(ev, HelloReceived) and ev.hello["time_ns"] == 1
    assert s.phase is Phase.HELLO_PENDING and s.peer_max_frame == 1 << 20 and s.version is None
    assert s.receive_data(request(1, "ping")) == []  # waits in the decoder while the hello is checked
    s.refuse(GuestdError("permission_denied", "bad token"))
    ((kind, rid, body, _),) = frames(s.data_to_send())
    assert (kind, rid, body["code"]) == (Kind.ERROR, 0, "permission_denied")
    assert s.phase.value == "closed"
    assert s.resume() == [] and s.data_to_send() == []  # a refused peer is not served


def test_max_frame_and_window_have_a_documented_floor() -> None:
    s = server()
    (ev,) = s.receive_data(hello(max_frame=100, stream_window=10))
    assert isinstance(ev, HelloReceived)
    s.accept_hello(reply_body)
    assert s.peer_max_frame == MIN_MAX_FRAME and s.stream_window == 64 * 1024


def test_refused_input_in_the_same_read_as_its_request_ends_it_with_one_final_frame() -> None:
    s = opened()
    over = encode_frame(Kind.INPUT, 7, {"data": b"x" * (WINDOW + 1)})
    events = s.receive_data(request(7, "file.upload", {"path": "/tmp/x"}) + over)
    assert [type(e) for e in events] == [RequestReceived, RequestAborted]
    ((kind, rid, body, _),) = frames(s.data_to_send())
    assert (kind, rid, body["code"], body["details"]["limit"]) == (Kind.ERROR, 7, "limit", "stream_window")
    # The handler's late answer is dropped: exactly one final frame.
    old = events[0].stream  # type: ignore[union-attr]
    assert not s.respond(old, {"size": 0}) and not s.fail(old, GuestdError("cancelled", "x"))
    assert s.data_to_send() == []
    # The id is free again, and the old handle cannot touch the new request.
    new = admitted(s, 7, "ping")
    assert not s.fail(old, GuestdError("cancelled", "late")) and new.open
    assert s.respond(new, {"t_ns": 1})


def test_input_at_exactly_the_credit_is_accepted_one_byte_more_is_not() -> None:
    s = opened()
    s.receive_data(request(1, "file.upload", {"path": "/x"}))
    (ev,) = s.receive_data(encode_frame(Kind.INPUT, 1, {"data": b"a" * WINDOW}))
    assert isinstance(ev, InputReceived)
    (ev2,) = s.receive_data(encode_frame(Kind.INPUT, 1, {"data": b"b"}))
    assert isinstance(ev2, RequestAborted) and ev2.error.code == "limit"


def test_input_bodies_are_validated_against_the_op() -> None:
    s = opened()
    s.receive_data(request(1, "file.upload", {"path": "/x"}))
    (ev,) = s.receive_data(encode_frame(Kind.INPUT, 1, {"data": "text, not bin"}))
    assert isinstance(ev, RequestAborted) and ev.error.code == "bad_request"
    assert ev.error.details["field"] == "data"


def test_oversize_input_aborts_its_request_only() -> None:
    s = opened(max_frame=MIN_MAX_FRAME)
    s.receive_data(request(1, "file.upload", {"path": "/x"}))
    big = encode_frame(Kind.INPUT, 1, {"data": b"z" * (MIN_MAX_FRAME + 10)})
    events = s.receive_data(big + request(2, "ping"))
    assert [type(e) for e in events] == [RequestAborted, RequestReceived]
    assert events[0].error.code == "too_large"  # type: ignore[union-attr]


def test_cancel_and_window_for_requests_not_in_flight_are_ignored() -> None:
    s = opened()
    assert s.receive_data(encode_frame(Kind.CANCEL, 9, {}) + encode_frame(Kind.WINDOW, 9, {"bytes": 5})) == []
    stream = admitted(s, 9, "file.download", {"path": "/x"})
    events = s.receive_data(encode_frame(Kind.CANCEL, 9, {}) + encode_frame(Kind.WINDOW, 9, {"bytes": 5}))
    assert events == [CancelRequested(stream), CreditGranted(stream, 5)]


def test_request_id_zero_is_a_protocol_error() -> None:
    s = opened()
    (ev,) = s.receive_data(request(0, "ping"))
    assert isinstance(ev, ConnectionFailed)
    ((kind, rid, body, _),) = frames(s.data_to_send())
    assert (kind, rid, body["code"], body["details"]["field"]) == (Kind.ERROR, 0, "protocol_error", "id")


def test_a_duplicate_in_flight_id_is_a_connection_error() -> None:
    """Issue 32 rule 10 (was: bad_request on that id, then the original's own final frame: two
    frames that end one id). Like HTTP/2's reused stream id: protocol_error on id 0, close, and
    no final frame for any request of the connection."""
    s = opened()
    original = admitted(s, 3, "file.download", {"path": "/x"})
    (ev,) = s.receive_data(request(3, "ping"))
    assert isinstance(ev, ConnectionFailed)
    ((kind, rid, body, _),) = frames(s.data_to_send())
    assert (kind, rid, body["code"], body["details"]) == (
        Kind.ERROR,
        0,
        "protocol_error",
        {"field": "id", "reason": "in_flight"},
    )
    assert s.phase is Phase.CLOSED
    assert s.respond(original, {"bytes": 0, "size": 0})  # the handler ends it...
    assert s.data_to_send() == []  # ...but nothing more is sent on a closed connection


def test_an_oversize_request_on_an_id_in_flight_is_a_connection_error_too() -> None:
    s = opened(max_frame=MIN_MAX_FRAME)
    admitted(s, 3, "file.download", {"path": "/x"})
    big = request(3, "file.write", {"path": "/x", "data": b"z" * (MIN_MAX_FRAME + 10)})
    (ev,) = s.receive_data(big)
    assert isinstance(ev, ConnectionFailed) and ev.error.details["reason"] == "in_flight"


def test_data_room_is_bounded_by_credit_and_the_peers_max_frame() -> None:
    s = opened()
    st = admitted(s, 1, "file.download", {"path": "/x"})
    fields = {"ev": "stdout", "offset": 123456789}
    room = s.data_room(st, fields)
    assert room == min(WINDOW, MIN_MAX_FRAME - data_overhead(fields)) == s.frame_room(fields)
    assert s.send_data(st, fields, b"q" * room)
    ((_, _, _, length),) = frames(s.data_to_send())
    assert length <= MIN_MAX_FRAME
    assert s.data_room(st, fields) == WINDOW - room  # the rest of the credit
    s.send_data(st, fields, b"r" * (WINDOW - room))
    assert s.data_room(st, fields) == 0  # credit spent: wait for WINDOW
    with pytest.raises(AssertionError):
        s.send_data(st, fields, b"q")
    s.receive_data(encode_frame(Kind.WINDOW, 1, {"bytes": 10}))
    assert s.data_room(st, fields) == 10


def test_every_data_frame_fits_exactly_at_the_limit() -> None:
    s = opened()
    st = admitted(s, 1, "file.download", {"path": "/x"})
    s.receive_data(encode_frame(Kind.WINDOW, 1, {"bytes": 1 << 20}))
    fields = {"ev": "data"}
    room = s.data_room(st, fields)
    s.send_data(st, fields, b"z" * room)
    ((_, _, body, length),) = frames(s.data_to_send())
    # Conservative by at most 2 bytes: the overhead assumes a bin32 header.
    assert MIN_MAX_FRAME - 2 <= length <= MIN_MAX_FRAME and len(body["data"]) == room


def test_an_unencodable_reply_becomes_a_typed_error() -> None:
    s = opened()
    st = admitted(s, 1, "file.stat", {"path": "/x"})
    assert s.respond(st, {"path": "bad\udcff"})  # a surrogate-escaped name is not UTF-8
    ((kind, rid, body, _),) = frames(s.data_to_send())
    assert (kind, rid, body["code"], body["details"]["stage"]) == (Kind.ERROR, 1, "internal", "encode")


def test_a_reply_larger_than_the_clients_max_frame_is_too_large() -> None:
    s = opened()
    st = admitted(s, 1, "file.read", {"path": "/x"})
    s.respond(st, {"data": b"x" * (MIN_MAX_FRAME + 1), "size": 1})
    ((kind, _, body, _),) = frames(s.data_to_send())
    assert (kind, body["code"]) == (Kind.ERROR, "too_large")


def test_serial_sessions_start_over_on_a_new_hello() -> None:
    s = opened(serial=True)
    st = admitted(s, 1, "file.download", {"path": "/x"})
    events = s.receive_data(hello())
    assert events[0] == SessionReset((st,)) and isinstance(events[1], HelloReceived)
    assert not st.open


def test_bad_framing_resyncs_on_serial_and_closes_otherwise() -> None:
    s = opened(serial=True)
    (ev,) = s.receive_data(b"noise!!" + request(1, "ping"))
    assert isinstance(ev, RequestReceived)
    t = opened()
    (ev2,) = t.receive_data(b"noise!!" + request(1, "ping"))
    assert isinstance(ev2, ConnectionFailed)


# ------------------------------------------------------------------ client and server together


def pair() -> tuple[ClientSession, ServerSession]:
    c = ClientSession(ops=OPS_BY_NAME, max_frame=MIN_MAX_FRAME, stream_window=WINDOW)
    s = server()
    c.send_hello({"versions": [1], "max_frame": MIN_MAX_FRAME, "stream_window": WINDOW})
    (ev,) = s.receive_data(b"".join(c.data_to_send()))
    assert isinstance(ev, HelloReceived)
    s.accept_hello(reply_body)
    (ack,) = c.receive_data(b"".join(s.data_to_send()))
    assert isinstance(ack, HelloAccepted)
    return c, s


def test_a_stream_round_trip_within_credit_both_ways() -> None:
    c, s = pair()
    cst = c.start("file.upload", {"path": "/x"})
    assert cst.id != 0
    (req,) = s.receive_data(b"".join(c.data_to_send()))
    assert isinstance(req, RequestReceived) and req.op == "file.upload"
    room = c.data_room(cst, {})
    assert room == WINDOW  # the server's frames are larger than the window here
    c.send_input_data(cst, {}, b"u" * room)
    assert c.data_room(cst, {}) == 0
    (inp,) = s.receive_data(b"".join(c.data_to_send()))
    assert isinstance(inp, InputReceived)
    s.ack_input(req.stream, room)
    (credit,) = c.receive_data(b"".join(s.data_to_send()))
    assert credit == CreditGranted(cst, room)
    s.respond(req.stream, {"size": room})
    (done,) = c.receive_data(b"".join(s.data_to_send()))
    assert done == ResponseReceived(cst.id, {"size": room})


def test_the_client_refuses_stream_data_beyond_the_credit_it_granted() -> None:
    c, _ = pair()
    rid = c.start("file.download", {"path": "/x"}).id
    c.data_to_send()
    half = encode_frame(Kind.EVENT, rid, {"ev": "data", "data": b"d" * (WINDOW // 2 - 5)})
    events = c.receive_data(half + half)
    assert [type(e) for e in events] == [EventReceived, EventReceived]
    (bad,) = c.receive_data(encode_frame(Kind.EVENT, rid, {"ev": "data", "data": b"d" * 11}))
    assert isinstance(bad, ConnectionFailed) and bad.error.code == "protocol_error"


def test_the_client_checks_reply_shapes_and_ignores_unknown_ids() -> None:
    c, _ = pair()
    rid = c.start("ping", {}).id
    c.data_to_send()
    assert c.receive_data(encode_frame(Kind.RESPONSE, rid + 5, {"t_ns": 1})) == []
    (ev,) = c.receive_data(encode_frame(Kind.RESPONSE, rid, {"t_ns": "nope"}))
    assert isinstance(ev, ErrorReceived) and ev.error.code == "protocol_error"


def test_client_ids_skip_zero_and_ids_in_flight_when_they_wrap() -> None:
    c, _ = pair()
    c._next_id = 0xFFFFFFFF
    first = c.start("ping", {}).id
    second = c.start("ping", {}).id
    assert (first, second) == (0xFFFFFFFF, 1)


def test_a_frame_over_the_clients_max_frame_closes_the_client() -> None:
    c, _ = pair()
    c.start("ping", {})
    c.data_to_send()
    (ev,) = c.receive_data(encode_frame(Kind.RESPONSE, 1, {"t_ns": 1, "pad": b"p" * MIN_MAX_FRAME}))
    assert isinstance(ev, ConnectionFailed)


def test_byte_by_byte_feeding_gives_the_same_events() -> None:
    s1, s2 = opened(), opened()
    stream = request(1, "file.upload", {"path": "/x"}) + encode_frame(Kind.INPUT, 1, {"data": b"abc", "eof": True})
    whole = s1.receive_data(stream)
    pieces = [e for i in range(len(stream)) for e in s2.receive_data(stream[i : i + 1])]

    def shape(events: list[Any]) -> list[tuple[Any, ...]]:
        return [(type(e).__name__, e.stream.id, e.stream.op, getattr(e, "args", None) or e.body) for e in events]

    assert shape(whole) == shape(pieces) and len(whole) == 2


def test_the_client_checks_event_shapes() -> None:
    c, _ = pair()
    rid = c.start("file.download", {"path": "/x"}).id
    c.data_to_send()
    (ev,) = c.receive_data(encode_frame(Kind.EVENT, rid, {"ev": "data", "data": "text, not bin"}))
    assert isinstance(ev, ConnectionFailed) and "malformed file.download event" in ev.error.message


# ------------------------------------------------------------------ the schema's constraints


class _Limits:
    max_output = 1000
    max_exec_timeout_s = 60.0
    max_chunk = 4096
    max_list_entries = 10
    max_ring_bytes = 1 << 20


def refusal(args: dict[str, Any], op: str = "exec") -> dict[str, Any]:
    s = opened(limits=_Limits())
    assert s.receive_data(request(1, op, args)) == []
    ((kind, rid, body, _),) = frames(s.data_to_send())
    assert (kind, rid) == (Kind.ERROR, 1)
    return body


def test_cross_field_rules_are_enforced_by_the_core() -> None:
    both = refusal({"argv": ["true"], "shell": "true"})
    assert (both["code"], both["details"]["field"]) == ("bad_request", "shell")
    neither = refusal({})
    assert (neither["code"], neither["details"]["field"]) == ("bad_request", "argv")
    stdin_twice = refusal({"argv": ["cat"], "stdin": b"x", "stdin_stream": True})
    assert stdin_twice["details"]["field"] == "stdin_stream"


def test_ranges_and_lengths_are_enforced_by_the_core() -> None:
    assert refusal({"argv": []})["details"] == {"field": "argv"}
    assert refusal({"argv": ["true"], "timeout_s": 0})["details"] == {"field": "timeout_s"}
    assert refusal({"argv": ["true"], "kill_grace_s": 61})["details"] == {"field": "kill_grace_s"}
    assert refusal({"id": "p1", "rows": 0, "cols": 80}, "process.resize")["details"] == {"field": "rows"}
    short = refusal({"generation": 2, "nonce": "n", "time_ns": 1, "entropy": b"short"}, "snapshot.restore")
    assert short["details"] == {"field": "entropy"}


def test_configured_limits_are_enforced_by_the_core_as_limit_errors() -> None:
    body = refusal({"argv": ["true"], "max_output": 1001})
    assert body["code"] == "limit"
    assert body["details"] == {"limit": "max_output", "value": 1000, "field": "max_output"}
    assert refusal({"argv": ["true"], "timeout_s": 61.0})["details"]["limit"] == "max_exec_timeout_s"
    assert refusal({"path": "/", "chunk": 4097}, "file.download")["details"]["limit"] == "max_chunk"
    assert refusal({"path": "/", "max_entries": 11}, "file.list")["details"]["limit"] == "max_list_entries"


def test_values_within_every_constraint_are_admitted() -> None:
    s = opened(limits=_Limits())
    args = {"argv": ["true"], "timeout_s": 60.0, "max_output": 1000, "kill_grace_s": 0, "stdin": b""}
    (ev,) = s.receive_data(request(1, "exec", args))
    assert isinstance(ev, RequestReceived) and ev.args["timeout_s"] == 60.0


def test_nested_results_are_typed_and_checked_by_the_client() -> None:
    c, _ = pair()
    rid = c.start("file.list", {"path": "/"}).id
    c.data_to_send()
    entry = {"name": "a", "type": "file", "size": -1, "mode": 0o644, "mtime_ns": 1}
    (ev,) = c.receive_data(encode_frame(Kind.RESPONSE, rid, {"entries": [entry], "total": 1, "truncated": False}))
    assert isinstance(ev, ErrorReceived) and ev.error.code == "protocol_error"
    assert "'entries[0].size'" in ev.error.message
    rid = c.start("file.list", {"path": "/"}).id
    good = {**entry, "size": 3, "name": b"bad\xff"}
    (ok,) = c.receive_data(encode_frame(Kind.RESPONSE, rid, {"entries": [good], "total": 1, "truncated": False}))
    assert isinstance(ok, ResponseReceived) and ok.body["entries"][0]["name"] == b"bad\xff"
