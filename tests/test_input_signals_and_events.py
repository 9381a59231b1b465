"""A second red-team pass over the session core and its adapters, after the first pass's
fixes: exec signals in every stdin mode, padded events against the client's bounds, and
thousands of serial hellos in one write. Each test failed before its fix.

Safety: all traffic is on Unix sockets; no test sends a hello with a far-off ``time_ns``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from guestd.client import Client, GuestdError, GuestProtocolError
from guestd.testing import Guestd
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind, encode_frame

SMALL = 64 * 1024


def hello_frame(**extra: Any) -> bytes:
    return encode_frame(Kind.HELLO, 0, {"versions": [1], "client": "redteam2", **extra})


def req(req_id: int, op: str, args: dict[str, Any] | None = None) -> bytes:
    return encode_frame(Kind.REQUEST, req_id, {"op": op, "args": args or {}})


def inp(req_id: int, **body: Any) -> bytes:
    return encode_frame(Kind.INPUT, req_id, body)


def final_within(p: RawPeer, req_id: int, seconds: float) -> tuple[int, dict[str, Any]] | None:
    """The final frame of ``req_id`` if it arrives within ``seconds``, else None."""
    p.sock.settimeout(seconds)
    try:
        return p.recv_final(req_id)
    except TimeoutError:
        return None
    finally:
        p.sock.settimeout(10)


# =================================================================== exec input: signals


def test_exec_with_stdin_bytes_can_still_be_signalled(guestd: Guestd) -> None:
    """PROTOCOL.md 7: input {signal} signals the process group of a running exec. With
    fixed ``stdin`` bytes the handler starts _feed_stdin (which returns once the bytes are
    written) and never installs handle_input: every signal lands in ctx.input, which
    nobody reads again. The process is never signalled."""
    p = RawPeer(guestd.raw_socket())
    p.hello()
    p.request(1, "exec", {"argv": ["sleep", "3"], "stdin": b"x"})
    time.sleep(0.3)  # running, its stdin written and closed
    p.send(Kind.INPUT, 1, {"signal": "KILL"})
    got = final_within(p, 1, 6)
    assert got is not None
    kind, body = got
    assert kind == Kind.RESPONSE
    assert body["signal"] == 9, f"the signal was never applied: exit_code {body['exit_code']}"


def test_exec_stdin_stream_signal_after_eof_is_applied(guestd: Guestd) -> None:
    """PROTOCOL.md 7: with stdin_stream the process still takes signals. Once the client
    sent eof, _feed_stdin returns and nothing reads ctx.input any more: a later signal
    (the usual way to stop `sleep`-like work after closing its stdin) is dropped."""
    p = RawPeer(guestd.raw_socket())
    p.hello()
    p.request(1, "exec", {"argv": ["sleep", "3"], "stdin_stream": True})
    p.send_bytes(inp(1, eof=True))
    time.sleep(0.3)
    p.send(Kind.INPUT, 1, {"signal": "KILL"})
    got = final_within(p, 1, 6)
    assert got is not None
    kind, body = got
    assert kind == Kind.RESPONSE
    assert body["signal"] == 9, f"the signal after eof was never applied: exit_code {body['exit_code']}"


def test_exec_stdin_stream_signal_is_not_stuck_behind_unread_stdin(guestd: Guestd) -> None:
    """PROTOCOL.md 7: input {signal} signals a running exec. With stdin_stream, signals go
    through the same queue as stdin data: when the process does not read its stdin (pipe
    full), _feed_stdin blocks in write_all and a signal queued behind the data is never
    applied. A stuck process cannot be interrupted (the obvious reason to signal it)."""
    p = RawPeer(guestd.raw_socket())
    p.hello()
    p.request(1, "exec", {"argv": ["sleep", "4"], "stdin_stream": True})
    p.send_bytes(inp(1, data=b"z" * 60_000) + inp(1, data=b"z" * 60_000) + inp(1, data=b"z" * 60_000))
    time.sleep(0.3)
    t0 = time.monotonic()
    p.send(Kind.INPUT, 1, {"signal": "KILL"})
    got = final_within(p, 1, 8)
    assert got is not None
    kind, body = got
    took = time.monotonic() - t0
    assert kind == Kind.RESPONSE
    assert body["signal"] == 9 and took < 2, f"signal stuck behind stdin: exit {body['exit_code']} after {took:.1f} s"


# =================================================================== the client against a hostile guest


@pytest.mark.parametrize("data", [b"", b"x"], ids=["empty-data", "one-byte-data"])
def test_padded_data_events_cannot_pin_unbounded_client_memory(evil: Any, data: bytes) -> None:
    """client/connection.py bounds queued events: data by the credit, others by
    MAX_PENDING_EVENTS / MAX_PENDING_EVENT_BYTES (16 MiB). But any event whose ``data`` is
    bytes counts as "data": only len(data) is charged (nothing at all for b""), while the
    frame may carry up to max_frame of extra keys (validate keeps unknown keys). A guest
    that pads exec stdout events holds 200 MiB in one call nobody reads events of."""

    def script(p: RawPeer) -> None:
        _, rid, _ = p.recv()
        junk = encode_frame(Kind.EVENT, rid, {"ev": "stdout", "data": data, "pad": b"j" * (1024 * 1024)})
        for _ in range(200):
            p.send_bytes(junk)
        p.send(Kind.ERROR, rid, {"code": "internal", "message": "done"})
        time.sleep(5)

    c = Client(evil(script), connect_timeout=5)

    async def go() -> int:
        conn = c.aio._conn
        call = conn.start("exec", {"argv": ["true"], "stream": True})
        try:
            await conn.wait(call, 20)
        except GuestProtocolError:
            return 0  # refusing such a guest is fine
        except GuestdError:
            pass
        return sum(size for _body, size in (call._events or ()))

    try:
        held = c._run(go())
    finally:
        c.close()
    assert held <= 16 * 1024 * 1024, f"one exec call holds {held >> 20} MiB of padded events the guest pushed"


def test_thousands_of_hellos_in_one_serial_write_do_not_recurse() -> None:
    """On a serial port every hello starts a new host session and releases the frames
    behind it. 3000 in one write were handled by recursion (hello -> resume -> hello ...),
    deeper than Python's limit; now a loop."""
    import asyncio

    from guestd.config import Config
    from guestd.server.connection import Connection
    from guestd.server.daemon import Daemon
    from guestd.testing.rawwire import SinkTransport
    from guestd.wire.frames import FrameDecoder

    async def serve() -> bytes:
        cfg = Config()
        cfg.simulate_privileged = True  # hellos without time_ns anyway: nothing touches the clock
        conn = Connection(Daemon(cfg), "serial-test", serial=True)
        sink = SinkTransport()
        conn.connection_made(sink)  # type: ignore[arg-type]
        hello = encode_frame(Kind.HELLO, 0, {"versions": [1]})
        conn.data_received(hello * 3000 + encode_frame(Kind.REQUEST, 7, {"op": "ping", "args": {}}))
        return bytes(sink.out)

    out = asyncio.run(serve())
    dec = FrameDecoder(1 << 30)
    dec.feed(out)
    kinds = []
    while (f := dec.next_frame()) is not None:
        kinds.append((f.kind, f.id))
    assert kinds.count((Kind.HELLO, 0)) == 3000 and kinds[-1] == (Kind.RESPONSE, 7)
