"""Start to first reply and idle RSS alone: the two measurements of bench/run.py's
``start_to_first_reply`` (floor, guestd as root, guestd in the shipped config, interleaved in
rounds), without the rest of the bench, for work on guestd's start-up.

    .venv/bin/python -m bench.start_idle [--rounds N]

Prints one JSON object: per kind the p50/p99 start (wall, and the server's CPU time up to its
first reply, which a busy machine inflates less) and the median idle RSS/PSS, each ratio to the
floor of the same run, and the load average before and after (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import uvloop

from bench.run import CLIENT_CPUS, start_to_first_reply
from bench.shipped import cgroup_unusable, scratch_cgroup, shared_dir


async def measure(tmp: str, rounds: int) -> dict[str, dict[str, Any]]:
    if cgroup_unusable() is not None:
        return await start_to_first_reply(tmp, rounds, None)
    with scratch_cgroup() as cgroup, shared_dir("guestd-bench-start-") as shared:
        return await start_to_first_reply(tmp, rounds, (cgroup, shared))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if CLIENT_CPUS:
        os.sched_setaffinity(0, CLIENT_CPUS)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="guestd-start-") as tmp:
        got = uvloop.run(measure(tmp, args.rounds))
    floor = got["floor"]
    out: dict[str, Any] = {"load_before": load_before, "load_after": os.getloadavg(), "rounds": args.rounds}
    for kind, r in got.items():
        start, cpu = r["start_to_first_reply"], r["start_cpu"]
        out[kind] = {
            "start_p50_ms": round(start["p50_ms"], 1),
            "start_p99_ms": round(start["p99_ms"], 1),
            "start_cpu_p50_ms": round(cpu["p50_ms"], 1),
            "idle_rss_MiB": round(r["idle_rss_MiB"], 2),
            "idle_pss_MiB": round(r["idle_pss_MiB"], 2),
            "start_ratio": round(start["p50_ms"] / floor["start_to_first_reply"]["p50_ms"], 3),
            "start_cpu_ratio": round(cpu["p50_ms"] / floor["start_cpu"]["p50_ms"], 3),
            "rss_ratio": round(r["idle_rss_MiB"] / floor["idle_rss_MiB"], 3),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
