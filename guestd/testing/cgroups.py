"""A guestd in the shipped configuration on a host: a workload cgroup in a scratch sub-tree of
this host's cgroup v2 (the hybrid layout's /sys/fs/cgroup/unified here) and a workload user.

Only sub-trees made here are touched, and ``remove_tree`` kills and removes them afterwards.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

from guestd.testing.local import Guestd, start_guestd

UNIFIED = "/sys/fs/cgroup/unified"


def cgroup_usable() -> bool:
    """Root, and a cgroup v2 hierarchy we may make a scratch sub-tree in."""
    return os.geteuid() == 0 and os.access(os.path.join(UNIFIED, "cgroup.procs"), os.W_OK)


def make_scratch(prefix: str = "guestd-test") -> str:
    path = os.path.join(UNIFIED, f"{prefix}-{os.getpid()}-{os.urandom(3).hex()}")
    os.mkdir(path)
    return path


def remove_tree(path: str) -> None:
    """Kill and remove a scratch cgroup tree, deepest first (only ever one we made)."""
    for root, dirs, _files in sorted(os.walk(path), key=lambda t: -t[0].count("/")):
        for d in dirs:
            _kill_and_rmdir(os.path.join(root, d))
    _kill_and_rmdir(path)


def _kill_and_rmdir(path: str) -> None:
    with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.kill"), "w") as f:
        f.write("1")
    for _ in range(200):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def contained_config(directory: str, cgroup: str, user: str | None = "nobody") -> str:
    """The shipped settings that matter here: a workload cgroup and a workload user."""
    path = os.path.join(directory, "contained.toml")
    with open(path, "w") as f:
        f.write(f'[workload]\ncgroup = "{cgroup}"\n')
        if user is not None:
            f.write(f'[policy]\nworkload_user = "{user}"\n')
    return path


def start_contained(scratch: str, name: str, user: str | None = "nobody") -> Guestd:
    """A guestd whose workload cgroup is ``scratch``/``name``."""
    d = tempfile.mkdtemp(prefix="guestd-contained-")
    os.chmod(d, 0o755)
    return start_guestd(d, "--config", contained_config(d, os.path.join(scratch, name), user))
