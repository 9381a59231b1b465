"""metrics: one sample and the stream, against what /proc and statvfs say here; the workload's
CPU under a spinner in a run's cgroup; guestctl metrics. OOM kill counts need a memory
controller: tests/qemu/test_systemd.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from guestd.client import AsyncClient, GuestdError
from guestd.client.replies import MetricsSample
from guestd.testing import REPO, Guestd


def meminfo_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal:"))


def test_one_sample_matches_proc_and_statvfs(guestd: Guestd) -> None:
    with guestd.client() as c:
        s = c.metrics(interval_ms=100)
    assert s.interval_s is not None and 0.09 <= s.interval_s < 2.0
    assert s.cpus == os.cpu_count() and s.cpu_percent is not None and 0.0 <= s.cpu_percent <= 100.0
    assert s.memory_total_bytes == meminfo_total()
    assert s.memory_used_bytes == s.memory_total_bytes - s.memory_available_bytes
    assert s.processes >= 2 and s.workload_cpu_percent is None and s.workload_oom_kills is None
    root = [d for d in s.disks if d.mount == "/"]
    st = os.statvfs("/")
    assert len(root) == 1 and root[0].total_bytes == st.f_blocks * st.f_frsize
    assert not [d for d in s.disks if d.fs in ("proc", "sysfs", "cgroup2")]
    with guestd.client() as c:
        assert c.metrics(interval_ms=0).interval_s is None  # no window, no CPU %


def test_the_workloads_cpu_under_a_spinner(contained: Guestd) -> None:
    with contained.client() as c:
        p = c.process_start(["/usr/bin/python3", "-c", "while True: pass"])
        try:
            s = c.metrics(interval_ms=500)
        finally:
            c.process_signal(p.id, "KILL")
    wl = s.workload_cpu_percent
    assert wl is not None and 40.0 <= wl * s.cpus <= 110.0  # one CPU of them, spinning
    c2 = contained.client()
    with c2 as c:
        c.process_wait(p.id, timeout_s=10)
        idle = c.metrics(interval_ms=300).workload_cpu_percent
    assert idle is not None and idle * s.cpus < 20.0


def test_a_stream_of_samples_and_its_end(guestd: Guestd) -> None:
    async def go() -> None:
        async with await AsyncClient.connect(guestd.address) as c:
            got = [ev async for ev in c.watch_metrics(interval_ms=100, count=3)]
            assert [type(ev) for ev in got] == [MetricsSample] * 3
            assert all(
                isinstance(ev, MetricsSample) and ev.interval_s is not None and 0.05 <= ev.interval_s < 2.0
                for ev in got
            )
            async for ev in c.watch_metrics(interval_ms=100):  # no count: the caller stops it
                assert isinstance(ev, MetricsSample)
                break
            await c.ping()
            with pytest.raises(GuestdError) as ei:
                async for _ in c.watch_metrics(interval_ms=50):
                    pass
            assert ei.value.code == "bad_request"

    asyncio.run(go())


def test_guestctl_metrics(guestd: Guestd) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "guestd.cli", "--connect", guestd.address, *args],
            capture_output=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": REPO},
        )

    r = run("--json", "metrics", "--interval", "0.1")
    assert r.returncode == 0 and json.loads(r.stdout)["memory_total_bytes"] == meminfo_total()
    r = run("metrics")
    assert r.returncode == 0 and r.stdout.startswith(b"cpu ") and b"memory used" in r.stdout
    with guestd.client() as c:
        p = c.process_start(["sleep", "30"])
        try:
            r = run("top", "--once", "--interval", "0.1")
        finally:
            c.process_signal(p.id, "KILL")
    assert r.returncode == 0 and r.stdout.startswith(b"cpu ")
    [row] = [ln for ln in r.stdout.decode().splitlines() if ln.startswith(p.id)]
    assert str(p.pid) in row and "running" in row and row.endswith("sleep 30")
