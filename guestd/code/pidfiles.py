"""Kernel pid files: written while a kernel lives, read to reap the kernels a crashed guestd left behind.

A file ``<kernel id>.pid`` in guestd's kernel directory holds ``<pid> <start time>`` and, for a
kernelspec's kernel, ``foreign`` (its command line is its kernelspec's, not guestd's launcher).
Kernel ids are ``k<guestd pid>-...``, so the files of a guestd that is still running (another
instance sharing the directory) are told apart and left alone. The start time guards against
a reused pid: only the process that was recorded is killed.
"""

from __future__ import annotations

import logging
import os
import re
import signal

from guestd.children.cgroups import guestd_running
from guestd.code.kernel import PRIVATE_NAME

log = logging.getLogger("guestd.code")


def pidfile_path(kernel_dir: str, kid: str) -> str:
    return os.path.join(kernel_dir, f"{kid}.pid")


def write_pidfile(kernel_dir: str, kid: str, pid: int, *, foreign: bool) -> None:
    """Record kernel ``kid``'s process, best effort: PR_SET_PDEATHSIG is the first line of defence."""
    try:
        import psutil

        ctime = psutil.Process(pid).create_time()
        with open(pidfile_path(kernel_dir, kid), "w") as f:
            # A foreign kernel's command line is its kernelspec's, not guestd.code.kernel.
            f.write(f"{pid} {ctime}" + (" foreign\n" if foreign else "\n"))
    except (OSError, ImportError, Exception):
        log.debug("could not record kernel pid", exc_info=True)


def remove_pidfile(kernel_dir: str, kid: str) -> None:
    try:
        os.unlink(pidfile_path(kernel_dir, kid))
    except OSError:
        pass


def _owner_alive(name: str) -> bool:
    """Kernel ids are ``k<guestd pid>-...``: is the guestd that made this file still running?"""
    m = re.match(r"k(\d+)-", name)
    if not m:
        return False
    owner = int(m.group(1))
    return owner == os.getpid() or guestd_running(owner)


def reap_orphan_kernels(kernel_dir: str) -> int:
    """Kill kernels whose guestd is gone (it crashed; their pid files survived it). Returns how many.

    Files of a guestd that is still running (another instance sharing the directory)
    are left alone.
    """
    killed = 0
    try:
        names = os.listdir(kernel_dir)
    except OSError:
        return 0
    for n in names:
        if _owner_alive(n):
            continue
        path = os.path.join(kernel_dir, n)
        if n.endswith(".pid"):
            try:
                with open(path) as f:
                    words = f.read().split()
                pid, ctime = int(words[0]), float(words[1])
                foreign = words[2:3] == ["foreign"]  # its command line is its kernelspec's
                import psutil

                p = psutil.Process(pid)
                command = " ".join(p.cmdline())
                ours = "guestd.code.kernel" in command or PRIVATE_NAME in command  # own or workload Python
                if abs(p.create_time() - ctime) < 0.01 and (foreign or ours):
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        p.kill()
                    killed += 1
            except Exception:
                pass
        try:
            os.unlink(path)
        except OSError:
            pass
    return killed
