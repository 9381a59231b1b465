"""system handlers: ping and info."""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any

from guestd import __version__
from guestd.services import add_ops, op
from guestd.wire.schema import PROTOCOL_VERSION

if TYPE_CHECKING:
    from guestd.services import Services


class SystemCapability:
    """ping and info: inline ops, answered as the request is read."""

    def __init__(self, services: Services) -> None:
        self.services = services

    @op("ping", inline=True)
    def ping(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"t_ns": time.monotonic_ns()}

    @op("info", inline=True)
    def info(self, args: dict[str, Any]) -> dict[str, Any]:
        import psutil  # lazily: idle memory should not pay for it

        vm = psutil.virtual_memory()
        try:
            du = psutil.disk_usage("/")
            disk = {"total": du.total, "used": du.used, "free": du.free}
        except OSError:
            disk = {}
        reply: dict[str, Any] = {
            "version": __version__,
            "protocol_version": PROTOCOL_VERSION,
            "capabilities": self.services.ops.capabilities(),
            "ops": self.services.ops.ops(),
            "limits": self.services.config.limits.as_dict(),
            "boot_id": self.services.host.boot_id,
            "pid": os.getpid(),
            "uptime_s": time.monotonic() - self.services.host.started_mono,
            "host_uptime_s": time.time() - psutil.boot_time(),
            "load": list(os.getloadavg()),
            "memory": {"total": vm.total, "available": vm.available, "used": vm.used},
            "disk": disk,
            "cpu_count": os.cpu_count() or 1,
            "connections": self.services.host.connection_count(),
            "hostname": socket.gethostname(),
            "workload_cgroup": self.services.workload.status,
            "spawn": self.services.children.spawn_method,
            "runs_ended_at_start": self.services.workload.ended_at_start,
        }
        for contribute in self.services.info:  # what other capabilities report (snapshot state)
            reply.update(contribute())
        return reply


def register(services: Services) -> None:
    system = SystemCapability(services)
    add_ops(services.ops, system)
