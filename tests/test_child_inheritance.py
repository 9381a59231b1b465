"""What guestd starts does not inherit guestd's CPU pinning or priority (issue 34).

An operator gives guestd a CPU of its own (CPUAffinity=) or a higher priority (Nice=) so the
control plane answers under an exec flood; the workload must not take them along: every run
gets every CPU its cpuset allows and nice 0, with the clone3 spawn and the subprocess fallback.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from guestd.testing.local import start_guestd

ALL_CPUS = sorted(os.sched_getaffinity(0))
PROBE = "grep Cpus_allowed_list /proc/self/status | cut -f2; cut -d' ' -f19 /proc/self/stat"


def _cpu_list(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _pinned_and_raised() -> None:
    os.sched_setaffinity(0, {ALL_CPUS[-1]})
    os.nice(-5)


@pytest.mark.skipif(len(ALL_CPUS) < 2 or os.geteuid() != 0, reason="needs 2 CPUs and root (a raised priority)")
@pytest.mark.parametrize("native", ["1", "0"], ids=["clone3", "subprocess"])
def test_a_run_gets_every_cpu_and_nice_0_from_a_pinned_raised_guestd(native: str, tmp_path: Any) -> None:
    g = start_guestd(str(tmp_path), preexec=_pinned_and_raised, env={"GUESTD_NATIVE_SPAWN": native})
    try:
        with open(f"/proc/{g.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[16] == "-5"  # guestd itself: raised
        assert sorted(os.sched_getaffinity(g.pid)) == [ALL_CPUS[-1]]  # and pinned
        with g.client() as c:
            out = c.exec(["sh", "-c", PROBE]).stdout.decode().split()
        assert _cpu_list(out[0]) == ALL_CPUS
        assert out[1] == "0"
    finally:
        g.stop()
