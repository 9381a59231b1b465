"""Telling the workload it was cloned: a file it can read, and a signal to the processes that
asked for one. PROTOCOL.md 11, "The workload learns of a restore".

The file is ``<runtime_dir>/clone/generation`` (default /run/guestd/clone/generation), JSON,
replaced atomically before any signal goes out. A process asks for a signal by being started
with ``GUESTD_ON_RESTORE=<signal>`` in its environment (USR2, HUP, 12...) and a handler installed
for that signal: guestd reads the environment each process was started with, so nothing the
workload writes later can make it signal another process, and skips processes that do not
catch the signal (children that inherited the variable, a ``sleep`` in a shell loop), which
it would only kill. Only processes of the workload (its cgroup, or without one the
workload user's) are looked at, never guestd's own.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

from guestd.children.options import parse_signal

ENV_NAME = "GUESTD_ON_RESTORE"
_NEEDLE = ENV_NAME.encode() + b"="
MAX_ENVIRON = 1 << 20  # bytes of /proc/PID/environ read per process


def write_generation_file(runtime_dir: str, record: dict[str, Any]) -> str:
    """The record as JSON in ``<runtime_dir>/clone/generation`` (0644 in a 0755 directory; the
    runtime dir becomes 0711: traversable, not listable). Returns the path."""
    import json  # off the start path (~1.8 ms); in memory since snapshot.prepare (state.load_restore_imports)

    os.chmod(runtime_dir, 0o711)
    d = os.path.join(runtime_dir, "clone")
    os.makedirs(d, mode=0o755, exist_ok=True)
    os.chmod(d, 0o755)
    path = os.path.join(d, "generation")
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, json.dumps(record, sort_keys=True).encode() + b"\n")
        os.fchmod(fd, 0o644)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def _workload_pids(workload: str | None, uid: int | None) -> list[int]:
    if workload is not None:
        pids: list[int] = []
        for d, _dirs, _files in os.walk(workload):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(d, "cgroup.procs")) as f:
                pids += [int(x) for x in f.read().split()]
        return pids
    try:
        every = [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []
    if uid is None:
        return every
    out = []
    for pid in every:
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}").st_uid == uid:
                out.append(pid)
    return out


def requested_signal(pid: int) -> int | None:
    """The signal ``pid`` was started asking for (GUESTD_ON_RESTORE in its environ), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read(MAX_ENVIRON)
    except OSError:
        return None
    for entry in env.split(b"\0"):
        if entry.startswith(_NEEDLE):
            sig = parse_signal(entry[len(_NEEDLE) :].decode("ascii", "replace"))
            return sig if sig not in (None, signal.SIGKILL, signal.SIGSTOP) else None
    return None


def catches(pid: int, sig: int) -> bool:
    """``pid`` has a handler installed for ``sig`` (SigCgt of /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def signal_registered(workload: str | None, uid: int | None) -> list[int]:
    """Send each registered workload process its signal; returns the pids signalled."""
    me = os.getpid()
    done = []
    for pid in _workload_pids(workload, uid):
        if pid == me:
            continue
        # A pidfd first: should the process end and its pid be reused while its environment
        # is read, the signal goes nowhere instead of to the newcomer.
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            sig = requested_signal(pid)
            if sig is None or not catches(pid, sig):
                continue  # a child that inherited the variable would only die of it
            signal.pidfd_send_signal(pidfd, sig)
            done.append(pid)
        except OSError:
            continue
        finally:
            os.close(pidfd)
    return sorted(done)
