"""What ``metrics`` reports, read from /proc and the workload cgroup with the standard library.

A sample is two readings ``interval`` apart: CPU % is what the counters advanced by over that
window (/proc/stat for the guest, the workload cgroup's cpu.stat for the workload), the rest is
the second reading. Every file is small and read whole; statfs runs in guestd's I/O threads
(a mount that hangs must not stall the loop). Missing files (no memory controller, no PSI, no
workload cgroup) give nil, never an error.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guestd.wire.types import DiskUsageRecord, MetricsSampleRecord, PressureRecord

MAX_MOUNTS = 32  # a sample stays small whatever the guest mounts
# Mounts that hold no files of the workload's (pseudo and kernel file systems).
PSEUDO_FS = frozenset(
    {
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "devpts",
        "devtmpfs",
        "mqueue",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "fusectl",
        "hugetlbfs",
        "autofs",
        "binfmt_misc",
        "nsfs",
        "efivarfs",
        "selinuxfs",
        "rpc_pipefs",
        "ramfs",
    }
)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, ValueError):
        return None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None


def _keyed(text: str | None) -> dict[str, int]:
    """``name value`` lines (cpu.stat, memory.events, /proc/meminfo without the kB)."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


@dataclass(frozen=True)
class Reading:
    """The counters CPU % is computed from, at one moment."""

    mono: float
    busy_ticks: int  # /proc/stat: all CPUs, every state but idle and iowait
    total_ticks: int
    workload_usec: int | None  # the workload cgroup's cpu.stat usage_usec


def read_counters(workload: str | None) -> Reading:
    busy = total = 0
    stat = _read("/proc/stat") or ""
    for line in stat.splitlines():
        if line.startswith("cpu "):
            # user nice system idle iowait irq softirq steal (guest time is within user)
            ticks = [int(x) for x in line.split()[1:9]]
            total = sum(ticks)
            busy = total - ticks[3] - ticks[4]
            break
    usec = _keyed(_read(os.path.join(workload, "cpu.stat"))).get("usage_usec") if workload else None
    return Reading(time.monotonic(), busy, total, usec)


def _pressure(template: str) -> PressureRecord | None:
    """avg10 of the some/full lines of cpu, memory and io pressure (PSI, Linux 4.20), in %."""
    out: dict[str, float | None] = {}
    seen = False
    for res in ("cpu", "memory", "io"):
        text = _read(template.format(res))
        for kind in ("some", "full"):
            key = f"{res}_{kind}"
            out[key] = None
            for line in (text or "").splitlines():
                if line.startswith(kind + " "):
                    for field in line.split()[1:]:
                        if field.startswith("avg10="):
                            out[key] = float(field[6:])
                            seen = True
    if not seen:
        return None
    return {
        "cpu_some": out["cpu_some"],
        "memory_some": out["memory_some"],
        "memory_full": out["memory_full"],
        "io_some": out["io_some"],
        "io_full": out["io_full"],
    }


def mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of the real file systems, first mount of each device."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or not rest or rest[0] in PSEUDO_FS:
            continue
        dev, point = fields[2], fields[4].replace("\\040", " ")
        if dev in seen:
            continue
        seen.add(dev)
        out.append((point, rest[0]))
        if len(out) >= MAX_MOUNTS:
            break
    return out


def disk_usage(point: str, fstype: str) -> DiskUsageRecord | None:
    try:
        st = os.statvfs(point)
    except OSError:
        return None
    return {
        "mount": point,
        "fs": fstype,
        "total_bytes": st.f_blocks * st.f_frsize,
        "used_bytes": (st.f_blocks - st.f_bfree) * st.f_frsize,
        "free_bytes": st.f_bavail * st.f_frsize,
        "inodes_total": st.f_files,
        "inodes_free": st.f_ffree,
    }


def _processes() -> int:
    try:
        return sum(1 for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return 0


def sample(workload: str | None, before: Reading | None, now: Reading) -> MetricsSampleRecord:
    """The figures at ``now``; CPU % over ``before``..``now`` (nil without ``before``)."""
    cpus = os.cpu_count() or 1
    cpu = wl_cpu = interval = None
    if before is not None and now.mono > before.mono:
        interval = now.mono - before.mono
        if now.total_ticks > before.total_ticks:
            cpu = 100.0 * (now.busy_ticks - before.busy_ticks) / (now.total_ticks - before.total_ticks)
        if now.workload_usec is not None and before.workload_usec is not None:
            wl_cpu = 100.0 * (now.workload_usec - before.workload_usec) / 1e6 / (interval * cpus)
    mem = _keyed(_read("/proc/meminfo"))
    total, available = mem.get("MemTotal", 0) * 1024, mem.get("MemAvailable", 0) * 1024
    wl: dict[str, Any] = {}
    if workload is not None:
        events = _keyed(_read(os.path.join(workload, "memory.events")))
        wl = {
            "current": _int(_read(os.path.join(workload, "memory.current"))),
            "peak": _int(_read(os.path.join(workload, "memory.peak"))),
            "max": _int(_read(os.path.join(workload, "memory.max"))),
            "pids": _int(_read(os.path.join(workload, "pids.current"))),
            "oom": events.get("oom_kill"),
        }
    disks = [d for d in (disk_usage(p, fs) for p, fs in mounts()) if d is not None]
    return {
        "t": time.time(),
        "interval_s": interval,
        "cpus": cpus,
        "cpu_percent": cpu,
        "workload_cpu_percent": wl_cpu,
        "memory_total_bytes": total,
        "memory_available_bytes": available,
        "memory_used_bytes": max(0, total - available),
        "workload_memory_bytes": wl.get("current"),
        "workload_memory_peak_bytes": wl.get("peak"),
        "workload_memory_max_bytes": wl.get("max"),
        "processes": _processes(),
        "workload_pids": wl.get("pids"),
        "workload_oom_kills": wl.get("oom"),
        "pressure": _pressure("/proc/pressure/{}"),
        "workload_pressure": _pressure(os.path.join(workload, "{}.pressure")) if workload is not None else None,
        "disks": disks,
    }
