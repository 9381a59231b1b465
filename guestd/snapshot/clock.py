"""The guest's wall clock against the host's: jumps and drift after the first sync.

Each observation is (guest monotonic, guest wall, host wall). Between two of them, the guest's
monotonic clock is the referee: a guest wall clock that moved more or less than it was stepped
(guest jump); a host clock that moved more or less than it was stepped on the host, or the VM
was paused or restored (host jump: a paused guest's monotonic clock stands still). Without a
jump, the two wall clocks' rates give the drift, once the observations are far enough apart
for a request's latency not to matter (DRIFT_MIN_S). guestd's own timeouts use the monotonic
clock; what a step of the wall clock can upset is the workload's (timers on CLOCK_REALTIME,
`timeout` among them), so a step backwards while runs are in flight is reported as such.
"""

from __future__ import annotations

import time
from typing import Any, Final

from guestd.wire.record import Record

JUMP_S = 1.0  # smaller disagreements are request latency and drift, not jumps
DRIFT_MIN_S = 10.0


class Observation(Record):  # a Record, not a dataclass: declared on the start path
    __slots__ = ("host_ns", "mono", "wall_ns")

    def __init__(self, mono: float, wall_ns: int, host_ns: int) -> None:
        self.mono: Final = mono
        self.wall_ns: Final = wall_ns
        self.host_ns: Final = host_ns


class ClockWatch:
    def __init__(self) -> None:
        self.last: Observation | None = None
        self.checks = 0
        self.host_jumps = 0
        self.guest_jumps = 0
        self.backwards_under_runs = 0
        self.last_report: dict[str, Any] | None = None

    def observe(self, host_ns: int, source: str) -> dict[str, Any]:
        """Compare with the previous observation; the report's fields: PROTOCOL.md 11, clock."""
        now = Observation(time.monotonic(), time.time_ns(), host_ns)
        report: dict[str, Any] = {
            "source": source,
            "offset_s": (now.wall_ns - host_ns) / 1e9,
            "since_last_s": None,
            "host_jump_s": None,
            "guest_jump_s": None,
            "drift_ppm": None,
        }
        last, self.last = self.last, now
        self.checks += 1
        if last is not None:
            mono = now.mono - last.mono
            report["since_last_s"] = mono
            guest = (now.wall_ns - last.wall_ns) / 1e9 - mono
            host = (now.host_ns - last.host_ns) / 1e9 - mono
            if abs(guest) > JUMP_S:
                report["guest_jump_s"] = guest
                self.guest_jumps += 1
            if abs(host) > JUMP_S:
                report["host_jump_s"] = host
                self.host_jumps += 1
            if report["guest_jump_s"] is None and report["host_jump_s"] is None and mono >= DRIFT_MIN_S:
                host_advance = (now.host_ns - last.host_ns) / 1e9
                if host_advance > 0:
                    report["drift_ppm"] = ((now.wall_ns - last.wall_ns) / 1e9 - host_advance) / host_advance * 1e6
        self.last_report = report
        return report

    def stepped(self, by_ns: int) -> None:
        """The guest's wall clock was set by ``by_ns``: the next comparison starts from here."""
        if self.last is not None:
            self.last = Observation(self.last.mono, self.last.wall_ns + by_ns, self.last.host_ns)

    def describe(self) -> dict[str, Any]:
        return {
            "checks": self.checks,
            "host_jumps": self.host_jumps,
            "guest_jumps": self.guest_jumps,
            "backwards_under_runs": self.backwards_under_runs,
            "last": self.last_report,
        }
