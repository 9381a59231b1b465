"""guestctl metrics [--watch S]: the guest's CPU, memory, disks, processes and pressure."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from guestd.cli.shared import Subcommands, add_command, print_json
from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient

if TYPE_CHECKING:
    from guestd.wire.types import MetricsSampleRecord

MiB = 1 << 20


def register(sub: Subcommands) -> None:
    m = add_command(sub, "metrics", metrics, help="CPU, memory, disks, processes, pressure of the guest")
    m.add_argument("--watch", type=float, default=None, metavar="S", help="a sample every S seconds until ^C")
    m.add_argument("--interval", type=float, default=0.2, metavar="S", help="one sample: CPU %% over S seconds")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:5.1f}%"


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / MiB:.0f} MiB"


def render(s: MetricsSampleRecord) -> str:
    """A few lines for a person; --json has every field."""
    lines = [
        f"cpu {_pct(s['cpu_percent'])} of {s['cpus']}  workload {_pct(s['workload_cpu_percent'])}"
        f"  processes {s['processes']}" + (f" (workload tasks {s['workload_pids']})" if s["workload_pids"] else ""),
        f"memory used {_mib(s['memory_used_bytes'])} available {_mib(s['memory_available_bytes'])}"
        f" of {_mib(s['memory_total_bytes'])}  workload {_mib(s['workload_memory_bytes'])}"
        f" (peak {_mib(s['workload_memory_peak_bytes'])}, max {_mib(s['workload_memory_max_bytes'])})"
        + (f"  OOM kills {s['workload_oom_kills']}" if s["workload_oom_kills"] else ""),
    ]
    p = s["pressure"]
    if p is not None:
        lines.append(
            f"pressure (avg10) cpu {_pct(p['cpu_some'])} memory {_pct(p['memory_some'])}/{_pct(p['memory_full'])}"
            f" io {_pct(p['io_some'])}/{_pct(p['io_full'])} (some/full)"
        )
    for d in s["disks"]:
        used = 100.0 * d["used_bytes"] / d["total_bytes"] if d["total_bytes"] else 0.0
        lines.append(
            f"  {field(d['mount']):30} {field(d['fs']):8} {_mib(d['used_bytes'])} used, {_mib(d['free_bytes'])} free"
            f" ({used:.0f}%), inodes {d['inodes_free']} free of {d['inodes_total']}"
        )
    return "\n".join(lines)


async def metrics(client: AsyncClient, ns: argparse.Namespace) -> int:
    if ns.watch is None:
        s = await client.metrics(interval_ms=round(ns.interval * 1000))
        print_json(s) if ns.json else print(render(s))
        return 0
    async for kind, ev in client.watch_metrics(interval_ms=max(100, round(ns.watch * 1000))):
        if ns.json:
            print_json(ev)
        elif kind == "oom":
            print(f"guestctl: the OOM killer struck in the workload ({ev['new']} new)", file=sys.stderr)
        else:
            print(render(ev["sample"]) + "\n", flush=True)
    return 0
