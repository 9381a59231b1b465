"""system capability: ping and info."""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any

from guestd import __version__
from guestd.wire.schema import PROTOCOL_VERSION

if TYPE_CHECKING:
    from guestd.server.daemon import Daemon


def register(daemon: Daemon) -> None:
    def ping(args: dict[str, Any]) -> dict[str, Any]:
        return {"t_ns": time.monotonic_ns()}

    def info(args: dict[str, Any]) -> dict[str, Any]:
        import psutil  # lazily: idle memory should not pay for it

        vm = psutil.virtual_memory()
        try:
            du = psutil.disk_usage("/")
            disk = {"total": du.total, "used": du.used, "free": du.free}
        except OSError:
            disk = {}
        return {
            "version": __version__,
            "protocol_version": PROTOCOL_VERSION,
            "capabilities": daemon.dispatcher.capabilities(),
            "ops": daemon.dispatcher.ops(),
            "limits": daemon.config.limits.as_dict(),
            "boot_id": daemon.boot_id,
            "pid": os.getpid(),
            "uptime_s": time.monotonic() - daemon.started_mono,
            "host_uptime_s": time.time() - psutil.boot_time(),
            "load": list(os.getloadavg()),
            "memory": {"total": vm.total, "available": vm.available, "used": vm.used},
            "disk": disk,
            "cpu_count": os.cpu_count() or 1,
            "connections": len(daemon.connections),
            "hostname": socket.gethostname(),
            "snapshot": daemon.snapshot.describe(),
            "workload_cgroup": daemon.workload.status,
            "spawn": daemon.children.spawn_method,
            "runs_ended_at_start": daemon.workload.ended_at_start,
        }

    daemon.dispatcher.add("ping", inline=ping)
    daemon.dispatcher.add("info", inline=info)
