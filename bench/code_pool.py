"""The warm kernel pool under a burst of ``code.create``: what each create waits, how many the
pool served, and how long until the pool is full again, against a cold create in the same run.

    .venv/bin/python -m bench.code_pool [--rounds N] [--pool P] [--burst K]

guestd runs with ``--code-pool P --code-prewarm``, pinned like bench/run.py's servers. Each round
waits for the pool to hold P kernels, sends K creates at once on one connection, and polls
``code.list``'s ``pool_ready`` until it is P again (bounded). The floor, interleaved in the same
rounds, is a cold create on a guestd without a pool (a kernel start plus guestd's own steps).
A pool that refills its P kernels one after another needs about P cold starts; one that starts
them side by side on a 2-CPU machine still shares the CPUs with the burst's own cold creates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
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


async def measure(rounds: int, pool: int, burst: int) -> dict[str, Any]:
    if SERVER_CPUS:
        os.sched_setaffinity(0, CLIENT_CPUS)
    with tempfile.TemporaryDirectory(prefix="guestd-bench-pool-") as tmp:
        pooled_sock, cold_sock = f"{tmp}/pooled.sock", f"{tmp}/cold.sock"
        pooled_gd = Proc(
            [*guestd_argv(pooled_sock), "--runtime-dir", f"{tmp}/rt-p", "--code-pool", str(pool), "--code-prewarm"],
            ready_via_fd=True,
        )
        cold_gd = Proc([*guestd_argv(cold_sock), "--runtime-dir", f"{tmp}/rt-c", "--code-pool", "0"], ready_via_fd=True)
        try:
            pc = await AsyncClient.connect(f"unix:{pooled_sock}")
            cc = await AsyncClient.connect(f"unix:{cold_sock}")
            await one_cold(cc)  # jupyter_client's import and the first kernel's caches, in neither figure
            cold: list[float] = []
            bursts: list[dict[str, Any]] = []
            for _ in range(rounds):
                cold.append(await one_cold(cc))
                bursts.append(await one_burst(pc, pool, burst))
            await pc.close()
            await cc.close()
        finally:
            pooled_gd.stop()
            cold_gd.stop()
    creates = [s for b in bursts for s in b["creates_s"]]
    refills = [b["refill_after_burst_s"] for b in bursts if b["refill_after_burst_s"] is not None]
    cold_p50 = statistics.median(cold)
    refill_p50 = statistics.median(refills) if refills else None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rounds": rounds,
        "pool": pool,
        "burst": burst,
        "cold_create": summary_ms(cold),
        "burst_create": summary_ms(creates),
        "pooled_per_burst": statistics.median(b["pooled"] for b in bursts),
        "refill_p50_s": refill_p50,
        "not_refilled": rounds - len(refills),
        "refill_vs_cold_starts": None if refill_p50 is None else refill_p50 / (pool * cold_p50),
        "load_average": os.getloadavg(),
    }


def render(res: dict[str, Any]) -> str:
    refill = res["refill_p50_s"]
    refill_text = "not refilled" if refill is None else f"{refill * 1000:.0f} ms"
    ratio = res["refill_vs_cold_starts"]
    return "\n".join(
        [
            f"Measured {res['date']} by `python -m bench.code_pool`: pool {res['pool']}, bursts of "
            f"{res['burst']} creates at once, {res['rounds']} rounds; load average "
            f"{res['load_average'][0]:.1f} when it ended (2 CPUs).",
            "",
            "| measure | value |",
            "|---|---|",
            f"| cold create p50 / p99 (floor: no pool) | {res['cold_create']['p50_ms']:.0f} / "
            f"{res['cold_create']['p99_ms']:.0f} ms |",
            f"| create in a burst p50 / p99 | {res['burst_create']['p50_ms']:.0f} / "
            f"{res['burst_create']['p99_ms']:.0f} ms |",
            f"| creates a burst got from the pool (median) | {res['pooled_per_burst']:g} of {res['burst']} |",
            f"| pool full again after the burst, p50 | {refill_text} |",
            f"| refill vs {res['pool']} cold create(s) one after another | "
            + ("-" if ratio is None else f"{ratio:.2f}x")
            + " |",
            "",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pool", type=int, default=2)
    ap.add_argument("--burst", type=int, default=4)
    ns = ap.parse_args()
    res = uvloop.run(measure(ns.rounds, ns.pool, ns.burst))
    print(json.dumps(res, indent=1))
    print(render(res))


if __name__ == "__main__":
    main()
