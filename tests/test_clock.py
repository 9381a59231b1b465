"""clock.check and the hello's host time: jumps of either clock against the guest's monotonic
clock, corrections, and a step back under running work said out loud. This machine's clock is
never touched: the privileged step is simulated, the host's clock is what the test claims."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from guestd.testing import Guestd, scratch_guestd

S = 10**9


@pytest.fixture(scope="module")
def cg() -> Iterator[Guestd]:
    with scratch_guestd("guestd-clock-", "--simulate-privileged", "--code-pool", "0") as g:
        yield g


def test_a_host_clock_jump_is_seen_and_corrected(cg: Guestd) -> None:
    with cg.client() as c:
        r = c.clock_check()
        assert abs(r.offset_s) < 0.2 and r.clock == "kept" and r.stepped_s is None
        assert r.since_last_s is not None  # the hello was the first observation
        assert r.host_jump_s is None and r.guest_jump_s is None and not r.backwards_under_runs
        r = c.clock_check(time_ns=time.time_ns() + 5 * S)  # the host's clock jumped 5 s ahead
        assert r.host_jump_s is not None and 4.5 < r.host_jump_s < 5.5
        assert -5.5 < r.offset_s < -4.5 and r.clock == "simulated"
        assert r.stepped_s is not None and 4.5 < r.stepped_s < 5.5 and not r.backwards_under_runs
        r = c.clock_check()  # and back (the simulated step left this clock as it was)
        assert r.host_jump_s is not None and -5.5 < r.host_jump_s < -4.5 and r.clock == "kept"
        clock = c.info().raw["snapshot"]["clock"]
        assert clock["host_jumps"] >= 2 and clock["last"]["source"] == "check"


def test_a_step_back_under_running_work_is_reported(cg: Guestd) -> None:
    with cg.client() as c:
        p = c.process_start(["sleep", "30"])
        r = c.clock_check(time_ns=time.time_ns() - 10 * S)  # the guest is 10 s ahead
        assert r.stepped_s is not None and -10.5 < r.stepped_s < -9.5
        assert r.runs_in_flight >= 1 and r.backwards_under_runs
        assert c.info().raw["snapshot"]["clock"]["backwards_under_runs"] >= 1
        c.process_signal(p.id, "KILL")
        c.process_wait(p.id, timeout_s=10)
        c.process_forget(p.id)
        deadline = time.monotonic() + 10
        while (r := c.clock_check(time_ns=time.time_ns() - 10 * S)).runs_in_flight:
            assert time.monotonic() < deadline, "the run never ended"
            time.sleep(0.05)
        assert r.stepped_s is not None and r.stepped_s < 0 and not r.backwards_under_runs
        assert c.clock_check().clock == "kept"


def test_a_hello_far_from_the_guest_clock_is_a_host_jump(cg: Guestd) -> None:
    from guestd.testing.rawwire import RawPeer
    from guestd.wire.frames import Kind

    with cg.client() as c:
        before = c.info().raw["snapshot"]["clock"]["host_jumps"]
    p = RawPeer(cg.raw_socket())
    p.send(Kind.HELLO, 0, {"versions": [1], "time_ns": time.time_ns() + 120 * S})  # 2 minutes "later"
    assert p.recv()[0] == Kind.HELLO
    with cg.client() as c:  # its own hello carries this machine's time: the host clock "jumped back"
        snap = c.info().raw["snapshot"]
        c.restore()
    assert snap["suspected_restore"] and snap["clock"]["host_jumps"] >= before + 2
    last = snap["clock"]["last"]
    assert last["source"] == "hello" and -121 < last["host_jump_s"] < -119
