"""The warm kernel pool under a burst of ``code.create``: what each create waits, how many the
pool served, and how long until the pool is full again, against a cold create in the same run.

    .venv/bin/python -m bench.code_pool [--rounds N] [--pool P] [--burst K] [--variant NAME=DIR ...]

guestd runs with ``--code-pool P --code-prewarm``, pinned like bench/run.py's servers. Each round
waits for the pool to hold P kernels, sends K creates at once on one connection, and polls
``code.list``'s ``pool_ready`` until it is P again (bounded). The floor, interleaved in the same
rounds, is a cold create on a guestd without a pool (a kernel start plus guestd's own steps).
A pool that refills its P kernels one after another needs about P cold starts; one that starts
them side by side on a 2-CPU machine still shares the CPUs with the burst's own cold creates.
``--variant NAME=DIR`` adds a pooled guestd run from another checkout's ``guestd`` package (e.g.
``git worktree add /tmp/pool-old <commit>``), its bursts interleaved with this checkout's in
every round, so a change is measured against its parent under the same load.

Code pool under a burst (2026-12-03, 10 interleaved rounds, load average ~3 from other work on
the 2 CPUs; "old" is the pool before a create could claim a starting pool kernel, guestd/code
as at 5bd6be0^; "one at a time" is the new pool with POOL_STARTS_AT_ONCE = 1):

| pool 2, bursts of 4 (cold create p50 681 ms) | new | old | one at a time |
|---|---|---|---|
| create in a burst p50 / p99 | 682 / 1594 ms | 969 / 1958 ms | 688 / 1484 ms |
| whole burst done p50 / p99 | 1081 / 1594 ms | 1376 / 1958 ms | 1029 / 1484 ms |
| creates a burst got from the pool (median) | 4 of 4 | 2 of 4 | 3 of 4 |
| pool full again after the burst, p50 | 998 ms | 753 ms | 1484 ms |

| pool 1, bursts of 3 (the shipped pool size; 15 rounds, load ~4.8, cold p50 687 ms) | new | old |
|---|---|---|
| create in a burst p50 / p99 | 739 / 1815 ms | 1051 / 2916 ms |
| whole burst done p50 / p99 | 924 / 1815 ms | 1097 / 2916 ms |
| creates a burst got from the pool (median) | 2 of 3 | 1 of 3 |
| pool full again after the burst, p50 | 701 ms | 1 ms |

The old pool refilled during the burst (its kernels started beside the creates' cold ones, so it
was full again at once but every create waited longer); the new one refills after the creates
have their kernels: a create's p50 is 28-30% lower, a whole burst is done 16-21% sooner, and
the burst plus its refill take about as long as before (2.08 vs 2.13 s at pool 2). Two pool
starts side by side refill a pool of 2 a third sooner than one after another, with the same
create times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import uvloop

from bench.run import CLIENT_CPUS, SERVER_CPUS, Proc, guestd_argv, pin_all_threads, summary_ms
from guestd.client import AsyncClient

REFILL_BOUND_S = 120.0  # a pool that is not full again by then is reported as not refilled


async def pool_ready(c: AsyncClient) -> int:
    return int((await c.call("code.list"))["pool_ready"])


async def wait_pool(c: AsyncClient, size: int, bound_s: float) -> float | None:
    """Seconds until ``pool_ready`` reaches ``size`` (polled every 10 ms), None past the bound."""
    t0 = time.perf_counter()
    while await pool_ready(c) < size:
        if time.perf_counter() - t0 > bound_s:
            return None
        await asyncio.sleep(0.01)
    return time.perf_counter() - t0


async def timed_create(c: AsyncClient) -> tuple[float, bool, str]:
    t = time.perf_counter()
    ctx = await c.code_create()
    took = time.perf_counter() - t
    pin_all_threads(ctx.pid)
    return took, ctx.pooled, ctx.id


async def one_burst(c: AsyncClient, pool: int, burst: int) -> dict[str, Any]:
    if await wait_pool(c, pool, REFILL_BOUND_S) is None:
        raise RuntimeError(f"the pool never held {pool} kernels")
    t0 = time.perf_counter()
    made = await asyncio.gather(*(timed_create(c) for _ in range(burst)))
    burst_s = time.perf_counter() - t0
    refill = await wait_pool(c, pool, REFILL_BOUND_S)
    for _, _, ctx_id in made:
        await c.code_close(ctx_id)
    return {
        "creates_s": [m[0] for m in made],
        "pooled": sum(1 for m in made if m[1]),
        "burst_s": burst_s,
        "refill_after_burst_s": refill,
    }


async def one_cold(c: AsyncClient) -> float:
    took, pooled, ctx_id = await timed_create(c)
    assert not pooled, "the floor's guestd has no pool"
    await c.code_close(ctx_id)
    return took


def variant_argv(sock: str, package_dir: str | None) -> list[str]:
    """guestd's command line; with ``package_dir``, the guestd package found there first."""
    argv = guestd_argv(sock)
    if package_dir is None:
        return argv
    boot = (
        f"import runpy, sys; sys.path.insert(0, {package_dir!r}); "
        "runpy.run_module('guestd', run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", boot, *argv[3:]]  # argv[:3]: python -m guestd


