"""Per-command latency of each framework's own local runtime against the same framework on
guestd, in the same run (issue 20). Needs the integration venv (scripts/bootstrap-integrations.sh):

    .venv-int/bin/python -m bench.integrations [--n 200]

- SWE-ReX: ``run_in_session(BashAction("echo hi"))`` on ``LocalRuntime`` (pexpect bash) and on
  ``GuestdRuntime`` (a local guestd on a Unix socket);
- mini-swe-agent: ``execute({"command": "echo hi"})`` on ``LocalEnvironment`` (a subprocess per
  command) and on ``GuestdEnvironment`` (one guestd exec per command).

Median and p90 in milliseconds, printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

from minisweagent.environments.local import LocalEnvironment
from swerex.runtime.abstract import AbstractRuntime, BashAction, CreateBashSessionRequest
from swerex.runtime.local import LocalRuntime

from guestd.integrations.minisweagent import GuestdEnvironment
from guestd.integrations.swerex import GuestdRuntime
from guestd.testing.local import start_guestd


def summary(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e3, ordered[int(len(ordered) * 0.9)] * 1e3


async def time_async(n: int, step: Callable[[], Awaitable[object]]) -> list[float]:
    await step()  # warm-up
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await step()
        out.append(time.perf_counter() - t)
    return out


def time_sync(n: int, step: Callable[[], object]) -> list[float]:
    step()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        out.append(time.perf_counter() - t)
    return out


async def swerex_samples(runtime: AbstractRuntime, n: int) -> list[float]:
    await runtime.create_session(CreateBashSessionRequest())
    try:
        return await time_async(n, lambda: runtime.run_in_session(BashAction(command="echo hi", timeout=30)))
    finally:
        await runtime.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    n = ap.parse_args().n
    rows: list[tuple[str, str, list[float]]] = []
    with tempfile.TemporaryDirectory(prefix="guestd-bench-int-") as d:
        g = start_guestd(d, ready_timeout_s=60)
        try:
            rows.append(("SWE-ReX run_in_session", "LocalRuntime", asyncio.run(swerex_samples(LocalRuntime(), n))))
            rows.append(
                ("SWE-ReX run_in_session", "GuestdRuntime", asyncio.run(swerex_samples(GuestdRuntime(g.address), n)))
            )
            local = LocalEnvironment()
            rows.append(
                (
                    "mini-swe-agent execute",
                    "LocalEnvironment",
                    time_sync(n, lambda: local.execute({"command": "echo hi"})),
                )
            )
            env = GuestdEnvironment(address=g.address)
            rows.append(
                (
                    "mini-swe-agent execute",
                    "GuestdEnvironment",
                    time_sync(n, lambda: env.execute({"command": "echo hi"})),
                )
            )
            env.close()
        finally:
            g.stop()
    print(f"| framework call (`echo hi`, n={n}) | runtime | median ms | p90 ms |")
    print("|---|---|---|---|")
    for what, runtime, samples in rows:
        med, p90 = summary(samples)
        print(f"| {what} | {runtime} | {med:.2f} | {p90:.2f} |")


if __name__ == "__main__":
    main()
