"""The workload's own cgroup v2: memory, pids and CPU limits that keep guestd alive.

Everything guestd starts (exec, background processes, shells, code kernels) is placed in
one cgroup (default /sys/fs/cgroup/guestd-workload) whose limits come from the config. A
fork bomb hits pids.max, a memory hog meets the OOM killer inside the cgroup, and a CPU
spinner gets cpu.weight 1 against guestd's 100 - guestd keeps answering.

Children join the cgroup in the child before exec (so nothing they fork escapes). That
needs a preexec step, which makes Python fork instead of vfork: exec costs more when this
is on. Without cgroup v2, without root, or when `[workload] cgroup = ""`, everything
runs as before and `info` says so.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("guestd.workload")


@dataclass
class WorkloadConfig:
    cgroup: str = ""  # "" disables; e.g. "/sys/fs/cgroup/guestd-workload"
    memory_max: str = "max"  # bytes, or "max"
    pids_max: str = "max"
    cpu_weight: int = 1  # 1..10000; guestd (in the parent) keeps the default 100


class WorkloadCgroup:
    def __init__(self, cfg: WorkloadConfig) -> None:
        self.cfg = cfg
        self.path: str | None = None
        self.status = "disabled"

    def setup(self) -> None:
        c = self.cfg
        if not c.cgroup:
            return
        parent = os.path.dirname(c.cgroup)
        if not os.path.exists(os.path.join(parent, "cgroup.controllers")):
            self.status = "unavailable: no cgroup v2 at " + parent
            log.warning("workload cgroup %s", self.status)
            return
        try:
            os.makedirs(c.cgroup, exist_ok=True)
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write("+memory +pids +cpu")
            for name, value in (
                ("memory.max", c.memory_max),
                ("pids.max", c.pids_max),
                ("cpu.weight", str(c.cpu_weight)),
            ):
                with open(os.path.join(c.cgroup, name), "w") as f:
                    f.write(str(value))
        except OSError as exc:
            self.status = f"unavailable: {exc}"
            log.warning("workload cgroup %s", self.status)
            return
        self.path = c.cgroup
        self.status = (
            f"active: {c.cgroup} (memory.max={c.memory_max}, pids.max={c.pids_max}, cpu.weight={c.cpu_weight})"
        )
        log.info("workload cgroup %s", self.status)

    def popen_kwargs(self) -> dict[str, Any]:
        """preexec_fn that moves the child into the cgroup before it execs (or nothing)."""
        if self.path is None:
            return {}
        procs = os.path.join(self.path, "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write("0")

        return {"preexec_fn": join}

    def adopt(self, pid: int) -> None:
        """Move an already started process (a code kernel, started by jupyter_client)."""
        if self.path is None:
            return
        try:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        except OSError as exc:
            log.warning("could not move pid %d into the workload cgroup: %s", pid, exc)