def burst_summary(bursts: list[dict[str, Any]], pool: int, cold_p50: float) -> dict[str, Any]:
    creates = [s for b in bursts for s in b["creates_s"]]
    refills = [b["refill_after_burst_s"] for b in bursts if b["refill_after_burst_s"] is not None]
    refill_p50 = statistics.median(refills) if refills else None
    return {
        "burst_create": summary_ms(creates),
        "burst_done": summary_ms([b["burst_s"] for b in bursts]),
        "pooled_per_burst": statistics.median(b["pooled"] for b in bursts),
        "refill_p50_s": refill_p50,
        "not_refilled": len(bursts) - len(refills),
        "refill_vs_cold_starts": None if refill_p50 is None else refill_p50 / (pool * cold_p50),
    }


async def measure(rounds: int, pool: int, burst: int, variants: list[tuple[str, str | None]]) -> dict[str, Any]:
    if SERVER_CPUS:
        os.sched_setaffinity(0, CLIENT_CPUS)
    with tempfile.TemporaryDirectory(prefix="guestd-bench-pool-") as tmp:
        cold_sock = f"{tmp}/cold.sock"
        pooled_gds = [
            Proc(
                [
                    *variant_argv(f"{tmp}/pooled-{i}.sock", package_dir),
                    *("--runtime-dir", f"{tmp}/rt-p{i}", "--code-pool", str(pool), "--code-prewarm"),
                ],
                ready_via_fd=True,
            )
            for i, (_, package_dir) in enumerate(variants)
        ]
        cold_gd = Proc([*guestd_argv(cold_sock), "--runtime-dir", f"{tmp}/rt-c", "--code-pool", "0"], ready_via_fd=True)
        try:
            pcs = [await AsyncClient.connect(f"unix:{tmp}/pooled-{i}.sock") for i in range(len(variants))]
            cc = await AsyncClient.connect(f"unix:{cold_sock}")
            await one_cold(cc)  # jupyter_client's import and the first kernel's caches, in neither figure
            cold: list[float] = []
            bursts: list[list[dict[str, Any]]] = [[] for _ in variants]
            for r in range(rounds):
                cold.append(await one_cold(cc))
                order = list(range(len(variants)))
                if r % 2:
                    order.reverse()  # neither variant always goes first after the cold create
                for i in order:
                    bursts[i].append(await one_burst(pcs[i], pool, burst))
            for pc in pcs:
                await pc.close()
            await cc.close()
        finally:
            for gd in pooled_gds:
                gd.stop()
            cold_gd.stop()
    cold_p50 = statistics.median(cold)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rounds": rounds,
        "pool": pool,
        "burst": burst,
        "cold_create": summary_ms(cold),
        "variants": {
            name: burst_summary(runs, pool, cold_p50) for (name, _), runs in zip(variants, bursts, strict=True)
        },
        "load_average": os.getloadavg(),
    }


def render(res: dict[str, Any]) -> str:
    names = list(res["variants"])
    rows = [
        f"Measured {res['date']} by `python -m bench.code_pool`: pool {res['pool']}, bursts of "
        f"{res['burst']} creates at once, {res['rounds']} rounds; load average "
        f"{res['load_average'][0]:.1f} when it ended (2 CPUs). "
        f"Cold create p50 / p99 (floor: no pool): {res['cold_create']['p50_ms']:.0f} / "
        f"{res['cold_create']['p99_ms']:.0f} ms.",
        "",
        "| measure | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]

    def row(label: str, cell: Any) -> None:
        rows.append(f"| {label} | " + " | ".join(cell(res["variants"][n]) for n in names) + " |")

    def refill(v: dict[str, Any]) -> str:
        return "not refilled" if v["refill_p50_s"] is None else f"{v['refill_p50_s'] * 1000:.0f} ms"

    def ratio(v: dict[str, Any]) -> str:
        return "-" if v["refill_vs_cold_starts"] is None else f"{v['refill_vs_cold_starts']:.2f}x"

    row(
        "create in a burst p50 / p99",
        lambda v: f"{v['burst_create']['p50_ms']:.0f} / {v['burst_create']['p99_ms']:.0f} ms",
    )
    row("whole burst done p50 / p99", lambda v: f"{v['burst_done']['p50_ms']:.0f} / {v['burst_done']['p99_ms']:.0f} ms")
    row("creates a burst got from the pool (median)", lambda v: f"{v['pooled_per_burst']:g} of {res['burst']}")
    row("pool full again after the burst, p50", refill)
    row(f"refill vs {res['pool']} cold create(s) one after another", ratio)
    rows.append("")
    return "\n".join(rows)


def variant(text: str) -> tuple[str, str]:
    name, sep, package_dir = text.partition("=")
    if not sep or not os.path.isdir(os.path.join(package_dir, "guestd")):
        raise argparse.ArgumentTypeError(f"NAME=DIR with DIR/guestd a directory: {text!r}")
    return name, os.path.abspath(package_dir)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pool", type=int, default=2)
    ap.add_argument("--burst", type=int, default=4)
    ap.add_argument("--variant", type=variant, action="append", default=[], help="NAME=DIR: another checkout")
    ns = ap.parse_args()
    variants: list[tuple[str, str | None]] = [("this checkout", None), *ns.variant]
    res = uvloop.run(measure(ns.rounds, ns.pool, ns.burst, variants))
    print(json.dumps(res, indent=1))
    print(render(res))


if __name__ == "__main__":
    main()
