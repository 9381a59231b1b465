"""The blocking client's callbacks run in the caller's thread; what waits for them is bounded in
bytes (CALLBACK_BACKLOG) whatever the events hold (found by a red-team pass, issue 30): a code
result or error counted 1 byte and an empty chunk 0, so while a callback was slow a hostile
guest grew the queue without bound (+201 MiB from 400 display events of 512 KiB). Now the loop stops
reading, and a guest that sends on regardless passes the connection's bound for unread events
and is cut off as a protocol violation."""

from __future__ import annotations

import tempfile
import threading
from typing import Any

import psutil

from guestd.client import Client, GuestdError
from guestd.testing.fakeguest import FakeGuest, answers, code_reply
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind

EVENTS = 200
BUNDLE = 512 * 1024  # 200 x 512 KiB = 100 MiB if nothing holds the guest back


def test_slow_result_callbacks_hold_back_a_flooding_guest() -> None:
    first_call = threading.Event()
    guest_done = threading.Event()

    def run(peer: RawPeer, rid: int, _args: dict[str, Any]) -> None:
        try:
            for _ in range(EVENTS):
                peer.send(Kind.EVENT, rid, {"ev": "display", "bundle": {"text/plain": "x" * BUNDLE}})
            peer.send(Kind.RESPONSE, rid, code_reply())
        finally:
            guest_done.set()

    me = psutil.Process()
    grown: list[int] = []
    base = 0

    def slow(_record: dict[str, Any]) -> None:
        if not first_call.is_set():
            first_call.set()
            # Give the loop thread every chance to read ahead: without a bound it queues it all.
            guest_done.wait(5)
            grown.append(me.memory_info().rss - base)

    with tempfile.TemporaryDirectory() as d:
        guest = FakeGuest(f"{d}/g.sock", answers({"code.run": run})).start()
        try:
            with Client(guest.address) as c:
                base = me.memory_info().rss
                try:
                    c.code_run("x", on_result=slow, deadline=120)
                except GuestdError as e:  # the guest went on past what an unread stream may hold
                    assert e.code == "protocol_error", e
        finally:
            guest.close()
    assert grown and grown[0] < 48 * 1024 * 1024, f"{grown[0] >> 20} MiB waited for the callback"
