"""guestctl metrics [--watch S] | top: the guest's CPU, memory, disks, processes and pressure,
and a live view of them with the background processes guestd runs (curses on a terminal,
frames of plain text otherwise)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from guestd.cli.shared import Subcommands, UsageError, add_command, jsonable, print_json
from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient
from guestd.client.replies import MetricsSample
from guestd.client.results import OomKills

if TYPE_CHECKING:
    from guestd.client.replies import ProcessInfo

MiB = 1 << 20


def register(sub: Subcommands) -> None:
    m = add_command(sub, "metrics", metrics, help="CPU, memory, disks, processes, pressure of the guest")
    m.add_argument("--watch", type=float, default=None, metavar="S", help="a sample every S seconds until ^C")
    m.add_argument("--interval", type=float, default=0.2, metavar="S", help="one sample: CPU %% over S seconds")

    t = add_command(sub, "top", top, help="live view of the guest and its background processes (q quits)")
    t.add_argument("--interval", type=float, default=2.0, metavar="S", help="refresh every S seconds")
    t.add_argument("--once", action="store_true", help="one frame as plain text, then exit")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:5.1f}%"


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / MiB:.0f} MiB"


def render(s: MetricsSample) -> str:
    """A few lines for a person; --json has every field."""
    lines = [
        f"cpu {_pct(s.cpu_percent)} of {s.cpus}  workload {_pct(s.workload_cpu_percent)}"
        f"  processes {s.processes}" + (f" (workload tasks {s.workload_pids})" if s.workload_pids else ""),
        f"memory used {_mib(s.memory_used_bytes)} available {_mib(s.memory_available_bytes)}"
        f" of {_mib(s.memory_total_bytes)}  workload {_mib(s.workload_memory_bytes)}"
        f" (peak {_mib(s.workload_memory_peak_bytes)}, max {_mib(s.workload_memory_max_bytes)})"
        + (f"  OOM kills {s.workload_oom_kills}" if s.workload_oom_kills else ""),
    ]
    p = s.pressure
    if p is not None:
        lines.append(
            f"pressure (avg10) cpu {_pct(p.cpu_some)} memory {_pct(p.memory_some)}/{_pct(p.memory_full)}"
            f" io {_pct(p.io_some)}/{_pct(p.io_full)} (some/full)"
        )
    for d in s.disks:
        used = 100.0 * d.used_bytes / d.total_bytes if d.total_bytes else 0.0
        lines.append(
            f"  {field(d.mount):30} {field(d.fs):8} {_mib(d.used_bytes)} used, {_mib(d.free_bytes)} free"
            f" ({used:.0f}%), inodes {d.inodes_free} free of {d.inodes_total}"
        )
    return "\n".join(lines)


async def metrics(client: AsyncClient, ns: argparse.Namespace) -> int:
    if ns.watch is None:
        s = await client.metrics(interval_ms=round(ns.interval * 1000))
        print_json(s) if ns.json else print(render(s))
        return 0
    async for ev in client.watch_metrics(interval_ms=max(100, round(ns.watch * 1000))):
        if ns.json:
            print_json({"ev": "oom", **jsonable(ev)} if isinstance(ev, OomKills) else {"ev": "sample", "sample": ev})
        elif isinstance(ev, OomKills):
            print(f"guestctl: the OOM killer struck in the workload ({ev.new} new)", file=sys.stderr)
        else:
            print(render(ev) + "\n", flush=True)
    return 0


def frame(s: MetricsSample, procs: list[ProcessInfo], width: int = 120) -> list[str]:
    """One screen: the sample, then the background processes, busiest first."""
    lines = [*render(s).splitlines(), "", f"{'ID':14} {'PID':>7} {'STATE':8} {'CPU s':>8} {'RSS':>9}  COMMAND"]
    procs = sorted(procs, key=lambda p: -(p.cpu_s or 0.0))
    for p in procs:
        state = p.state if p.state == "running" else (p.killed_by or f"exit {p.exit_code}")
        cpu = p.cpu_s if p.state == "running" else (p.cpu_user_s or 0.0) + (p.cpu_sys_s or 0.0)
        cpu_text = "-" if cpu is None else f"{cpu:8.2f}"
        lines.append(f"{field(p.id):14} {p.pid:>7} {field(state):8} {cpu_text:>8} {_mib(p.rss):>9}  {field(p.command)}")
    return [ln[:width] for ln in lines]


async def top(client: AsyncClient, ns: argparse.Namespace) -> int:
    if ns.json:
        raise UsageError("top draws a screen; for JSON Lines use 'guestctl metrics --watch S --json'")
    interval_ms = max(100, round(ns.interval * 1000))
    if ns.once or not sys.stdout.isatty():
        async for ev in client.watch_metrics(interval_ms=interval_ms, count=None if not ns.once else 1):
            if isinstance(ev, MetricsSample):
                print("\n".join(frame(ev, await client.process_list())) + "\n", flush=True)
        return 0
    import curses  # the standard library's; only for a terminal

    screen = curses.initscr()
    try:
        curses.noecho()
        curses.cbreak()
        screen.nodelay(True)
        async for ev in client.watch_metrics(interval_ms=interval_ms):
            if screen.getch() in (ord("q"), ord("Q")):
                break
            if not isinstance(ev, MetricsSample):
                continue
            rows, cols = screen.getmaxyx()
            screen.erase()
            for y, line in enumerate(frame(ev, await client.process_list(), cols - 1)[: rows - 1]):
                screen.addstr(y, 0, line)
            screen.refresh()
    finally:
        curses.nocbreak()
        curses.echo()
        curses.endwin()
    return 0
