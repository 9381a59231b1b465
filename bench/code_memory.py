"""guestd's peak RSS while code contexts send it large output (issue 21, defect 1).

    .venv/bin/python -m bench.code_memory [--print-mb 100] [--bundles 8] [--bundle-mb 20]

One guestd, one context, in the same run: a cell that prints ``--print-mb`` MB at once, then a
cell that displays ``--bundles`` JSON bundles of ``--bundle-mb`` MB each. For each: guestd's
RSS before, its peak during the run (sampled every 2 ms from another thread), the run's
status and counts, and a ping's latency taken while the cell runs. Prints a Markdown table
and writes bench/out/code_memory.json.

Last run (2026-12-01, 2 CPUs; defaults but --bundle-mb 50):

| case | RSS before MiB | peak MiB | growth MiB | status | stdout bytes | results | dropped | ping max ms |
|---|---|---|---|---|---|---|---|---|
| one 100 MB print | 39.5 | 43.2 | 3.8 | ok | 100000001 | 0 | 0 | 4.2 |
| 8 JSON bundles of 50 MB | 43.2 | 43.2 | 0.0 | ok | 25 | 0 | 8 | 3.7 |

Before issue 21 (its measurements): the 100 MB print peaked at 328 MiB; 8 x 50 MB bundles took
guestd to 1.19 GiB with a 1.76 s ping stall, and 4 x 8 MB already made the reply too_large.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time
from typing import Any

import psutil

from guestd.client import AsyncClient
from guestd.testing import start_guestd

MIB = 1024 * 1024


class Peak:
    """Peak RSS of one process, sampled from a thread while a block runs."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> Peak:
        self.peak = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def measure(c: AsyncClient, ctx: str, pid: int, name: str, code: str) -> dict[str, Any]:
    before = psutil.Process(pid).memory_info().rss
    pings: list[float] = []
    with Peak(pid) as peak:
        run = asyncio.ensure_future(c.code_run(code, context=ctx, timeout_s=600, deadline=700))
        while not run.done():
            t = time.perf_counter()
            await c.ping()
            pings.append(time.perf_counter() - t)
            await asyncio.sleep(0.01)
        r = await run
    return {
        "case": name,
        "rss_before_mib": before / MIB,
        "rss_peak_mib": peak.peak / MIB,
        "growth_mib": (peak.peak - before) / MIB,
        "status": r.status,
        "stdout_bytes": r.stdout_bytes,
        "results": len(r.results),
        "results_dropped": r.results_dropped,
        "ping_max_ms": max(pings, default=0.0) * 1000,
    }


async def bench(print_mb: int, bundles: int, bundle_mb: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="guestd-bench-code-") as d:
        g = start_guestd(d, "--runtime-dir", f"{d}/rt", "--code-pool", "0")
        try:
            c = await AsyncClient.connect(g.address)
            ctx = (await c.code_create(deadline=120)).id
            await c.code_run("1", context=ctx)
            rows = [
                await measure(c, ctx, g.pid, f"one {print_mb} MB print", f"print('x' * {print_mb * 1_000_000})"),
                await measure(
                    c,
                    ctx,
                    g.pid,
                    f"{bundles} JSON bundles of {bundle_mb} MB",
                    "from IPython.display import JSON, display\n"
                    f"big = {{'k': ['y' * 1000] * {bundle_mb * 1000}}}\n"
                    f"for _ in range({bundles}):\n    display(JSON(big))\n"
                    "print('status and stdout arrive')",
                ),
            ]
            await c.close()
            return rows
        finally:
            g.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print-mb", type=int, default=100)
    ap.add_argument("--bundles", type=int, default=8)
    ap.add_argument("--bundle-mb", type=int, default=20)
    a = ap.parse_args()
    rows = asyncio.run(bench(a.print_mb, a.bundles, a.bundle_mb))
    print("| case | RSS before MiB | peak MiB | growth MiB | status | stdout bytes | results | dropped | ping max ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['rss_before_mib']:.1f} | {r['rss_peak_mib']:.1f} | {r['growth_mib']:.1f} | "
            f"{r['status']} | {r['stdout_bytes']} | {r['results']} | {r['results_dropped']} | {r['ping_max_ms']:.1f} |"
        )
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "code_memory.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
