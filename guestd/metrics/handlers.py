"""metrics handler: one sample, or a stream of them every interval_ms (engine: sampler.py)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from guestd.metrics.sampler import read_counters, sample
from guestd.services import add_ops, op
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.services import Request, Services
    from guestd.wire.types import MetricsArgs, MetricsReply, MetricsSampleRecord

MIN_STREAM_INTERVAL_MS = 100  # a stream's samples cost a few hundred us each: at most 10 a second


class MetricsCapability:
    """The metrics op: one sample, or a stream of them owned by the request."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def take(self, before_ms: int) -> MetricsSampleRecord:
        """One sample; its CPU % over the next ``before_ms`` (none when that is 0)."""
        path = self.services.workload.path
        before = None
        if before_ms > 0:
            before = read_counters(path)
            await asyncio.sleep(before_ms / 1000)
        now = read_counters(path)
        result: MetricsSampleRecord = await self.services.run_in_io(sample, path, before, now)
        return result

    @op("metrics", control=True)
    async def op_metrics(self, ctx: Request, a: MetricsArgs) -> MetricsReply:
        interval_ms = a["interval_ms"]
        if not a["stream"]:
            return {"sample": await self.take(interval_ms), "samples": 1}
        if interval_ms < MIN_STREAM_INTERVAL_MS:
            raise GuestdError(
                ErrorCode.BAD_REQUEST,
                f"a stream needs interval_ms >= {MIN_STREAM_INTERVAL_MS}",
                details={"field": "interval_ms", "limit": MIN_STREAM_INTERVAL_MS},
            )
        # Owned by this request: it ends with count samples, a cancel, or the connection.
        path = self.services.workload.path
        loop = asyncio.get_running_loop()
        before = read_counters(path)
        oom_seen: int | None = None
        sent = 0
        next_at = loop.time()
        while a["count"] is None or sent < a["count"]:
            next_at += interval_ms / 1000
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            now = read_counters(path)
            s: MetricsSampleRecord = await self.services.run_in_io(sample, path, before, now)
            before = now
            kills = s["workload_oom_kills"]
            if kills is not None and oom_seen is not None and kills > oom_seen:
                await ctx.send_event({"ev": "oom", "oom_kills": kills, "new": kills - oom_seen})
            oom_seen = kills
            await ctx.send_event({"ev": "sample", "sample": s})  # waits while the client is behind
            sent += 1
            next_at = max(next_at, loop.time() - interval_ms / 1000)  # a slow client skips, never bursts
        return {"sample": None, "samples": sent}


def register(services: Services) -> None:
    add_ops(services.ops, MetricsCapability(services))
