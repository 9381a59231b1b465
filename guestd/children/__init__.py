"""The child-process component: every workload process guestd starts is spawned, placed in
its run's cgroup, watched, reaped and ended here (exec, background processes, shells, kernels).

``Children.spawn`` starts a run: a leaf cgroup of its own (see ``cgroups``), the workload
user, a new session, fresh pipes or a pty, a normal OOM score and nice value, every CPU its
cpuset allows, and nothing of guestd's signal handlers, raised fd limit or CPU pinning (a guestd
pinned to a CPU of its own or run at a higher priority, so the control plane answers under load,
does not hand that CPU or priority to what it starts).
The native path (``_clone``) creates the process inside its leaf with clone3, as vfork does,
so no Python runs in a child of the daemon and nothing has to move between cgroups; it runs
in the native module's own spawn threads, which need no GIL: the loop hands a spawn over and
learns it is done through an eventfd, so it never waits for an exec, and no Python thread has
to be handed the GIL to pass a spawn along (that hop cost ~70 us each way per exec here). ``Child`` is the handle:
exit watch, exit fields, signals, and ``end`` (TERM, grace, then ``cgroup.kill`` of the whole
run).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from guestd.children.cgroups import WorkloadConfig
    from guestd.children.child import Child
    from guestd.children.launch import raise_fd_limit
    from guestd.children.records import ExitInfo, KilledBy, exit_info, run_figures, usage_between
    from guestd.children.spawner import DEVNULL, PIPE, STDOUT, Children

# Each name from the module that defines it, at its first use (PEP 562): guestd's start imports
# guestd.children.cgroups, which runs this file, and must not pay for the run handle, its
# records and the tree's helpers there (the first spawn loads them).
_DEFINED_IN = {
    "DEVNULL": "spawner",
    "PIPE": "spawner",
    "STDOUT": "spawner",
    "Child": "child",
    "Children": "spawner",
    "ExitInfo": "records",
    "KilledBy": "records",
    "WorkloadConfig": "cgroups",
    "exit_info": "records",
    "raise_fd_limit": "launch",
    "run_figures": "records",
    "usage_between": "records",
}


def __getattr__(name: str) -> object:
    module = _DEFINED_IN.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup finds it without this call
    return value


__all__ = [
    "DEVNULL",
    "PIPE",
    "STDOUT",
    "Child",
    "Children",
    "ExitInfo",
    "KilledBy",
    "WorkloadConfig",
    "exit_info",
    "raise_fd_limit",
    "run_figures",
    "usage_between",
]
